"""Many keys in turn (S3): the core's packet-by-packet path against its general one.

A publisher whose keys change at every packet has each packet routed by its head and
delivered at once (`BrokerCore._one_by_one`), looked up in the route cache's framed
copy.  These tests drive the same packets through the core in batches (the fast path)
and one packet per batch (the general path only), with the route cache and without it
(a cache too small to keep anything), and require the same result: what each client
received, in order, and the counters.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_core import Batch, Bus

from sbus.core import FULL
from sbus.flood import Hard, Order, Soft
from sbus.limits import Limits

MAX = 80
#: mostly keys of one length, as a publisher's often are (their heads are taken in one
#: call), and some that are refused, secret, or of another length
KEYS = [b"k.0", b"k.1", b"k.2", b"k.3", b"k.9", b"!/x", b"k.0", b"k.1",
        b"k.10", b"x", b"!/cred/1000/1000/120/s", b"k.0\x00"]
PATTERNS = [b"k.0", b"k.1", b"k.2", b"k.9", b"k.10", b"k*", b"x", b"", b"k.0",
            b"!/cred/1000/1000/120/"]


@st.composite
def _packet(draw) -> bytes:
    kind = draw(st.sampled_from(["MSG"] * 24 + ["SUB", "UNSUB", "raw", "big", "empty",
                                                "torn", "nul"]))
    if kind == "MSG":
        return b"MSG " + draw(st.sampled_from(KEYS)) + b"\0" + draw(st.binary(max_size=6))
    if kind == "torn":  # with a "nul" packet after it, the two look like a publish's head
        return b"MSG " + draw(st.sampled_from(KEYS))
    if kind == "nul":
        return b"\0" + draw(st.binary(max_size=6))
    if kind in ("SUB", "UNSUB"):
        return kind.encode() + b" " + draw(st.sampled_from(PATTERNS))
    if kind == "big":
        return b"MSG k.1\0" + b"x" * MAX
    if kind == "empty":
        return b""
    return draw(st.binary(max_size=12))


_setup = st.fixed_dictionaries({
    # per subscriber: its patterns, the packets its kernel takes before it is read, and
    # whether it has hung up
    "subs": st.lists(st.tuples(st.lists(st.sampled_from(PATTERNS), max_size=2),
                               st.integers(1, 3), st.booleans()), min_size=1, max_size=4),
    "packets": st.lists(_packet(), min_size=4, max_size=60),
    "cuts": st.lists(st.integers(0, 60), max_size=4),
})


def _run(setup: dict, batched: bool, cached: bool) -> tuple:
    limits = Limits() if cached else Limits(cache_bytes=1, cache_bytes_per_user=1)
    bus = Bus(defaults=(Soft.QUEUE, Hard.BLOCK, Order.QUEUE), queue_limit=1 << 20,
              max_message=MAX, limits=limits)
    subs = []
    for patterns, room, gone in setup["subs"]:
        c = bus.connect(room=room)
        for p in patterns:
            bus.send(c, b"SUB " + p)
        bus.read(c)
        if gone:
            bus.kernel.hung_up.add(c.link)
        subs.append(c)
    pub = bus.connect(uid=1000, room=1000)
    clients = [*subs, pub]
    write = bus.core._write

    def checked(link, packet):
        assert not any(c.closed and c.link == link for c in clients), "written once closed"
        return write(link, packet)

    bus.core._write = checked
    bus.send(pub, b"SUB k.3")  # the publisher hears some of its own
    packets = setup["packets"]
    cuts = sorted({0, len(packets), *(c for c in setup["cuts"] if c < len(packets))})
    got: list[list[bytes]] = [[] for _ in [*subs, pub]]
    for a, b in zip(cuts, cuts[1:], strict=False):
        for at in (range(a, b) if not batched else [a]):
            end = at + 1 if not batched else b
            if not pub.closed:
                bus.core.receive(pub, Batch(bus.kernel, packets[at:end]), end - at)
        for c, mine in zip([*subs, pub], got, strict=True):
            mine += bus.read(c)  # the client reads, the core does not know yet: a queue
            # waits for `writable` while its kernel has room again
    for c, mine in zip([*subs, pub], got, strict=True):
        mine += bus.drain(c)
    core = bus.core
    return got, core.published, core.delivered, core.dropped, [c.closed for c in subs]


@settings(max_examples=300, deadline=None)
@given(_setup)
def test_batches_deliver_as_one_packet_at_a_time_does_with_and_without_the_cache(setup):
    want = _run(setup, batched=False, cached=False)
    assert _run(setup, batched=True, cached=True) == want
    assert _run(setup, batched=True, cached=False) == want
    assert _run(setup, batched=False, cached=True) == want


def test_many_keys_in_turn_cost_one_write_per_delivery_in_order():
    bus = Bus()
    subs = [bus.connect() for _ in range(10)]
    for i, c in enumerate(subs):
        bus.send(c, b"SUB k.%03d" % i)
    pub = bus.connect()
    packets = [b"MSG k.%03d\0%d" % (i % 10, i) for i in range(64)]
    bus.send(pub, *packets[:10])  # routes every key once: the cache knows them
    bus.kernel.syscalls = 0
    bus.send(pub, *packets[10:])
    assert bus.kernel.syscalls == 54
    for i, c in enumerate(subs):
        assert bus.read(c) == packets[i::10]
    assert bus.core.published == 64 and bus.core.delivered == 64


def test_a_full_or_departed_target_of_many_keys_is_queued_for_or_skipped():
    bus = Bus(defaults=(Soft.QUEUE, Hard.BLOCK, Order.QUEUE))
    full, gone, fine = bus.connect(room=1), bus.connect(), bus.connect()
    for c, key in ((full, b"a"), (gone, b"b"), (fine, b"c")):
        bus.send(c, b"SUB " + key)
    bus.kernel.hung_up.add(gone.link)
    pub = bus.connect()
    packets = [b"MSG %s\0%d" % (b"abc"[i % 3:i % 3 + 1], i) for i in range(30)]
    bus.send(pub, *packets)
    assert bus.kernel.write(full.link, b"x") == FULL and full.wants_write
    assert bus.read(fine) == packets[2::3]
    assert gone.closed and bus.read(full) == packets[:1]
    # *full* read its kernel's packet, not yet told to the core: its queue goes first
    more = [b"MSG %s\0+%d" % (b"ac"[i % 2:i % 2 + 1], i) for i in range(20)]
    bus.send(pub, *more)
    assert bus.drain(full) == packets[3::3] + more[0::2]
    assert bus.read(fine) == more[1::2]
    assert bus.core.delivered == 40
