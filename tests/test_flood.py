"""The pure flood-control queue: each policy's verdicts and each order."""

import time

from sbus.flood import (
    HEAP_OVERHEAD,
    PACKET_OVERHEAD,
    REORDER_LIMIT,
    Budget,
    Hard,
    Order,
    OutQueue,
    Soft,
    Verdict,
    parse_control,
)

OV = PACKET_OVERHEAD  # what each queued packet costs besides its bytes


def test_parse_control():
    assert parse_control(b"blocking/soft/discard") is Soft.DISCARD
    assert parse_control(b"blocking/hard/block") is Hard.BLOCK
    assert parse_control(b"order/random") is Order.RANDOM
    assert parse_control(b"blocking/hard/queue") is None  # not a hard policy
    assert parse_control(b"order/nonsense") is None
    assert parse_control(b"other") is None


def test_default_queue_then_discard_at_limit():
    q = OutQueue(limit=10 + 2 * OV)
    assert q.offer(b"12345") is Verdict.QUEUED
    assert q.offer(b"12345") is Verdict.QUEUED
    assert q.offer(b"1") is Verdict.DROPPED
    assert q.nbytes == 10 + 2 * OV and len(q) == 2 and q.take_dropped() == 1


def test_tiny_packets_are_charged_their_overhead():
    q = OutQueue(limit=1000 * (6 + OV))
    while q.offer(b"MSG k\0") is Verdict.QUEUED:
        pass
    assert len(q) == 1000


def test_hard_block_and_error():
    q = OutQueue(limit=4 + 2 * OV)
    q.apply(Hard.BLOCK)
    assert q.offer(b"12") is Verdict.QUEUED
    assert q.offer(b"34") is Verdict.QUEUED
    assert q.publisher_may_continue() is False
    assert q.offer(b"5") is Verdict.BLOCK
    q.pop()
    assert not q.publisher_may_continue()  # 2 packets left: above half the limit
    q.pop()
    assert q.publisher_may_continue()
    q.apply(Hard.ERROR)
    assert q.offer(b"abcd") is Verdict.ERROR


def test_soft_modes():
    q = OutQueue(limit=100)
    q.apply(Soft.DISCARD)
    assert q.offer(b"x") is Verdict.DROPPED and not q
    q.apply(Soft.ERROR)
    assert q.offer(b"x") is Verdict.ERROR
    q.apply(Soft.BLOCK)
    assert q.offer(b"x") is Verdict.BLOCK and not q.publisher_may_continue()
    q.pop()
    assert q.publisher_may_continue()


def test_orders():
    q = OutQueue(limit=100 * HEAP_OVERHEAD)
    for p in (b"a", b"bbb", b"cc"):
        q.offer(p)
    assert q.peek() == b"a"
    q.order = Order.STACK
    assert [q.pop() for _ in range(3)] == [b"cc", b"bbb", b"a"]
    q.order = Order.RANDOM
    for p in (b"a", b"bbb", b"cc", b"dd"):
        q.offer(p)
    assert [q.pop() for _ in range(4)] == [b"bbb", b"cc", b"dd", b"a"]  # largest first
    for p in (b"a", b"bbb"):
        q.offer(p)
    q.order = Order.QUEUE  # back to arrival order
    assert [q.pop() for _ in range(2)] == [b"a", b"bbb"]
    assert q.nbytes == 0


def test_user_budget_shared_by_queues():
    budget = Budget(limit=10 + 2 * OV)
    a, b = OutQueue(limit=1000, budget=budget), OutQueue(limit=1000, budget=budget)
    assert a.offer(b"123456") is Verdict.QUEUED
    assert b.offer(b"1234") is Verdict.QUEUED
    assert b.offer(b"1") is Verdict.DROPPED  # b's own queue has room, the user's budget not
    a.order = Order.QUEUE  # re-queueing does not charge twice
    assert budget.queued == 10 + 2 * OV
    a.pop()
    assert b.offer(b"1") is Verdict.QUEUED and budget.queued == 5 + 2 * OV
    b.clear()
    assert budget.queued == 0


def test_a_publisher_that_may_not_be_paused_is_served_queue_then_discard():
    q = OutQueue(limit=2 * (1 + OV))
    q.apply(Soft.BLOCK)
    assert q.offer(b"x", may_block=False) is Verdict.QUEUED
    assert q.offer(b"x", may_block=False) is Verdict.QUEUED
    assert q.offer(b"x", may_block=False) is Verdict.DROPPED
    assert q.offer(b"x") is Verdict.BLOCK  # one it may pause still waits for it
    h = OutQueue(limit=1 + OV)
    h.apply(Hard.BLOCK)
    assert h.offer(b"x", may_block=False) is Verdict.QUEUED
    assert h.offer(b"x", may_block=False) is Verdict.DROPPED


def test_order_flips_over_a_long_queue_cost_no_re_sort():
    q = OutQueue(limit=1 << 30)
    for i in range(50_000):
        q.offer(b"MSG k\0%d" % (i % 7))
    started = time.perf_counter()
    for _ in range(1000):
        q.order = Order.RANDOM
        q.order = Order.QUEUE
    q.order = Order.RANDOM
    assert time.perf_counter() - started < 0.05  # a re-sort of 50,000 packets takes ~10 ms
    assert q.order is Order.RANDOM
    assert q.pop() == b"MSG k\x000"  # still the old order until the queue is short
    while len(q) > REORDER_LIMIT:
        q.pop()
    sizes = [len(q.pop()) for _ in range(len(q))]
    assert sizes == sorted(sizes, reverse=True)  # now largest first
    assert q.nbytes == 0
