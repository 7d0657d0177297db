"""The worker's tick core without gRPC: sessions, one tick's outputs, streamed input filed and joined."""

from __future__ import annotations

import numpy as np
import pytest

from metronome import Engine, EngineConfig, KVPolicy
from metronome.audio.pcm import encode_pcm16
from metronome.errors import ConfigError
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.worker import StreamedTick, TickCore, WorkerConfig, make_adapter

POLICY = KVPolicy(sinks=4, window=64, block_size=16)


def speech_like(seconds: float, rate: int = 16000, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    envelope = np.repeat(10 ** rng.uniform(-3.5, 0, size=n // 400 + 1), 400)[:n]
    return encode_pcm16((rng.standard_normal(n) * envelope * 0.5).clip(-1, 1).astype(np.float32))


@pytest.fixture(scope="module")
def config(chat_checkpoint) -> WorkerConfig:
    engine = EngineConfig(model=chat_checkpoint, policy=POLICY, num_blocks=41, max_chunk_tokens=64,
                          max_batch_tokens=512)
    return WorkerConfig(engine, adapter="energy", max_input_tokens=256, port=0)


@pytest.fixture(scope="module")
def engine(config) -> Engine:
    return Engine(config.engine)


@pytest.fixture
def core(engine, config):
    core = TickCore(engine, make_adapter(config, engine), config)
    yield core
    core.close_all()
    assert engine.stats().sessions == 0


def open_all(core: TickCore, *sids: str) -> None:
    for sid in sids:
        reply = core.open(pb.OpenSessionRequest(sid=sid, mode="free_running"))
        assert reply.ok, reply.error


def by_sid(response: pb.StepResponse) -> dict[str, pb.SessionOutput]:
    return {out.sid: out for out in response.outputs}


def test_the_budget_defaults_to_the_adapters_and_health_reports_it(core, config):
    assert config.budget_ms == 2000.0                                    # the energy adapter's record
    assert WorkerConfig(adapter="moshi").budget_ms == 80.0
    assert WorkerConfig(adapter="energy", budget_ms=250.0).budget_ms == 250.0
    with pytest.raises(ConfigError, match="budget_ms"):
        WorkerConfig(adapter="energy", budget_ms=0.0)
    assert core.health.budget_ms == 2000.0 and core.health.ready and core.health.sessions == 0


def test_sessions_open_and_close_and_health_follows(core):
    open_all(core, "a", "b")
    assert core.health.sessions == 2 and core.health.kv_blocks_used == 0
    assert not core.open(pb.OpenSessionRequest(sid="a")).ok                       # already open
    assert "must not be empty" in core.open(pb.OpenSessionRequest(sid="")).error
    assert "karaoke" in core.open(pb.OpenSessionRequest(sid="z", mode="karaoke")).error
    assert core.close("a").closed and not core.close("a").closed                  # idempotent
    assert core.health.sessions == 1 and core.sessions == 1


def test_a_step_serves_every_good_session_and_reports_bad_input_on_its_own_output(core):
    open_all(core, "a", "b", "quiet")
    audio = speech_like(1.0)
    response = core.step(pb.StepRequest(tick=1, tokens_per_tick=3, sessions=[
        pb.SessionInput(sid="a", audio_pcm16=audio, sample_rate=16000),
        pb.SessionInput(sid="ghost", audio_pcm16=audio, sample_rate=16000),
        pb.SessionInput(sid="b", audio_pcm16=audio, sample_rate=16000, max_tokens=5),
        pb.SessionInput(sid="quiet", audio_pcm16=b"\x00" * 3, sample_rate=16000),
        pb.SessionInput(sid="a", sample_rate=16000)]))
    assert [o.sid for o in response.outputs] == ["a", "ghost", "b", "quiet", "a"]
    a, ghost, b, quiet, again = response.outputs
    assert not a.error and len(a.tokens) == 3 and a.text is not None
    assert not b.error and len(b.tokens) == 5 and b.tokens[:3] == a.tokens    # same input, greedy
    assert "unknown session" in ghost.error and ghost.error_code == "unknown_session" and not ghost.tokens
    assert quiet.error and not quiet.tokens                                    # odd PCM byte count
    assert "more than once" in again.error
    assert response.in_flight == 3 and response.kv_blocks_used > 0
    assert response.gpu_ms == pytest.approx(response.prefill_ms + response.decode_ms)
    assert core.health.kv_blocks_used == response.kv_blocks_used


def test_streamed_input_is_joined_in_front_of_the_last_message(core):
    open_all(core, "whole", "streamed", "odd", "unnamed")
    audio = speech_like(1.2, seed=3)
    pieces = [audio[i:i + 12800] for i in range(0, len(audio), 12800)]
    whole = by_sid(core.step(pb.StepRequest(tick=1, tokens_per_tick=4, sessions=[
        pb.SessionInput(sid="whole", audio_pcm16=audio, sample_rate=16000)])))["whole"]

    streamed = StreamedTick()
    for piece in pieces[:-1]:
        size = streamed.add(pb.StepRequest(sessions=[
            pb.SessionInput(sid="streamed", audio_pcm16=piece, sample_rate=16000),
            pb.SessionInput(sid="unnamed", audio_pcm16=piece, sample_rate=16000)]))
    streamed.add(pb.StepRequest(sessions=[pb.SessionInput(sid="odd", audio_pcm16=b"\x01", sample_rate=16000)]))
    assert size == 2 * sum(len(p) for p in pieces[:-1]) and streamed.size == size + 1
    last = pb.StepRequest(tick=1, tokens_per_tick=4, sessions=[
        pb.SessionInput(sid="streamed", audio_pcm16=pieces[-1], sample_rate=16000),
        pb.SessionInput(sid="odd", audio_pcm16=b"\x02\x00", sample_rate=16000)])
    out = by_sid(core.step(last, streamed))
    assert set(out) == {"streamed", "odd"}                   # input for a session not named is dropped
    assert not out["streamed"].error and out["streamed"].tokens == whole.tokens
    assert out["streamed"].input_dbfs == pytest.approx(whole.input_dbfs)
    assert "odd number of bytes" in out["odd"].error


def test_a_burst_beyond_one_chunk_is_prefilled_in_pieces_within_the_tick(core):
    open_all(core, "burst", "small")
    response = core.step(pb.StepRequest(tick=1, tokens_per_tick=2, sessions=[
        pb.SessionInput(sid="burst", text="word " * 120),
        pb.SessionInput(sid="small", text="hi")]))
    out = by_sid(response)
    assert not out["burst"].error and len(out["burst"].tokens) == 2
    assert not out["small"].error and len(out["small"].tokens) == 2
    over = by_sid(core.step(pb.StepRequest(tick=2, tokens_per_tick=2, sessions=[
        pb.SessionInput(sid="small", text="word " * 400)])))["small"]
    assert "at most 256" in over.error and not over.tokens        # beyond max_input_tokens: refused


def test_a_response_ends_with_its_speech_not_its_text(core):
    """While the adapter still speaks an answer whose text is done, ``finished`` waits for the last audio."""
    speaking = {"s": True}
    core.adapter.speaking = lambda sid: speaking["s"]
    assert core._finish_with_speech("s", text_finished=True) is False        # text done, speech streaming
    assert core._finish_with_speech("s", text_finished=False) is False
    speaking["s"] = False
    assert core._finish_with_speech("s", text_finished=False) is True        # the tick with the last audio
    assert core._finish_with_speech("s", text_finished=False) is False       # once
    assert core._finish_with_speech("s", text_finished=True) is True         # a text-only answer ends at once


def test_realtime_controls_reach_the_adapter_and_the_output_says_what_the_tick_did(core):
    """max_output_tokens and turn detection go to the adapter as given (unset fields: its defaults); the
    output says the tick carried a cancel and how many tokens the session took in."""
    open_all(core, "s")
    seen = []
    prepare = core.adapter.prepare
    core.adapter.prepare = lambda batch: (seen.extend(batch), prepare(batch))[1]
    turn = pb.TurnDetection(server_vad=True, threshold=0.6, prefix_padding_ms=0, create_response=False,
                            interrupt_response=True)
    out = by_sid(core.step(pb.StepRequest(tokens_per_tick=2, sessions=[
        pb.SessionInput(sid="s", text="hello there", max_output_tokens=7, turn_detection=turn, cancel=True)])))["s"]
    tick, = seen
    assert tick.max_output_tokens == 7
    assert tick.turn_detection.server_vad and tick.turn_detection.prefix_padding_ms == 0
    assert tick.turn_detection.silence_duration_ms is None and not tick.turn_detection.create_response
    assert tick.turn_detection.threshold == pytest.approx(0.6)
    assert out.cancelled and out.input_tokens > 0
    seen.clear()
    out = by_sid(core.step(pb.StepRequest(tokens_per_tick=2, sessions=[pb.SessionInput(sid="s")])))["s"]
    assert seen[0].turn_detection is None and seen[0].max_output_tokens == 0     # not sent: unchanged
    seen.clear()
    streamed = StreamedTick()                          # a change the gateway streamed ahead of the last message
    streamed.add(pb.StepRequest(sessions=[pb.SessionInput(sid="s", turn_detection=pb.TurnDetection())]))
    core.step(pb.StepRequest(tokens_per_tick=2, sessions=[pb.SessionInput(sid="s")]), streamed)
    assert seen[0].turn_detection is not None and not seen[0].turn_detection.server_vad
    assert not out.cancelled and not out.HasField("speech_started_ms")


def test_speech_over_an_answer_cancels_it_and_whisper_never_runs_on_the_tick(engine, config):
    """The cascade through the tick core: the VAD and Whisper work beside the tick (Whisper faked, held at
    a gate); speech heard during an answer ends it on the next tick, with no audio and no more tokens."""
    import threading
    from dataclasses import replace

    from metronome.audio.cascade import CascadeAdapter
    from metronome.audio.sentences import CutPolicy
    from metronome.audio.tts import SpeechSynthesizer
    from tests.audio.speech import synth, trim
    from tests.audio.test_frontend import GatedAsr
    from tests.audio.test_tts import ScriptedVoice

    voice, asr = ScriptedVoice(), GatedAsr(text="Stop.")
    voice.gate.clear()                                 # the answer's speech is not ready when the user talks
    asr.gate.clear()
    with SpeechSynthesizer(voice, policy=CutPolicy(first_clause_chars=0)) as speech:
        adapter = CascadeAdapter(engine.tokenizer, asr=asr, speech=speech)
        core = TickCore(engine, adapter, replace(config, adapter="cascade"))
        try:
            assert core.open(pb.OpenSessionRequest(sid="s", mode="turn")).ok

            def step(tick, **inp):
                return by_sid(core.step(pb.StepRequest(tick=tick, tokens_per_tick=4, sessions=[
                    pb.SessionInput(sid="s", sample_rate=16000, **inp)])))["s"]

            first = step(1, text="Tell me a story.", new_turn=True)   # item + response.create
            assert len(first.tokens) == 4 and not first.finished and not first.audio_pcm16
            onset = encode_pcm16(trim(synth("Stop, please stop"))[:8000])   # speech begins, has not ended
            during = step(2, audio_pcm16=onset)
            assert len(during.tokens) == 4 and not during.finished           # the VAD runs beside the tick
            assert adapter.frontend.wait_idle(30)
            cut = step(3)
            voice.gate.set()
            assert cut.finished and cut.cancelled and not cut.tokens and not cut.audio_pcm16 and not cut.error
            assert not adapter.speaking("s") and not adapter.session_state("s")["responding"]
            after = step(4, audio_pcm16=encode_pcm16(np.zeros(16000, np.float32)))   # silence ends the utterance
            assert not after.tokens and not after.audio_pcm16 and not after.finished
            assert asr.entered.wait(30)                # Whisper has it, held: the tick went on without it
            asr.gate.set()
            assert adapter.frontend.wait_idle(30)
            heard = step(5)
            assert heard.transcript == "Stop." and len(heard.tokens) == 4
            assert threading.get_ident() not in asr.threads
        finally:
            core.close_all()
            adapter.shutdown()


def test_the_cascade_hears_streamed_audio_before_its_tick_in_the_order_it_was_sent(engine, config):
    """Through ``hear`` (a StreamStep's messages, between ticks) the VAD and Whisper have a question before its
    tick comes, and that tick answers it. A turn detection sent ahead of the audio applies to that audio (no
    server VAD: only the commit ends the turn); a refused one is the session's error at its tick."""
    from dataclasses import replace

    from metronome.audio.cascade import CascadeAdapter
    from tests.audio.speech import synth, trim
    from tests.audio.test_frontend import GatedAsr

    question = "What is the capital of France?"
    adapter = CascadeAdapter(engine.tokenizer, asr=GatedAsr(text=question))
    core = TickCore(engine, adapter, replace(config, adapter="cascade"))
    sids = ("auto", "manual", "refused")
    try:
        for sid in sids:
            assert core.open(pb.OpenSessionRequest(sid=sid, mode="turn")).ok
        spoken = encode_pcm16(np.concatenate([np.zeros(4800, np.float32), trim(synth(question)),
                                              np.zeros(16000, np.float32)]))
        core.hear(pb.StepRequest(sessions=[
            pb.SessionInput(sid="auto", audio_pcm16=spoken, sample_rate=16000),
            pb.SessionInput(sid="manual", audio_pcm16=spoken, sample_rate=16000,
                            turn_detection=pb.TurnDetection(server_vad=False)),
            pb.SessionInput(sid="refused", audio_pcm16=spoken, sample_rate=16000,
                            turn_detection=pb.TurnDetection(server_vad=True, threshold=2.0))]))
        assert adapter.frontend.wait_idle(30)

        def step(tick, **inp):
            return by_sid(core.step(pb.StepRequest(tick=tick, tokens_per_tick=4, sessions=[
                pb.SessionInput(sid=sid, sample_rate=16000, **inp) for sid in sids])))

        first = step(1)
        assert first["auto"].transcript == question and len(first["auto"].tokens) == 4
        assert first["auto"].input_dbfs > -40                              # the levels of the audio heard
        assert not first["manual"].transcript and not first["manual"].tokens and not first["manual"].error
        assert first["refused"].error_code == "input_refused" and "threshold" in first["refused"].error
        step(2, new_turn=True)                                             # the commit ends the manual turn
        assert adapter.frontend.wait_idle(30)
        third = step(3)
        assert third["manual"].transcript == question and len(third["manual"].tokens) == 4
    finally:
        core.close_all()
        adapter.shutdown()
