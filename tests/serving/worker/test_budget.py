"""The worker refuses over-budget input before its engine thread, re-opens a session atomically, and checks
its token."""

from __future__ import annotations

import threading

import grpc
import pytest

from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc
from metronome.serving.worker import serve_worker
from metronome.serving.worker.budget import InputBudget, batch_counter
from tests.serving.stream_step import tick_answer
from tests.serving.test_worker import by_sid, config, open_sessions, pcm, tone

# About 3 tokens per word with the SmolLM2 tokenizer: far over the 256-token limit of these workers.
LONG = "antidisestablishmentarianism " * 400


@pytest.fixture
async def worker(chat_checkpoint):
    handle = await serve_worker(config(chat_checkpoint))
    yield handle
    await handle.stop(0)


@pytest.fixture
async def stub(worker):
    async with grpc.aio.insecure_channel(worker.address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def engine_thread_texts(worker, monkeypatch) -> list[str]:
    """The texts the adapter is handed (on the engine thread), recorded."""
    seen: list[str] = []
    prepare = worker.service.adapter.prepare

    def recording(batch):
        assert threading.current_thread().name.startswith("metronome-engine")
        seen.extend(t.text for t in batch if t.text)
        return prepare(batch)

    monkeypatch.setattr(worker.service.adapter, "prepare", recording)
    return seen


def test_counts_are_the_tokenizers_own(worker):
    tokenizer = worker.service.engine.tokenizer
    texts = ["hello there", LONG, ""]
    assert batch_counter(tokenizer)(texts) == [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


async def test_text_over_the_limit_never_reaches_the_engine_thread(worker, stub, monkeypatch):
    seen = engine_thread_texts(worker, monkeypatch)
    await open_sessions(stub, "turn", "abuser", "victim")
    response = by_sid(await stub.Step(pb.StepRequest(tick=1, tokens_per_tick=2, sessions=[
        pb.SessionInput(sid="abuser", text=LONG, sample_rate=16000),
        pb.SessionInput(sid="victim", text="hi", audio_pcm16=pcm(tone(0.5)), sample_rate=16000)])))
    assert response["abuser"].error_code == "input_too_large" and "at most 256" in response["abuser"].error
    assert not response["victim"].error and seen == ["hi"]
    # Streamed in pieces, the pieces add up: the tick is refused all the same.
    half = LONG[:len(LONG) // 2]
    call = stub.StreamStep()
    for _ in range(2):
        await call.write(pb.StepRequest(sessions=[pb.SessionInput(sid="abuser", text=half, sample_rate=16000)]))
    await call.write(pb.StepRequest(tick=2, tokens_per_tick=2, sessions=[pb.SessionInput(sid="abuser", sample_rate=16000)]))
    await call.done_writing()
    out = by_sid(await tick_answer(call))["abuser"]
    assert out.error_code == "input_too_large" and seen == ["hi"]
    # The session lives on: a short message next tick goes through.
    out = by_sid(await stub.Step(pb.StepRequest(tick=3, tokens_per_tick=2, sessions=[
        pb.SessionInput(sid="abuser", text="a short question", sample_rate=16000)])))["abuser"]
    assert not out.error and seen == ["hi", "a short question"]


async def test_instructions_over_the_limit_are_refused_before_the_engine_thread(worker, stub, monkeypatch):
    opened = []
    monkeypatch.setattr(worker.service.adapter, "open_session", lambda *a: opened.append(a))
    reply = await stub.OpenSession(pb.OpenSessionRequest(sid="s", instructions=LONG))
    assert not reply.ok and "at most 128" in reply.error and opened == []
    assert worker.service.engine.stats().sessions == 0


async def test_a_refused_replace_leaves_the_session_as_it_was(worker, stub):
    core = worker.service.core
    await open_sessions(stub, "turn", "s", instructions="Be brief.")
    header = list(core.adapter._sessions["s"].header)
    # Over the adapter's limit only with its chat framing: the worker's own count lets it through.
    framing = "word " * 125
    assert batch_counter(worker.service.engine.tokenizer)([framing])[0] <= 128
    refused = await stub.OpenSession(pb.OpenSessionRequest(sid="s", mode="free_running", instructions=framing,
                                                           replace=True))
    assert not refused.ok and "at most 128" in refused.error
    assert core.adapter._sessions["s"].header == header and core.adapter._sessions["s"].mode == "turn"
    ok = await stub.OpenSession(pb.OpenSessionRequest(sid="s", mode="free_running", instructions="Be kind.",
                                                      replace=True))
    assert ok.ok and core.adapter._sessions["s"].mode == "free_running"
    assert core.adapter._sessions["s"].header != header and worker.service.engine.stats().sessions == 1
    # Once stepped, the header is in the engine: no more replacing.
    await stub.Step(pb.StepRequest(tick=1, sessions=[pb.SessionInput(sid="s", text="hi", sample_rate=16000)]))
    late = await stub.OpenSession(pb.OpenSessionRequest(sid="s", instructions="x", replace=True))
    assert not late.ok and "started" in late.error


async def test_a_worker_with_a_token_refuses_calls_without_it(chat_checkpoint):
    handle = await serve_worker(config(chat_checkpoint, auth_token="s3cret"))
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.OpenSession(pb.OpenSessionRequest(sid="x"), metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                call = stub.StreamStep(metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call.done_writing()
                    await tick_answer(call)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert handle.service.engine.stats().sessions == 0
            reply = await stub.OpenSession(pb.OpenSessionRequest(sid="x"), metadata=(("authorization", "Bearer s3cret"),))
            assert reply.ok
    finally:
        await handle.stop(0)


async def test_a_model_without_a_tokenizer_counts_nothing():
    budget = InputBudget(None, 4, 2)
    tally: dict[str, int] = {}
    await budget.charge(tally, [("s", "a long text " * 100)])
    assert tally == {} and await budget.instructions_refusal("x " * 100) is None
    budget.shutdown()
