"""The gateway's pure parts: the MessagePack frame codec, the outbox, HTTPS decisions."""

from __future__ import annotations

import base64
import json
import random

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbus.gateway import codec
from sbus.gateway.admission import Caps, Peer, Pool, peer_group
from sbus.gateway.codec import (
    Authenticate,
    FrameDecoder,
    FrameError,
    KeepAlive,
    Publish,
    Subscribe,
    Unsubscribe,
)
from sbus.gateway.https import decide
from sbus.gateway.outbox import Outbox, Shared, make_room
from sbus.keys import KeyRules

# -- encoding -----------------------------------------------------------------------


def test_publish_example_is_byte_exact():
    assert codec.publish(b"topic", b"body") == bytes.fromhex("04c405746f706963c404626f6479")


def test_keepalive_is_one_zero_byte():
    assert codec.keepalive() == codec.KEEPALIVE == b"\x00"
    assert codec.encode(KeepAlive()) == b"\x00"


def _packb(*values) -> bytes:
    return b"".join(msgpack.packb(v, use_bin_type=True) for v in values)


@pytest.mark.parametrize("size", [0, 1, 255, 256, 65535, 65536, 70000])
def test_encoders_match_msgpack_for_every_bin_width(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert codec.publish(b"t", data) == _packb(4, b"t", data)
    assert codec.subscribe(data) == _packb(2, data, None)
    assert codec.unsubscribe(data) == _packb(3, data, None)
    assert codec.authenticate(data) == _packb(1, None, data)


frames = st.one_of(
    st.just(KeepAlive()),
    st.builds(Authenticate, st.binary(max_size=40)),
    st.builds(Subscribe, st.binary(max_size=40)),
    st.builds(Unsubscribe, st.binary(max_size=40)),
    st.builds(Publish, st.binary(max_size=300), st.binary(max_size=3000)),
)


@given(st.lists(frames, max_size=30), st.lists(st.integers(1, 500), max_size=40))
def test_any_frames_survive_any_chunking(sent, cuts):
    stream = b"".join(codec.encode(f) for f in sent)
    decoder = FrameDecoder()
    got, pos = [], 0
    for cut in cuts:
        got += decoder.feed(stream[pos:pos + cut])
        pos += cut
    got += decoder.feed(stream[pos:])
    assert got == sent
    assert decoder.idle
    assert decoder.offset == len(stream)


def test_other_msgpack_encodings_of_the_same_values_are_accepted():
    # uint8 type, str (old raw type) topic and body, nil body on publish
    data = b"\xcc\x04" + b"\xa3abc" + b"\xd9\x03xyz" + b"\x04\xc4\x01t\xc0" + b"\x02\xa1k\xc4\x00"
    assert FrameDecoder().feed(data) == [Publish(b"abc", b"xyz"), Publish(b"t", b""),
                                         Subscribe(b"k")]


def test_keepalives_need_no_unpacker():
    decoder = FrameDecoder()
    assert decoder.feed(b"\x00\x00\x00") == [KeepAlive()] * 3
    assert decoder._unpacker is None
    decoder.feed(b"\x04\xc4\x01t")  # half a publish frame: kept as bytes, counted
    assert decoder._unpacker is None and not decoder.idle and decoder.held == 4
    assert decoder.feed(b"\xc4\x01b\x00") == [Publish(b"t", b"b"), KeepAlive()]
    assert decoder.idle and decoder._unpacker is None
    decoder.feed(b"\x02\xc4\x01t")  # half of any other frame holds one
    assert decoder._unpacker is not None and not decoder.idle
    assert decoder.feed(b"\xc0") == [Subscribe(b"t")]
    assert decoder.idle and decoder._unpacker is None


@pytest.mark.parametrize("data, message", [
    (b"\xc1", "malformed MessagePack at byte 0"),
    (b"\x00\x05\xc0\xc0", "unknown frame type 5 at byte 1"),
    (b"\xff", "unknown frame type -1 at byte 0"),
    (b"\xc0", "frame type at byte 0 is nil"),
    (b"\xc3", "frame type at byte 0 is a boolean"),
    (b"\xa1x", "frame type at byte 0 is bytes"),
    (b"\x91\x04", "MessagePack array at byte 0"),  # arrays are never valid
    (b"\x04\xc4\x01t\x81\x00\x00", "MessagePack map at byte 4"),  # nor maps
    (b"\xd4\x01\x00", "MessagePack ext at byte 0"),  # nor extension types
    (b"\x02\xc0\xc0", "subscribe frame with a nil topic at byte 1"),
    (b"\x04\xc0\xc4\x00", "publish frame with a nil topic at byte 1"),
    (b"\x04\x05\xc0", "publish frame topic at byte 1 is an integer"),
    (b"\x04\xc4\x01t\xcb" + bytes(8), "publish frame body at byte 4 is a float"),
    (b"\x01\xc0\xc0", "authenticate frame with a nil secret at byte 2"),
])
def test_malformed_input_is_named_precisely(data, message):
    with pytest.raises(FrameError, match=message):
        FrameDecoder().feed(data)


def test_oversized_frames_are_refused_as_they_arrive():
    decoder = FrameDecoder(max_frame=1000, read_size=512)
    # a body whose header announces 1 MB: refused once the buffer limit is passed,
    # long before a megabyte is buffered
    decoder.feed(b"\x04\xc4\x01t\xc6\x00\x10\x00\x00")
    with pytest.raises(FrameError, match="larger than the 1000-byte"):
        for _ in range(10):
            decoder.feed(bytes(512))


def test_topic_plus_body_limit_is_exact():
    decoder = FrameDecoder(max_frame=1000)
    assert decoder.feed(codec.publish(b"t" * 500, b"b" * 500)) == [Publish(b"t" * 500,
                                                                           b"b" * 500)]
    with pytest.raises(FrameError, match="carries 1001 bytes, over the 1000-byte limit"):
        decoder.feed(codec.publish(b"t" * 500, b"b" * 501))


# -- outbox --------------------------------------------------------------------------


def S(data: bytes) -> Shared:
    return Shared(data)


def test_outbox_discards_new_messages_beyond_its_count():
    box = Outbox(max_messages=3, max_bytes=1000)
    assert [box.offer(S(b"%d" % i)) for i in range(5)] == [1, 2, 2, 0, 0]  # 1: was empty
    assert box.dropped == 2 and box.dropped_by == [2, 0, 0]  # its own bound
    assert box.take() == b"012"  # the oldest are kept, the new ones discarded
    assert box.offer(S(b"x")) and len(box) == 1


def test_outbox_bounds_bytes_but_always_takes_one():
    box = Outbox(max_messages=100, max_bytes=10)
    assert box.offer(S(b"x" * 50))  # alone and too big: accepted, or it could never pass
    assert not box.offer(S(b"y"))
    assert box.take() == b"x" * 50 and box.size == 0
    assert box.offer(S(b"a" * 6)) and not box.offer(S(b"b" * 5)) and box.offer(S(b"c" * 4))
    assert box.force(b"\x00")  # keep-alive echoes pass a full buffer
    assert box.take(limit=6) == b"a" * 6 and box.take() == b"c" * 4 + b"\x00"
    small = Outbox(max_messages=2, max_bytes=100)
    assert [small.force(b"\x00") for _ in range(5)] == [True] * 4 + [False]  # up to 2x
    assert small.dropped == 0 and len(small) == 4
    assert small.force(b"notice", extra=1) and not small.force(b"notice", extra=1)  # more
    small.max_messages = 0  # (being cut): nothing more at all
    assert not small.force(b"\x00", extra=100)
    with pytest.raises(ValueError):
        Outbox(0, 10)


def test_a_shared_frame_is_charged_to_the_pool_once_while_any_outbox_holds_it():
    pool = Pool(100)
    boxes = [Outbox(10, 1000) for _ in range(300)]
    frame = S(b"x" * 60)
    assert all(box.offer(frame) for box in boxes)
    frame.hold(pool)
    assert pool.used == 60  # not 300 x 60: the bytes really held
    for box in boxes[:-1]:
        assert box.take() == b"x" * 60
    assert pool.used == 60
    boxes[-1].clear()
    assert pool.used == 0 and frame.refs == 0


def test_the_clients_of_one_address_share_a_queued_bytes_bound():
    peer = Peer("10.0.0.1", queue_limit=100)
    a, b = Outbox(10, 1000, peer), Outbox(10, 1000, peer)
    assert a.offer(S(b"x" * 60)) and b.offer(S(b"y" * 30))
    assert peer.queued == 90
    assert not a.offer(S(b"z" * 20)) and not b.offer(S(b"z" * 20))  # the address is full
    assert a.dropped_by == b.dropped_by == [0, 1, 0] and peer.dropped == [0, 2, 0]
    other = Outbox(10, 1000, Peer("10.0.0.2", queue_limit=100))
    assert other.offer(S(b"z" * 20))  # another address is not
    a.take()
    b.clear()
    assert peer.queued == 0


def test_a_partly_written_frame_stays_whole_in_the_stream():
    pool = Pool(1000)
    box = Outbox(10, 1000)
    for data in (b"abc", b"def"):
        frame = S(data)
        box.offer(frame)
        frame.hold(pool)
    assert box.peek() == b"abcdef" and len(box) == 2  # (left queued, and charged)
    box.done(4)  # "abcd" written
    assert box.size == 2 and box.peer.queued == 2 and pool.used == 2  # "ef", charged
    box.force(b"\x00")
    late = S(b"ghi")
    box.offer(late)
    late.hold(pool)
    assert box.evict() and box.dropped_by == [0, 0, 1]  # "ghi": the rest and echo stay
    assert not box.evict()
    assert box.take() == b"ef\x00" and pool.used == 0 and box.size == 0


def test_a_full_pool_takes_room_from_the_heaviest_address_not_a_prompt_reader():
    """Finding B: while the pool is full, a client of a light address gets a frame in
    place of the oldest of the address holding the most; nobody is scanned per frame."""
    pool = Pool(1000)
    heavy, other, light = Peer("h"), Peer("o"), Peer("l")
    peers = [heavy, other, light]
    boxes = {p: [Outbox(100, 10_000, p) for _ in range(3)] for p in (heavy, other)}
    for p in (heavy, other):
        p.conns = 3
        p.boxes = boxes[p]
    for i in range(10):  # 6 distinct frames for heavy, 4 for other: the pool is full
        frame = S(b"h%02d" % i + bytes(97)) if i < 6 else S(b"o%02d" % i + bytes(97))
        for box in boxes[heavy if i < 6 else other]:
            box.offer(frame)
        frame.hold(pool)
    assert pool.used == 1000
    fair = pool.limit // len(peers)
    assert not make_room(pool, 100, lambda: peers, fair=heavy.queued)  # none above fair
    assert make_room(pool, 100, lambda: peers, fair)
    assert pool.used == 900 and heavy in pool.heaviest
    dropped = [box.dropped_by for box in boxes[heavy]]
    assert dropped == [[0, 0, 1]] * 3 and heavy.dropped == [0, 0, 3]  # said as the pool's
    assert all(box.peek().startswith(b"h01") for box in boxes[heavy])  # the oldest went
    assert other.dropped == [0, 0, 0] and light.dropped == [0, 0, 0]


def test_room_is_made_from_frames_that_several_heavy_addresses_hold():
    """Clients of 100 addresses that never read hold the same frames (one object each,
    charged once): a frame goes from the pool only when all of them let it go.  Room
    was taken from the two heaviest addresses at most, which freed nothing, and a prompt
    reader lost messages while the pool was full."""
    pool = Pool(1000)
    heavy = [Peer(f"h{i}") for i in range(100)]
    light = Peer("l")
    for p in heavy:
        p.conns, p.boxes = 1, [Outbox(100, 10_000, p)]
    for i in range(10):  # the same 10 frames for all five
        frame = S(b"f%02d" % i + bytes(97))
        for p in heavy:
            p.boxes[0].offer(frame)
        frame.hold(pool)
    peers = [*heavy, light]
    assert pool.used == 1000 and all(p.queued == 1000 for p in heavy)
    assert make_room(pool, 100, lambda: peers, fair=pool.limit // len(peers))
    assert pool.used == 900  # the oldest frame went from all of them, said to each
    assert all(p.dropped == [0, 0, 1] and p.boxes[0].peek().startswith(b"f01")
               for p in heavy)


def test_echoes_queued_behind_a_frame_do_not_keep_the_messages_after_them():
    """A client that never reads but sends keep-alives queues echoes: only the first few
    frames were looked at for one to evict, so its messages behind the echoes stayed,
    the pool stayed full, and prompt readers lost everything (the re-audit)."""
    pool = Pool(10_000)
    box = Outbox(100, 10_000)
    for _ in range(6):
        box.force(b"\x00")
    frames = [S(b"m%d" % i) for i in range(3)]
    for frame in frames:
        box.offer(frame)
        frame.hold(pool)
    assert box.evict() and box.dropped_by == [0, 0, 1]
    assert box.take() == b"\x00" * 6 + b"m1m2"  # the oldest message went, echoes stay


def test_making_room_searches_for_the_heaviest_twice_at_most():
    """Each search looks at every address: making room for one frame, and then for every
    target of it after a failure, searched again and again (1.3 s of the loop for one
    fan-out to 5,000 addresses, in the re-audit)."""
    from sbus.gateway.outbox import SEARCHES

    pool = Pool(1000)
    peers = [Peer(f"p{i}") for i in range(50)]
    for p in peers:  # each holds a frame no eviction can free: a Rest
        box = Outbox(100, 10_000, p)
        p.conns, p.boxes = 1, [box]
        frame = S(bytes(20))
        box.offer(frame)
        frame.hold(pool)
        box.done(5)  # partly written: the rest of it is never evicted
    pool.used = pool.limit
    searches = []
    assert not make_room(pool, 100, lambda: searches.append(1) or peers, fair=0)
    assert len(searches) <= SEARCHES


def test_caps_per_address_and_in_total():
    caps = Caps(total=3, per_peer=2)
    assert caps.admit("a") is None and caps.admit("a") is None
    assert "one address" in caps.admit("a")
    assert caps.admit("b") is None
    assert "3 connections" in caps.admit("c")
    assert caps.refused == 2
    caps.release("a")
    assert caps.admit("c") is None and caps.peers() == 3
    with pytest.raises(ValueError):
        Caps(0, 1)


def test_peers_are_grouped_by_ipv4_address_or_ipv6_64():
    assert peer_group("192.0.2.7") == "192.0.2.7"
    assert peer_group("::ffff:192.0.2.7") == "192.0.2.7"
    assert peer_group("2001:db8:1:2:aaaa::1") == peer_group("2001:db8:1:2:bbbb::9") \
        == "2001:db8:1:2::/64"
    assert peer_group("2001:db8:1:3::1") != peer_group("2001:db8:1:2::1")
    assert peer_group("fe80::1%eth0") == "fe80::/64"
    assert peer_group("?") == "?"


def test_decoder_says_how_much_an_incomplete_frame_holds():
    d = FrameDecoder(max_frame=100_000)
    assert d.held == 0
    head = b"\x04\xc4\x03abc\xc6" + (50_000).to_bytes(4, "big")
    assert d.feed(head + bytes(1000)) == [] and d.held >= 1000 + 3
    assert d.feed(bytes(49_000)) == [Publish(b"abc", bytes(50_000))] and d.held == 0


# -- HTTPS decisions -------------------------------------------------------------------

SECRET = b"s3cret"
JSON = [(b"content-type", b"application/json; charset=utf-8"),
        (b"x-authentication-key", SECRET)]


def _doc(topic: bytes, body: bytes) -> bytes:
    return json.dumps({"topic": base64.b64encode(topic).decode(),
                       "body": base64.b64encode(body).decode()}).encode()


@pytest.mark.parametrize("method, headers, content, status", [
    (b"POST", JSON, _doc(b"a/b", b"\x00\xff"), 201),
    (b"GET", JSON, b"", 405),
    (b"PUT", JSON, _doc(b"a/b", b"x"), 405),
    (b"POST", JSON[:1], _doc(b"a/b", b"x"), 401),
    (b"POST", [JSON[0], (b"x-authentication-key", b"s3creT")], _doc(b"a/b", b"x"), 401),
    (b"POST", [(b"content-type", b"text/plain"), JSON[1]], _doc(b"a/b", b"x"), 415),
    (b"POST", JSON[1:], _doc(b"a/b", b"x"), 415),
    (b"POST", JSON, b"{not json", 400),
    (b"POST", JSON, b'["topic", "body"]', 400),
    (b"POST", JSON, b'{"topic": "a/b", "body": "%%%"}', 400),
    (b"POST", JSON, b'{"body": "eA=="}', 400),
    (b"POST", JSON, _doc(b"!/cred/0/0/1/x", b"x"), 400),
    (b"POST", JSON, _doc(b"a\x00b", b"x"), 400),
    (b"POST", JSON, _doc(b"a", b"x" * 2000), 413),
    (b"POST", JSON, b"[" * 100_000 + b"]" * 100_000, 400),  # RecursionError inside json
])
def test_https_decisions(method, headers, content, status):
    answer = decide(method, headers, content, SECRET, max_frame=1024)
    assert answer.status == status, answer.text
    if status == 201:
        assert (answer.topic, answer.body) == (b"a/b", b"\x00\xff")
    else:
        assert answer.topic is None


def test_https_secret_keys_follow_the_brokers_separator():
    dot = KeyRules(b".")
    doc = _doc(b"!.cred.0.0.1.x", b"x")
    assert decide(b"POST", JSON, doc, SECRET, 1024, dot).status == 400
    assert decide(b"POST", JSON, _doc(b"a.b", b"x"), SECRET, 1024, dot).status == 201


def _mixed_stream(rng) -> bytes:
    """Frames of every shape the decoder splits by hand or leaves to the unpacker: bin 8
    and bin 16 bodies, nil bodies, str topics, frames over the hand-kept tail."""
    shapes = [codec.publish(b"a/b", b"x" * 5), b"\x00", codec.publish(b"t" * 200, b"y" * 70000),
              codec.subscribe(b"s/*"), b"\x04\xc4\x01k\xc0", codec.authenticate(b"sec"),
              codec.publish(b"k", b"z" * 300), b"\x04\xa3abc\xc4\x01q", codec.publish(b"", b""),
              codec.publish(b"m", b"w" * 5000)]
    return b"".join(rng.choice(shapes) for _ in range(200))


def test_a_stream_cut_anywhere_gives_the_same_frames():
    rng = random.Random(26)
    stream = _mixed_stream(rng)
    whole = FrameDecoder().feed(stream)
    assert len(whole) == 200  # one frame per shape, keep-alives too
    for _ in range(20):
        decoder, out, i = FrameDecoder(), [], 0
        while i < len(stream):
            step = rng.choice([1, 2, 3, 7, 50, 4096, 70000])
            out += decoder.feed(stream[i:i + step])
            held = decoder.held
            assert held <= 70000 + 300  # never more than the frame being assembled
            i += step
        assert out == whole and decoder.idle and decoder.offset == len(stream)


def test_bytes_of_a_publish_written_in_pieces_are_counted_as_held():
    decoder = FrameDecoder()
    frame = codec.publish(b"topic", b"b" * 3000)
    for i, byte in enumerate(frame[:-1]):
        assert decoder.feed(bytes([byte])) == []
        assert decoder.held == i + 1 and not decoder.idle  # bounded before authenticating
    assert decoder.feed(frame[-1:]) == [Publish(b"topic", b"b" * 3000)]
    assert decoder.held == 0 and decoder.idle


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_a_bad_frame_after_pieces_of_good_ones_is_named_where_it_is(step):
    bad = codec.publish(b"a", b"b") * 3 + b"\x04\xc4\x01a\x91\x01"
    decoder = FrameDecoder()
    with pytest.raises(FrameError, match="MessagePack array at byte 25"):
        for i in range(0, len(bad), step):
            decoder.feed(bad[i:i + step])


def test_an_outbox_gives_messages_then_a_stalled_rest_by_ending_the_connection():
    """What `evict` may take is counted (queues of echoes only are passed over at once);
    the unwritten end of a frame goes only with the connection, once the socket took
    nothing for `STALLED` seconds."""
    from sbus.gateway.outbox import STALLED

    pool = Pool(10_000)
    box = Outbox(100, 10_000)
    for frame in (S(b"abc"), S(b"def")):
        box.offer(frame)
        frame.hold(pool)
    box.force(b"\x00")
    assert box.messages == 2
    box.done(2)  # "ab" written: "c" is a rest
    assert box.messages == 1
    assert box.evict() and box.messages == 0  # "def" went; the rest and the echo stay
    assert not box.evict()
    cut: list[int] = []
    box.cut = lambda: cut.append(1)
    assert not box.evict() and not cut  # its socket took something just now
    box.progress -= STALLED + 0.1
    assert box.evict() and cut == [1] and box.dropped_by == [0, 0, 2]
