"""columns.split against protocol.parse, over slots holding stale bytes from earlier packets."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from sbus import protocol
from sbus.journal.columns import WIDEST, Columns, split

SLOT = WIDEST + 1

keys = st.binary(max_size=40).filter(lambda k: b"\0" not in k)
msgs = st.builds(lambda k, p: b"MSG " + k + b"\0" + p, keys, st.binary(max_size=60))
others = st.sampled_from([b"", b"MSG", b"MSG ", b"MSG nokey", b"CMSG blocking/dropped\x003",
                          b"SUB a/\0", b"MSG\0x", b"x" * (WIDEST + 1)])


def slots_holding(packets: list[bytes], stale: bytes) -> tuple[np.ndarray, np.ndarray]:
    slots = np.frombuffer(bytearray(stale * (len(packets) * SLOT // len(stale) + 1))
                          [:len(packets) * SLOT], np.uint8).reshape(len(packets), SLOT).copy()
    for i, p in enumerate(packets):
        slots[i, :len(p)] = np.frombuffer(p, np.uint8)
    return slots, np.array([len(p) for p in packets], np.uint32)


def expected(packets: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    events = [protocol.parse(p) for p in packets]
    return [e.key for e in events], [e.payload for e in events]


def unpack(c: Columns) -> tuple[list[bytes], list[bytes]]:
    def cut(data, lengths):
        lengths = lengths.astype(np.int64)
        ends = np.cumsum(lengths)
        return [bytes(data[e - n:e]) for e, n in zip(ends, lengths, strict=True)]
    return cut(c.keys, c.key_lengths), cut(c.payloads, c.payload_lengths)


@given(st.lists(msgs, min_size=1, max_size=40), st.binary(min_size=1, max_size=7))
def test_split_matches_parse(packets, stale):
    slots, lengths = slots_holding(packets, stale)
    c = split(slots, lengths)
    assert c is not None and c.count == len(packets)
    slots[:] = 0  # the next receive: the columns own their bytes
    assert unpack(c) == expected(packets)


@given(st.lists(msgs, max_size=10), others, st.lists(msgs, max_size=10),
       st.binary(min_size=1, max_size=3))
def test_anything_but_msg_packets_is_left_to_the_caller(before, odd, after, stale):
    assert split(*slots_holding(before + [odd] + after, stale)) is None


def test_columns_of_lists_and_the_widest_packet():
    keys, payloads = [b"a/b", b"", b"\xff\xfe"], [b"\0x\0", b"", b"p" * 9]
    assert unpack(Columns.of(keys, payloads)) == (keys, payloads)
    widest = b"MSG k\0" + b"\0" * (WIDEST - 6)
    assert unpack(split(*slots_holding([widest], b"\0"))) == expected([widest])


@given(keys, st.lists(st.binary(max_size=60), min_size=1, max_size=40))
def test_one_key_in_every_packet(key, payloads):
    packets = [b"MSG " + key + b"\0" + p for p in payloads]
    slots, lengths = slots_holding(packets, b"\0")
    c = split(slots, lengths)
    slots[:] = 1
    assert unpack(c) == expected(packets)


def test_stale_bytes_of_a_longer_packet_are_not_read():
    slots, lengths = slots_holding([b"MSG k\0payload"] * 3, b"x")
    for cut in (0, 3, 4, 5):  # a packet that stops before the head's NUL
        short = lengths.copy()
        short[1] = cut
        assert split(slots, short) is None
    short[1] = 6  # "MSG k\0": an empty payload
    assert unpack(split(slots, short)) == ([b"k"] * 3, [b"payload", b"", b"payload"])
