"""The worker's own admission: reasons for a refusal, and concurrent askers never passing its cap."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from metronome.config import AimdConfig, EngineConfig, KVPolicy
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc as pb_grpc
from metronome.serving.worker import WorkerConfig, serve_worker
from metronome.serving.worker.admission import DRAINING, LATENCY_CAP, MEMORY, STATIC_CAP, WorkerAdmission


def test_each_limit_refuses_with_its_own_reason():
    a = WorkerAdmission(AimdConfig(budget_ms=100, initial_cap=3), memory_cap=10, static_cap=5)
    assert a.refusal(2) is None and a.refusal(3) == LATENCY_CAP
    assert a.refusal(3, gateway_admits=True) is None     # the gateway's own controller decided
    assert a.refusal(5, gateway_admits=True) == STATIC_CAP
    a.draining = True
    assert a.refusal(0) == DRAINING and "draining" in a.explain(DRAINING)


def test_latency_over_target_that_grows_with_load_lowers_the_cap():
    a = WorkerAdmission(AimdConfig(budget_ms=100, initial_cap=8, window=1, slow_start=1), memory_cap=10)
    a.observe(10.0, live=2)
    a.observe(90.0, live=6)     # over the 30 ms target, and slower than at 2 sessions
    assert a.cap == 5 and a.refusal(5) == LATENCY_CAP


@pytest.fixture
async def small_worker(chat_checkpoint):
    engine = EngineConfig(model=chat_checkpoint, policy=KVPolicy(sinks=4, window=64, block_size=8), num_blocks=400,
                          max_chunk_tokens=64)
    worker = await serve_worker(WorkerConfig(engine, budget_ms=150.0, adapter="energy", port=0,
                                             aimd=AimdConfig(initial_cap=3, target_fraction=1.0)))
    yield worker
    await worker.stop()


async def test_concurrent_askers_get_exactly_the_cap_and_the_reason_for_the_rest(small_worker):
    async with grpc.aio.insecure_channel(small_worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        answers = await asyncio.gather(*(stub.OpenSession(pb.OpenSessionRequest(sid=f"s{i}")) for i in range(8)))
        assert sum(a.ok for a in answers) == 3
        assert {a.refused for a in answers if not a.ok} == {LATENCY_CAP}
        assert all(a.admission_cap == 3 for a in answers)
        health = await stub.Health(pb.HealthRequest())
        assert health.sessions == 3 and health.admission_cap == 3 and not health.draining


async def _until(condition, timeout_s: float = 10.0) -> None:
    """Wait for state that other threads change (bounded: a failure must not hang the suite)."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), timeout_s)


async def test_a_session_the_engine_has_opened_is_not_counted_again_before_its_answer_returns(small_worker):
    """Opened on the engine thread, its answer not yet back on the event loop: it counts once, not twice (the
    double count refused sessions below the cap when several connected at once)."""
    service = small_worker.service
    gate = threading.Event()
    small_worker.executor.submit(gate.wait)                   # the engine thread is busy with a tick
    try:
        async with grpc.aio.insecure_channel(small_worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            calls = [asyncio.ensure_future(stub.OpenSession(pb.OpenSessionRequest(sid=f"s{i}"))) for i in range(2)]
            await _until(lambda: service.live_sessions == 2)  # both admitted, waiting for the engine thread
            gate.set()
            small_worker.executor.submit(lambda: None).result()   # both opened; the loop has not resumed them
            assert service.core.sessions == 2 and service.live_sessions == 2
            assert service.admission.refusal(service.live_sessions) is None   # the cap (3) has room for one more
            assert all(a.ok for a in await asyncio.gather(*calls))
            assert (await stub.OpenSession(pb.OpenSessionRequest(sid="s2"))).ok
    finally:
        gate.set()


async def test_an_open_given_up_behind_a_long_tick_leaves_no_count_and_no_session(small_worker):
    service = small_worker.service
    gate = threading.Event()
    small_worker.executor.submit(gate.wait)                   # a tick longer than the caller's deadline
    try:
        async with grpc.aio.insecure_channel(small_worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.OpenSession(pb.OpenSessionRequest(sid="late"), timeout=0.2)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await _until(lambda: service.live_sessions == 0)    # the loop took it off the count
            gate.set()
            small_worker.executor.submit(lambda: None).result()   # whatever was queued for it has run
            assert not service.core.is_open("late") and service.live_sessions == 0
            answers = [await stub.OpenSession(pb.OpenSessionRequest(sid=f"s{i}")) for i in range(3)]
            assert all(a.ok for a in answers)                 # the whole cap (3) is there for new sessions
    finally:
        gate.set()


async def test_memory_refusals_come_from_the_engines_reservation(chat_checkpoint):
    engine = EngineConfig(model=chat_checkpoint, policy=KVPolicy(sinks=4, window=64, block_size=8), num_blocks=40,
                          max_chunk_tokens=64)
    worker = await serve_worker(WorkerConfig(engine, budget_ms=150.0, adapter="energy", port=0,
                                             aimd=AimdConfig(initial_cap=100, target_fraction=1.0)))
    try:
        capacity = worker.service.engine.stats().capacity
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            answers = [await stub.OpenSession(pb.OpenSessionRequest(sid=f"s{i}")) for i in range(capacity + 1)]
        assert all(a.ok for a in answers[:-1]) and answers[-1].refused == MEMORY
    finally:
        await worker.stop()


async def test_a_drain_refuses_new_sessions_tells_the_probes_and_waits_for_live_ones(small_worker):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(small_worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        probe = health_pb2_grpc.HealthStub(channel)
        assert (await probe.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
        assert (await stub.OpenSession(pb.OpenSessionRequest(sid="live"))).ok
        drain = asyncio.create_task(small_worker.drain(grace_s=30.0))
        async with asyncio.timeout(10):
            while not (await stub.Health(pb.HealthRequest())).draining:
                await asyncio.sleep(0.02)
        refused = await stub.OpenSession(pb.OpenSessionRequest(sid="late"))
        assert not refused.ok and refused.refused == DRAINING
        status = (await probe.Check(health_pb2.HealthCheckRequest())).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not drain.done()                        # the live session holds the drain open...
        await stub.CloseSession(pb.CloseSessionRequest(sid="live"))
        async with asyncio.timeout(10):
            await drain                                # ...until it ends
