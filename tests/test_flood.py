"""The pure flood-control queue: each policy's verdicts and each order."""

from sbus.flood import Budget, Hard, Order, OutQueue, Soft, Verdict, parse_control


def test_parse_control():
    assert parse_control(b"blocking/soft/discard") is Soft.DISCARD
    assert parse_control(b"blocking/hard/block") is Hard.BLOCK
    assert parse_control(b"order/random") is Order.RANDOM
    assert parse_control(b"blocking/hard/queue") is None  # not a hard policy
    assert parse_control(b"order/nonsense") is None
    assert parse_control(b"other") is None


def test_default_queue_then_discard_at_limit():
    q = OutQueue(limit=10)
    assert q.offer(b"12345") is Verdict.QUEUED
    assert q.offer(b"12345") is Verdict.QUEUED
    assert q.offer(b"1") is Verdict.DROPPED
    assert q.nbytes == 10 and len(q) == 2 and q.take_dropped() == 1


def test_hard_block_and_error():
    q = OutQueue(limit=4)
    q.apply(Hard.BLOCK)
    assert q.offer(b"12") is Verdict.QUEUED
    assert q.offer(b"34") is Verdict.QUEUED
    assert q.publisher_may_continue() is False
    assert q.offer(b"5") is Verdict.BLOCK
    q.pop()
    assert not q.publisher_may_continue()  # 3 bytes left: above half the limit
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
    q = OutQueue(limit=100)
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
    budget = Budget(limit=10)
    a, b = OutQueue(limit=100, budget=budget), OutQueue(limit=100, budget=budget)
    assert a.offer(b"123456") is Verdict.QUEUED
    assert b.offer(b"1234") is Verdict.QUEUED
    assert b.offer(b"1") is Verdict.DROPPED  # b's own queue has room, the user's budget not
    a.order = Order.RANDOM  # re-queueing does not charge twice
    assert budget.queued == 10
    a.pop()
    assert b.offer(b"1") is Verdict.QUEUED and budget.queued == 5
    b.clear()
    assert budget.queued == 0
