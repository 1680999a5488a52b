"""The sans-IO protocol against the regular expressions of the protocol text."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbus.protocol import (
    Control,
    ProtocolError,
    Publish,
    Subscribe,
    Unsubscribe,
    encode,
    parse,
    publish_key,
)


@pytest.mark.parametrize(
    "packet, event",
    [
        (b"SUB a/b", Subscribe(b"a/b")),
        (b"SUB ", Subscribe(b"")),
        (b"SUB a/*/c/\0ignored trailer\0with NUL", Subscribe(b"a/*/c/")),
        (b"UNSUB a/b", Unsubscribe(b"a/b")),
        (b"UNSUB a\0x", Unsubscribe(b"a")),
        (b"MSG a/b\0", Publish(b"a/b", b"")),
        (b"MSG a/b\0pay\0load", Publish(b"a/b", b"pay\0load")),
        (b"MSG \0x", Publish(b"", b"x")),
        (b"MSG k\0\xff\xfe\n", Publish(b"k", b"\xff\xfe\n")),
        (b"CMSG !/cred/whoami", Control(b"!/cred/whoami", None)),
        (b"CMSG !/cred/whoami\0", Control(b"!/cred/whoami", b"")),
        (b"CMSG blocking/soft/queue\0x\0y", Control(b"blocking/soft/queue", b"x\0y")),
    ],
)
def test_parse(packet, event):
    assert parse(packet) == event


@pytest.mark.parametrize(
    "packet, why",
    [
        (b"", "empty packet"),
        (b"MSG a/b", "MSG without NUL"),
        (b"MSG", "unknown message type"),
        (b"SUB", "unknown message type"),
        (b"PUB a\0b", "unknown message type"),
        (b"sub a", "unknown message type"),
        (b"SUBa", "unknown message type"),
        (b"\0MSG a\0b", "unknown message type"),
    ],
)
def test_parse_errors(packet, why):
    with pytest.raises(ProtocolError, match=why):
        parse(packet)


def test_encode():
    assert encode(Publish(b"a/b", b"x\0y")) == b"MSG a/b\0x\0y"
    assert encode(Subscribe(b"")) == b"SUB "
    assert encode(Unsubscribe(b"a/")) == b"UNSUB a/"
    assert encode(Control(b"!/cred/whoami")) == b"CMSG !/cred/whoami"
    assert encode(Control(b"k", b"")) == b"CMSG k\0"
    with pytest.raises(ProtocolError):
        encode(Publish(b"a\0b", b""))
    with pytest.raises(TypeError):
        encode(Subscribe("text"))


keys = st.binary().filter(lambda b: b"\0" not in b)
events = st.one_of(
    st.builds(Subscribe, keys),
    st.builds(Unsubscribe, keys),
    st.builds(Publish, keys, st.binary()),
    st.builds(Control, keys, st.none() | st.binary()),
)


@given(events)
def test_roundtrip(event):
    assert parse(encode(event)) == event


@given(st.binary(max_size=64))
def test_arbitrary_bytes_parse_or_protocol_error(packet):
    try:
        event = parse(packet)
    except ProtocolError:
        return
    assert isinstance(event, Subscribe | Unsubscribe | Publish | Control)


@given(keys, st.binary())
def test_publish_key_fast_path_agrees(key, payload):
    packet = encode(Publish(key, payload))
    assert publish_key(packet) == parse(packet).key
