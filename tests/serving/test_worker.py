"""The worker over real gRPC on loopback: sessions, batched steps, per-session errors, bounded KV, serial steps."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from metronome import Engine, EngineConfig, KVPolicy
from metronome.audio.energy_tokens import EnergyTokenAdapter
from metronome.audio.pcm import Resampler, decode_pcm16, encode_pcm16, levels, resample
from metronome.errors import ConfigError
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc
from metronome.serving.worker import WorkerConfig, adapter_context, serve_worker
from tests.serving.stream_step import answers, tick_answer

POLICY = KVPolicy(sinks=4, window=64, block_size=16)
CHUNK = 64


def tone(seconds: float, rate: int = 16000, amplitude: float = 0.1) -> np.ndarray:
    t = np.arange(int(round(seconds * rate))) / rate
    return (amplitude * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def speech_like(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    envelope = np.repeat(10 ** rng.uniform(-3.5, 0, size=n // 400 + 1), 400)[:n]
    return (rng.standard_normal(n) * envelope * 0.5).clip(-1, 1).astype(np.float32)


def pcm(samples: np.ndarray) -> bytes:
    return encode_pcm16(samples)


def config(checkpoint: str, **overrides) -> WorkerConfig:
    engine_fields = {k: overrides.pop(k) for k in list(overrides) if k in EngineConfig.__dataclass_fields__}
    engine = EngineConfig(**{**dict(model=checkpoint, policy=POLICY, num_blocks=81, max_chunk_tokens=CHUNK,
                                    max_batch_tokens=512), **engine_fields})
    return WorkerConfig(engine, **{**dict(adapter="energy", max_input_tokens=256, budget_ms=2000.0, port=0),
                                   **overrides})


@pytest.fixture(scope="module")
def engine(chat_checkpoint):
    return Engine(config(chat_checkpoint).engine)


class HearingEnergyAdapter(EnergyTokenAdapter):
    """The energy adapter taking its audio as it streams in, as the cascade does: what ``hear`` got (at the
    adapter's rate, after a clear) joins the session's tick, so both ways must give the same tokens."""

    hears_early = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.heard: dict[str, list[np.ndarray]] = {}
        self.calls: list[tuple] = []   # ("hear", sid, samples, clear) and ("prepare", sids), in order

    def hear(self, session_id, pcm, *, clear=False, turn_detection=None):
        self.calls.append(("hear", session_id, pcm.size, clear))
        if clear:
            self.heard[session_id] = []
        self.heard.setdefault(session_id, []).append(pcm)

    def prepare(self, batch):
        self.calls.append(("prepare", tuple(t.session_id for t in batch)))
        assert not any(t.pcm.size or t.clear_buffer or t.turn_detection for t in batch)   # all of it was heard
        joined = [replace(t, pcm=np.concatenate([np.zeros(0, np.float32), *self.heard.pop(t.session_id, [])]))
                  for t in batch]
        return super().prepare(joined)

    def close_session(self, session_id):
        self.heard.pop(session_id, None)
        super().close_session(session_id)


async def start_worker(engine, checkpoint, hearing: bool, **overrides):
    """A worker over ``engine``: the energy adapter, or its hearing variant (audio as it streams in)."""
    cfg = config(checkpoint, **overrides)
    adapter = HearingEnergyAdapter.from_context(adapter_context(cfg, engine)) if hearing else None
    return await serve_worker(cfg, engine=engine, adapter=adapter)


@pytest.fixture(params=[False, True], ids=["audio-at-the-tick", "audio-heard-early"])
async def worker(request, engine, chat_checkpoint):
    handle = await start_worker(engine, chat_checkpoint, request.param)
    yield handle
    await handle.stop(0)
    assert engine.stats().sessions == 0  # stop() closed whatever a test left open


@pytest.fixture
async def stub(worker):
    async with grpc.aio.insecure_channel(worker.address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


async def open_sessions(stub, mode: str, *sids: str, instructions: str = "") -> None:
    for sid in sids:
        reply = await stub.OpenSession(pb.OpenSessionRequest(sid=sid, mode=mode, instructions=instructions))
        assert reply.ok, reply.error


def by_sid(response: pb.StepResponse) -> dict[str, pb.SessionOutput]:
    return {out.sid: out for out in response.outputs}


async def test_health_open_close_and_admission(chat_checkpoint):
    # A worker that builds its own engine from the config; a pool that holds exactly two sessions.
    handle = await serve_worker(config(chat_checkpoint, num_blocks=21))
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            health = await stub.Health(pb.HealthRequest())
            # The model's name, never the checkpoint's path (Health answers anyone the gateway shows it to).
            assert health.ready and health.model == os.path.basename(chat_checkpoint) and health.budget_ms == 2000.0
            assert "/" not in health.model and health.max_input_tokens == 256 and health.max_instruction_tokens == 128
            assert health.capacity_sessions == 2 and health.kv_blocks_total == 20 and health.kv_blocks_used == 0
            assert health.sessions == 0 and health.input_sample_rate == 16000
            assert health.kv_policy == "sink_window(S=4,W=64)"

            await open_sessions(stub, "", "a", "b")
            full = await stub.OpenSession(pb.OpenSessionRequest(sid="c"))
            assert not full.ok and "KV pool full" in full.error
            dup = await stub.OpenSession(pb.OpenSessionRequest(sid="a"))
            assert not dup.ok and "already open" in dup.error
            bad = await stub.OpenSession(pb.OpenSessionRequest(sid="z", mode="karaoke"))
            assert not bad.ok and "karaoke" in bad.error
            assert (await stub.Health(pb.HealthRequest())).sessions == 2

            assert (await stub.CloseSession(pb.CloseSessionRequest(sid="a"))).closed
            assert not (await stub.CloseSession(pb.CloseSessionRequest(sid="a"))).closed  # idempotent
            assert not (await stub.CloseSession(pb.CloseSessionRequest(sid="never"))).closed
            assert (await stub.OpenSession(pb.OpenSessionRequest(sid="c"))).ok  # the freed room is reusable
            assert (await stub.Health(pb.HealthRequest())).sessions == 2
    finally:
        await handle.stop(0)


async def test_step_serves_every_session_at_16k_and_48k(stub, worker, chat_checkpoint):
    await open_sessions(stub, "free_running", "a", "b", "quiet", "hi-fi")
    audio = speech_like(2.0)
    request = pb.StepRequest(tick=1, tokens_per_tick=4, sessions=[
        pb.SessionInput(sid="a", audio_pcm16=pcm(audio), sample_rate=16000),
        pb.SessionInput(sid="b", audio_pcm16=pcm(audio), sample_rate=16000),
        pb.SessionInput(sid="quiet", audio_pcm16=pcm(np.zeros(32000, np.float32)), sample_rate=16000),
        pb.SessionInput(sid="hi-fi", audio_pcm16=pcm(resample(audio, 16000, 48000)), sample_rate=48000,
                        max_tokens=6),
    ])
    response = await stub.Step(request)
    out = by_sid(response)
    assert [o.sid for o in response.outputs] == ["a", "b", "quiet", "hi-fi"]
    for sid, n in (("a", 4), ("b", 4), ("quiet", 4), ("hi-fi", 6)):
        assert not out[sid].error and len(out[sid].tokens) == n and not out[sid].finished
    assert out["a"].tokens == out["b"].tokens          # same audio, same context: same tokens (greedy)
    assert out["a"].tokens != out["quiet"].tokens      # the audio reached the model
    assert response.in_flight == 4 and response.kv_blocks_used > 0 and response.kv_blocks_total == 80
    assert response.frontend_ms > 0 and response.prefill_ms > 0 and response.decode_ms > 0
    assert response.worker_ms >= response.frontend_ms + response.prefill_ms + response.decode_ms
    assert response.gpu_ms == pytest.approx(response.prefill_ms + response.decode_ms)
    # 48 kHz went through the session's streaming resampler: whole frames + a carry, like the 16 kHz stream.
    assert worker.service.adapter.session_state("hi-fi")["carry_samples"] < 1280

    tok = worker.service.adapter.tokenizer
    tokens, texts = list(out["a"].tokens), [out["a"].text]
    for tick in range(2, 4):
        more = by_sid(await stub.Step(pb.StepRequest(tick=tick, tokens_per_tick=4, sessions=[
            pb.SessionInput(sid="a", audio_pcm16=pcm(speech_like(2.0, seed=tick)), sample_rate=16000)])))
        tokens += more["a"].tokens
        texts.append(more["a"].text)
    whole = tok.decode(tokens, skip_special_tokens=True)
    assert "".join(texts) and whole.startswith("".join(texts))  # text deltas are the incremental decode


async def test_a_session_back_at_48k_after_16k_starts_a_fresh_resampler(stub, worker):
    """16 kHz audio skips the resampler; switching back to 48 kHz must not resume the old stream's filter tail
    (the gateway drops old-rate audio on a rate change, so the tail would be stale sound)."""
    await open_sessions(stub, "free_running", "r")
    service = worker.service
    chunks = [resample(speech_like(0.5, seed=k), 16000, 48000) for k in range(2)]

    def at_adapter_rate(samples: np.ndarray, rate: int) -> np.ndarray:
        inp = pb.SessionInput(sid="r", audio_pcm16=pcm(samples), sample_rate=rate)
        if service.adapter.hears_early:
            service.core.hear(pb.StepRequest(sessions=[inp]))
            return service.adapter.heard.pop("r")[-1]
        return service.core.tick_audio(inp, 4, pb.SessionOutput(sid="r")).pcm

    at_adapter_rate(chunks[0], 48000)
    at_adapter_rate(speech_like(0.5, seed=9), 16000)
    fresh = Resampler(48000, 16000).process(decode_pcm16(pcm(chunks[1])))
    assert np.array_equal(at_adapter_rate(chunks[1], 48000), fresh)


async def stream_step(stub, *messages: pb.StepRequest) -> pb.StepResponse:
    async def requests():
        for message in messages:
            yield message

    return await tick_answer(stub.StreamStep(requests()))


async def test_a_streamed_tick_is_the_step_of_its_joined_input(stub):
    """StreamStep: each session's pieces go in front of its input in the last message; a session the last
    message does not name gets nothing; audio before a change of sample rate is dropped."""
    await open_sessions(stub, "free_running", "whole", "streamed", "rate")
    audio = pcm(speech_like(2.0))
    pieces = [audio[i:i + 12800] for i in range(0, len(audio), 12800)]   # 0.4 s each
    loud_48k, quiet_16k = pcm(tone(0.5, rate=48000, amplitude=0.9)), pcm(tone(1.0, amplitude=0.05))
    whole = by_sid(await stub.Step(pb.StepRequest(tick=1, tokens_per_tick=4, sessions=[
        pb.SessionInput(sid="whole", audio_pcm16=audio, sample_rate=16000)])))["whole"]
    early = [pb.StepRequest(sessions=[pb.SessionInput(sid="streamed", audio_pcm16=p, sample_rate=16000),
                                      pb.SessionInput(sid="rate", audio_pcm16=loud_48k, sample_rate=48000),
                                      pb.SessionInput(sid="whole", audio_pcm16=p, sample_rate=16000)])
             for p in pieces[:-1]]
    last = pb.StepRequest(tick=1, tokens_per_tick=4, sessions=[
        pb.SessionInput(sid="streamed", audio_pcm16=pieces[-1], sample_rate=16000),
        pb.SessionInput(sid="rate", audio_pcm16=quiet_16k, sample_rate=16000)])
    out = by_sid(await stream_step(stub, *early, last))
    assert set(out) == {"streamed", "rate"}   # "whole" streamed but was not named: nothing for it
    assert not out["streamed"].error and out["streamed"].tokens == whole.tokens
    assert out["streamed"].input_dbfs == pytest.approx(whole.input_dbfs)
    assert out["rate"].input_dbfs == pytest.approx(levels(decode_pcm16(quiet_16k), 16000).rms_dbfs)
    # What "whole" streamed above did not carry over into its next tick.
    again = by_sid(await stub.Step(pb.StepRequest(tick=2, tokens_per_tick=2, sessions=[
        pb.SessionInput(sid="whole", audio_pcm16=quiet_16k, sample_rate=16000)])))["whole"]
    assert again.input_dbfs == pytest.approx(out["rate"].input_dbfs)


@pytest.mark.parametrize("hearing", [False, True], ids=["audio-at-the-tick", "audio-heard-early"])
async def test_a_streamed_tick_is_bounded_and_checked_piece_by_piece(engine, chat_checkpoint, hearing):
    handle = await start_worker(engine, chat_checkpoint, hearing, max_message_bytes=1 << 20)
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            await open_sessions(stub, "free_running", "big", "odd", "fine")
            big = pb.StepRequest(sessions=[pb.SessionInput(sid="big", audio_pcm16=bytes(600_000), sample_rate=16000)])
            last = pb.StepRequest(tick=1, tokens_per_tick=2, sessions=[pb.SessionInput(sid="big", sample_rate=16000)])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stream_step(stub, big, big, last)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as empty:
                await stream_step(stub)
            assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # An odd piece would shift every later sample: that session's tick is refused, the others run.
            early = pb.StepRequest(sessions=[
                pb.SessionInput(sid="odd", audio_pcm16=b"\x01\x00\x02", sample_rate=16000),
                pb.SessionInput(sid="fine", audio_pcm16=pcm(tone(0.5)), sample_rate=16000)])
            last = pb.StepRequest(tick=2, tokens_per_tick=2, sessions=[
                pb.SessionInput(sid="odd", audio_pcm16=b"\x03", sample_rate=16000),
                pb.SessionInput(sid="fine", audio_pcm16=pcm(tone(0.5)), sample_rate=16000)])
            out = by_sid(await stream_step(stub, early, last))
            assert "number of bytes" in out["odd"].error and out["odd"].error_code == "invalid_input"
            assert not out["fine"].error and len(out["fine"].tokens) == 2
    finally:
        await handle.stop(0)


async def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_streamed_audio_is_heard_before_the_tick_and_after_the_previous_tick(engine, chat_checkpoint):
    """An adapter that hears early gets each streamed message as it comes, before the tick's last message is
    even sent; a gateway's next stream, here opened before this tick's last message, is heard only once this
    tick is queued on the engine thread, so a commit stays ahead of the audio sent after it."""
    handle = await start_worker(engine, chat_checkpoint, True)
    adapter, service = handle.service.adapter, handle.service
    received = asyncio.Event()
    charge = service.budget.charge

    async def charge_and_note(tally, pairs):   # the handler's last await before it hears a message
        pairs = list(pairs)
        await charge(tally, pairs)
        if any(text == "later" for _, text in pairs):
            received.set()

    service.budget.charge = charge_and_note
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            await open_sessions(stub, "free_running", "s")
            queues = [asyncio.Queue(), asyncio.Queue()]

            async def messages(queue):
                while (message := await queue.get()) is not None:
                    yield message

            ticks = [asyncio.ensure_future(tick_answer(stub.StreamStep(messages(q)))) for q in queues[:1]]
            await queues[0].put(pb.StepRequest(speech_ahead=True, sessions=[
                pb.SessionInput(sid="s", audio_pcm16=pcm(tone(0.1)), sample_rate=16000)]))
            await until(lambda: ("hear", "s", 1600, False) in adapter.calls)   # the tick is still open
            assert not any(call[0] == "prepare" for call in adapter.calls)
            ticks.append(asyncio.ensure_future(tick_answer(stub.StreamStep(messages(queues[1])))))
            await queues[1].put(pb.StepRequest(sessions=[
                pb.SessionInput(sid="s", audio_pcm16=pcm(tone(0.2)), sample_rate=16000, text="later")]))
            await received.wait()                                               # the worker has it, unheard
            await queues[0].put(pb.StepRequest(tick=1, tokens_per_tick=2, sessions=[
                pb.SessionInput(sid="s", new_turn=True)]))
            await queues[0].put(None)
            await queues[1].put(pb.StepRequest(tick=2, tokens_per_tick=2, sessions=[pb.SessionInput(sid="s")]))
            await queues[1].put(None)
            first, second = await asyncio.gather(*ticks)
            assert not by_sid(first)["s"].error and not by_sid(second)["s"].error
            assert adapter.calls == [("hear", "s", 1600, False), ("hear", "s", 0, False), ("prepare", ("s",)),
                                     ("hear", "s", 3200, False), ("hear", "s", 0, False), ("prepare", ("s",))]
    finally:
        await handle.stop(0)


class SpeakingEnergyAdapter(EnergyTokenAdapter):
    """The energy adapter with speech that is finished between ticks, as the cascade's synthesis thread does:
    ``say`` (from any thread) makes a session's audio ready and tells the worker."""

    output_sample_rate = 24000
    speaks_between_ticks = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ready: dict[str, list[bytes]] = {}
        self.lock = threading.Lock()
        self.notify = None
        self.calls: list[tuple] = []   # ("take", sid, bytes) for speech handed out, ("prepare", sids), in order

    def on_speech_ready(self, notify):
        self.notify = notify

    def say(self, session_id: str, audio: bytes) -> None:
        with self.lock:
            self.ready.setdefault(session_id, []).append(audio)
        self.notify()

    def take_spoken(self, session_id):
        with self.lock:
            audio = b"".join(self.ready.pop(session_id, []))
        if audio:
            self.calls.append(("take", session_id, len(audio)))
        return audio, "words" if audio else ""

    def prepare(self, batch):
        self.calls.append(("prepare", tuple(t.session_id for t in batch)))
        return super().prepare(batch)


async def test_speech_finished_between_ticks_goes_out_at_once_after_the_previous_tick(engine, chat_checkpoint):
    """Speech ready between ticks goes out on the open stream at once, ahead of the tick's own answer, for the
    sessions the stream carries input for (another session's waits for its tick); a gateway's next stream, here
    opened before this tick's last message, takes speech only once this tick is queued on the engine thread, so
    it follows this tick's answer. The tick never hands the same audio out again."""
    cfg = config(chat_checkpoint)
    adapter = SpeakingEnergyAdapter.from_context(adapter_context(cfg, engine))
    handle = await serve_worker(cfg, engine=engine, adapter=adapter)
    service = handle.service
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            await open_sessions(stub, "free_running", "s", "t")
            queues = [asyncio.Queue(), asyncio.Queue()]

            async def messages(queue):
                while (message := await queue.get()) is not None:
                    yield message

            def noticed():   # every open stream has taken notice of the latest speech or session
                return not any(wake.is_set() for wake in service._speech_waiters)

            first = stub.StreamStep(messages(queues[0]))
            await queues[0].put(pb.StepRequest(speech_ahead=True, sessions=[
                pb.SessionInput(sid="s", audio_pcm16=pcm(tone(0.1)), sample_rate=16000)]))
            await until(lambda: len(service._speech_waiters) == 1)
            await asyncio.to_thread(adapter.say, "s", b"\x01\x00" * 10)
            ahead = await first.read()
            assert ahead.speech_only and [(o.sid, o.audio_pcm16, o.audio_transcript, o.audio_sample_rate)
                                          for o in ahead.outputs] == [("s", b"\x01\x00" * 10, "words", 24000)]
            await asyncio.to_thread(adapter.say, "t", b"\x02\x00" * 20)   # this stream has no input for "t"
            second = stub.StreamStep(messages(queues[1]))
            await queues[1].put(pb.StepRequest(speech_ahead=True, sessions=[
                pb.SessionInput(sid="t", audio_pcm16=pcm(tone(0.1)), sample_rate=16000)]))
            await until(lambda: len(service._speech_waiters) == 2)
            await until(noticed)   # the next stream has "t", and waits for this tick to be queued
            await queues[0].put(pb.StepRequest(tick=1, tokens_per_tick=2, sessions=[
                pb.SessionInput(sid="s"), pb.SessionInput(sid="t")]))
            await queues[0].put(None)
            rest, answer = await answers(first)
            assert rest == [] and not answer.speech_only
            out = by_sid(answer)
            assert out["s"].audio_pcm16 == b"" and out["t"].audio_pcm16 == b"\x02\x00" * 20
            await asyncio.to_thread(adapter.say, "t", b"\x03\x00" * 30)
            ahead = await second.read()
            assert ahead.speech_only and [(o.sid, o.audio_pcm16) for o in ahead.outputs] == [("t", b"\x03\x00" * 30)]
            await queues[1].put(pb.StepRequest(tick=2, tokens_per_tick=2, sessions=[pb.SessionInput(sid="t")]))
            await queues[1].put(None)
            rest, answer = await answers(second)
            assert rest == [] and by_sid(answer)["t"].audio_pcm16 == b"" and not by_sid(answer)["t"].error
            assert adapter.calls == [("take", "s", 20), ("prepare", ("s", "t")), ("take", "t", 40),
                                     ("take", "t", 60), ("prepare", ("t",))]
    finally:
        await handle.stop(0)


async def test_a_stream_that_did_not_ask_for_speech_ahead_gets_its_one_answer_with_the_speech(engine,
                                                                                               chat_checkpoint):
    """A gateway that reads one answer per StreamStep (it never marks a message ``speech_ahead``) is sent no
    ``speech_only``: speech ready between ticks waits for the tick's answer."""
    cfg = config(chat_checkpoint)
    adapter = SpeakingEnergyAdapter.from_context(adapter_context(cfg, engine))
    handle = await serve_worker(cfg, engine=engine, adapter=adapter)
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            await open_sessions(worker_pb2_grpc.WorkerStub(channel), "free_running", "s")
            one_answer = channel.stream_unary("/metronome.worker.v1.Worker/StreamStep",
                                              request_serializer=pb.StepRequest.SerializeToString,
                                              response_deserializer=pb.StepResponse.FromString)
            queue = asyncio.Queue()

            async def messages():
                while (message := await queue.get()) is not None:
                    yield message

            call = one_answer(messages(), timeout=30)
            await queue.put(pb.StepRequest(sessions=[
                pb.SessionInput(sid="s", audio_pcm16=pcm(tone(0.1)), sample_rate=16000)]))
            await until(lambda: len(handle.service._speech_waiters) == 1)
            await asyncio.to_thread(adapter.say, "s", b"\x01\x00" * 10)
            await queue.put(pb.StepRequest(tick=1, tokens_per_tick=2, sessions=[pb.SessionInput(sid="s")]))
            await queue.put(None)
            answer = await call
            assert not answer.speech_only and by_sid(answer)["s"].audio_pcm16 == b"\x01\x00" * 10
            assert adapter.calls == [("prepare", ("s",)), ("take", "s", 20)]
    finally:
        await handle.stop(0)


async def test_a_clear_mid_tick_drops_what_the_gateway_already_streamed(stub):
    """The gateway's own pieces (``ClientSession``) through StreamStep: after ``input_audio_buffer.clear`` the
    worker hears only the audio that came after it, as with the whole tick in one Step."""
    from metronome.serving.gateway.client_session import ClientSession, step_request_wire

    class Quiet:
        def send(self, data):
            return True

    await open_sessions(stub, "free_running", "cleared", "cleared-early", "kept")
    loud, quiet = pcm(tone(0.5, amplitude=0.9)), pcm(tone(0.5, amplitude=0.05))
    sessions = {sid: ClientSession(sid, "w", Quiet(), max_buffered_audio_s=10.0, max_messages_per_s=50.0)
                for sid in ("cleared", "cleared-early", "kept")}

    def piece() -> pb.StepRequest:
        wire = [e for e in (s.take_stream_wire() for s in sessions.values()) if e is not None]
        return pb.StepRequest.FromString(step_request_wire(wire, 0, 0))

    for session in sessions.values():
        assert session.append_audio(loud)
    first = piece()
    sessions["cleared-early"].discard_audio()   # its marker goes with the next piece
    assert sessions["cleared-early"].append_audio(quiet)
    second = piece()
    assert [(i.sid, i.clear_audio) for i in second.sessions] == [("cleared-early", True)]
    sessions["cleared"].discard_audio()         # its marker goes with the last message
    for sid in ("cleared", "kept"):
        assert sessions[sid].append_audio(quiet)
    last = pb.StepRequest.FromString(step_request_wire([s.take_tick_wire() for s in sessions.values()], 2, 1))
    out = by_sid(await stream_step(stub, first, second, last))
    for sid in ("cleared", "cleared-early"):
        assert out[sid].input_dbfs == pytest.approx(levels(decode_pcm16(quiet), 16000).rms_dbfs)
    assert out["kept"].input_dbfs == pytest.approx(levels(decode_pcm16(loud + quiet), 16000).rms_dbfs)


async def test_bad_input_stays_on_its_session(stub):
    await open_sessions(stub, "free_running", "good", "odd", "slow", "empty")
    good = pb.SessionInput(sid="good", audio_pcm16=pcm(tone(1.0)), sample_rate=16000)
    response = await stub.Step(pb.StepRequest(tick=7, tokens_per_tick=3, sessions=[
        pb.SessionInput(sid="ghost", audio_pcm16=pcm(tone(1.0)), sample_rate=16000),
        pb.SessionInput(sid="odd", audio_pcm16=pcm(tone(1.0)) + b"\x01", sample_rate=16000),
        good,
        pb.SessionInput(sid="slow", audio_pcm16=pcm(tone(1.0, rate=4000)), sample_rate=4000),
        pb.SessionInput(sid="empty", audio_pcm16=pcm(tone(0.1)), sample_rate=0),
        pb.SessionInput(sid="good", audio_pcm16=pcm(tone(1.0)), sample_rate=16000),
    ]))
    errors = [(o.sid, o.error) for o in response.outputs]
    assert "unknown session 'ghost'" in errors[0][1]
    assert "even number of bytes" in errors[1][1]
    assert errors[2] == ("good", "") and len(response.outputs[2].tokens) == 3
    assert "4000 Hz is not supported" in errors[3][1]
    assert "0 Hz is not supported" in errors[4][1]
    assert "more than once" in errors[5][1]
    # The refused sessions are still usable on the next tick.
    again = by_sid(await stub.Step(pb.StepRequest(tick=8, tokens_per_tick=2, sessions=[
        pb.SessionInput(sid=sid, audio_pcm16=pcm(tone(0.5)), sample_rate=16000) for sid in ("odd", "slow", "empty")])))
    assert all(not o.error and len(o.tokens) == 2 for o in again.values())


async def test_kv_stays_bounded_and_is_freed_on_close(stub, engine):
    await open_sessions(stub, "free_running", "x", "y")
    per_session = engine.stats().blocks_per_session
    used = []
    for tick in range(8):  # ~30 tokens per tick each: the 64-token window fills after 2-3 ticks
        response = await stub.Step(pb.StepRequest(tick=tick, tokens_per_tick=4, sessions=[
            pb.SessionInput(sid=sid, audio_pcm16=pcm(speech_like(2.0, seed=tick)), sample_rate=16000)
            for sid in ("x", "y")]))
        assert all(not o.error for o in response.outputs)
        used.append(response.kv_blocks_used)
    assert max(used) <= 2 * per_session
    assert used[-1] == used[-2] == used[-3]  # plateau: blocks behind the window went back to the pool
    for sid in ("x", "y"):
        await stub.CloseSession(pb.CloseSessionRequest(sid=sid))
    health = await stub.Health(pb.HealthRequest())
    assert health.kv_blocks_used == 0 and health.sessions == 0


async def test_concurrent_steps_run_one_after_another_off_the_event_loop(stub, engine, monkeypatch):
    await open_sessions(stub, "free_running", "s")
    calls = []
    real_step = engine.step

    def slow_step(inputs):
        start = time.perf_counter()
        time.sleep(0.3)  # long enough that overlapping steps would show
        result = real_step(inputs)
        calls.append((start, time.perf_counter(), threading.current_thread().name))
        return result

    monkeypatch.setattr(engine, "step", slow_step)
    request = pb.StepRequest(tick=1, tokens_per_tick=2, sessions=[
        pb.SessionInput(sid="s", audio_pcm16=pcm(tone(0.5)), sample_rate=16000)])

    async def health_while_busy():
        await asyncio.sleep(0.1)
        start = time.perf_counter()
        await stub.Health(pb.HealthRequest())
        return time.perf_counter() - start

    first, second, health_s = await asyncio.gather(stub.Step(request), stub.Step(request), health_while_busy())
    assert not first.outputs[0].error and not second.outputs[0].error
    assert len(first.outputs[0].tokens) == len(second.outputs[0].tokens) == 2
    assert len(calls) == 2
    (s1, e1, t1), (s2, e2, t2) = sorted(calls)
    assert e1 <= s2                                     # serialised
    assert t1 == t2 and t1.startswith("metronome-engine")  # on the one engine thread
    assert health_s < 0.2                               # the loop answered while the engine was busy


async def test_turn_and_free_running(stub):
    await open_sessions(stub, "turn", "t")
    await open_sessions(stub, "free_running", "f")

    async def tick(n, **turn):
        response = await stub.Step(pb.StepRequest(tick=n, tokens_per_tick=3, sessions=[
            pb.SessionInput(sid="t", sample_rate=16000, **turn),
            pb.SessionInput(sid="f", audio_pcm16=pcm(tone(0.5)), sample_rate=16000)]))
        out = by_sid(response)
        assert not out["t"].error and not out["f"].error
        assert len(out["f"].tokens) == 3  # free-running decodes every tick, whatever happens
        return len(out["t"].tokens)

    assert await tick(1, audio_pcm16=pcm(speech_like(1.0))) == 0   # the user speaks: nothing decoded
    assert await tick(2, audio_pcm16=pcm(speech_like(0.5, seed=2))) == 0
    assert await tick(3, new_turn=True) == 3                       # commit: the response starts
    assert await tick(4) == 3                                      # and goes on tick after tick
    assert await tick(5, cancel=True) == 0                         # cancelled
    assert await tick(6) == 0
    assert await tick(7, text="What is the capital of France?", max_tokens=5) == 5  # typed text answers too


@pytest.fixture(scope="module")
def token_zero_checkpoint(chat_checkpoint, tmp_path_factory) -> str:
    """The chat checkpoint with a zero LM head: every logit is 0, so greedy decoding always picks token 0."""
    path = tmp_path_factory.mktemp("token-zero")
    for file in Path(chat_checkpoint).iterdir():
        shutil.copy(file, path / file.name)
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"].zero_()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


async def test_a_turn_ends_on_the_stop_token(token_zero_checkpoint):
    engine = Engine(EngineConfig(model=token_zero_checkpoint, policy=POLICY, num_blocks=41, max_chunk_tokens=CHUNK,
                                 max_batch_tokens=512))
    # Token 0 is <|endoftext|>: make it this adapter's stop token.
    adapter = EnergyTokenAdapter(engine.tokenizer, max_input_tokens=256, stop_token_ids=(0,))
    handle = await serve_worker(config(token_zero_checkpoint), engine=engine, adapter=adapter)
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            await open_sessions(stub, "turn", "t")
            await open_sessions(stub, "free_running", "f")

            async def tick(n, **turn):
                return by_sid(await stub.Step(pb.StepRequest(tick=n, tokens_per_tick=4, sessions=[
                    pb.SessionInput(sid="t", audio_pcm16=pcm(tone(0.5)), sample_rate=16000, **turn),
                    pb.SessionInput(sid="f", sample_rate=16000)])))

            out = await tick(1, new_turn=True)
            assert list(out["t"].tokens) == [0] and out["t"].finished and out["t"].text == ""
            assert list(out["f"].tokens) == [0, 0, 0, 0] and not out["f"].finished  # no stop in free-running
            out = await tick(2)
            assert list(out["t"].tokens) == [] and not out["t"].finished  # the turn is over
            out = await tick(3, new_turn=True)
            assert list(out["t"].tokens) == [0] and out["t"].finished
    finally:
        await handle.stop(0)


async def test_long_input_is_prefilled_in_pieces_within_the_tick(stub, engine, monkeypatch):
    await open_sessions(stub, "turn", "long", instructions="You are terse. " * 8)
    await open_sessions(stub, "free_running", "short")
    sizes = []
    real_step = engine.step

    def recording_step(inputs):
        sizes.append([(len(i.token_ids or []), i.max_new_tokens) for i in inputs])
        return real_step(inputs)

    monkeypatch.setattr(engine, "step", recording_step)
    text = "Tell me about the weather " * 12
    response = await stub.Step(pb.StepRequest(tick=1, tokens_per_tick=2, sessions=[
        pb.SessionInput(sid="long", text=text, audio_pcm16=pcm(tone(2.0)), sample_rate=16000),
        pb.SessionInput(sid="short", audio_pcm16=pcm(tone(2.0)), sample_rate=16000)]))
    out = by_sid(response)
    assert not out["long"].error and len(out["long"].tokens) == 2 and len(out["short"].tokens) == 2
    assert len(sizes) >= 3 and all(n <= CHUNK for step in sizes for n, _ in step)
    assert all(new == 0 for step in sizes[:-1] for _, new in step)  # only the final engine step decodes...
    assert [new for _, new in sizes[-1]] == [2, 2]                   # ...for both sessions together

    too_long = by_sid(await stub.Step(pb.StepRequest(tick=2, tokens_per_tick=2, sessions=[
        pb.SessionInput(sid="long", text="word " * 400), pb.SessionInput(sid="short")])))
    assert "at most 256" in too_long["long"].error and len(too_long["short"].tokens) == 2


async def test_an_unexpected_failure_is_internal_and_the_worker_stays_up(stub, engine, monkeypatch):
    await open_sessions(stub, "free_running", "s")
    request = pb.StepRequest(tick=1, tokens_per_tick=2, sessions=[
        pb.SessionInput(sid="s", audio_pcm16=pcm(tone(0.5)), sample_rate=16000)])

    def broken(inputs):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(engine, "step", broken)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.Step(request)
    assert failure.value.code() == grpc.StatusCode.INTERNAL and "kaboom" in failure.value.details()
    monkeypatch.undo()
    response = await stub.Step(request)
    assert not response.outputs[0].error and len(response.outputs[0].tokens) == 2


async def test_max_chunk_tokens_must_cover_a_tick_of_audio(chat_checkpoint):
    with pytest.raises(ConfigError, match="raise max_chunk_tokens to at least 37"):
        await serve_worker(config(chat_checkpoint, max_chunk_tokens=32))
