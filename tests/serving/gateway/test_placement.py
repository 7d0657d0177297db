"""Placement across workers that own their admission: most headroom first, the next one when refused."""

from __future__ import annotations

import grpc

from metronome.serving.gateway.handle import WorkerHandle
from metronome.serving.gateway.placement import open_session, pick, refusal
from metronome.serving.proto import worker_pb2 as pb


class FakeStub:
    """A worker's OpenSession: admits while under ``cap``, then refuses with the reason workers give."""

    def __init__(self, cap: int, open_now: int = 0) -> None:
        self.cap, self.open = cap, open_now
        self.asked = 0

    async def OpenSession(self, request, timeout=None, metadata=None):
        self.asked += 1
        if self.open >= self.cap:
            return pb.OpenSessionResponse(ok=False, error="at cap", refused="latency cap", admission_cap=self.cap,
                                          sessions=self.open)
        self.open += 1
        return pb.OpenSessionResponse(ok=True, admission_cap=self.cap, sessions=self.open)


def handle(address: str, cap: int, sessions: int = 0, *, stub: FakeStub | None = None) -> WorkerHandle:
    h = WorkerHandle(address, grpc.aio.insecure_channel("127.0.0.1:1"), stub or FakeStub(cap, sessions))
    h.healthy, h.health = True, pb.HealthResponse(ready=True, capacity_sessions=100)
    h.heard(cap, sessions)
    return h


async def test_the_most_headroom_wins_and_draining_or_retired_workers_take_nothing():
    a, b, c = handle("a", 4, 3), handle("b", 4, 1), handle("c", 8, 0)   # headroom 1, 3, 8
    c.draining = True
    assert pick([a, b, c]) is b and b.pending == 1
    c.draining, c.retired = False, True
    # b (2 left) again, then a tie (first wins), then b's last, then no room anywhere.
    assert [pick([a, b, c]) for _ in range(4)] == [b, a, b, None]
    assert a.headroom() == b.headroom() == 0 and c.pending == 0
    assert refusal([a, b])[0] == "server_overloaded"
    a.healthy = b.healthy = False
    assert refusal([a, b])[0] == "worker_restarting"


async def test_a_refusal_updates_the_view_and_the_next_worker_is_asked():
    # The gateway thinks "stale" has room; another gateway filled it. "fresh" really has room.
    stale = handle("stale", 2, 0, stub=FakeStub(2, open_now=2))
    fresh = handle("fresh", 2, 1, stub=FakeStub(2, open_now=1))
    first = pick([stale, fresh])
    assert first is stale
    placed, answer = await open_session([stale, fresh], first, "s1", gateway_admits=False)
    assert placed is fresh and answer.ok
    assert stale.worker_sessions == 2 and stale.headroom() == 0   # learnt from the refusal
    assert stale.pending == fresh.pending == 0
    last = pick([stale, fresh])
    assert last is None                                           # both full as far as the gateway now knows


async def test_when_every_worker_refuses_the_last_reason_is_the_answer():
    a = handle("a", 1, 0, stub=FakeStub(1, open_now=1))
    b = handle("b", 1, 0, stub=FakeStub(1, open_now=1))
    placed, answer = await open_session([a, b], pick([a, b]), "s", gateway_admits=False)
    assert not answer.ok and answer.refused == "latency cap"
    assert a.stub.asked == b.stub.asked == 1 and a.pending == b.pending == 0
