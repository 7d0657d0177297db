"""The MiniCPM-o 4.5 adapter against a reference composed from transformers classes.

The reference follows OpenBMB's published MiniCPM-o 4.5 code (``modeling_minicpmo.py``,
``processing_minicpmo.py``), which is not in transformers:

* features: ``MiniCPMOProcessor.audio_feature_extract`` → ``MiniCPMAAudioProcessor`` (Whisper's extractor
  formula, clip zero-padded to 30 s, its own frames kept) — here transformers' ``WhisperFeatureExtractor``
  with its default 30-s padding, cut to the clip's 100 frames;
* ``MiniCPMO.get_audio_embedding``: ``apm`` (a WhisperEncoder; a 1-s clip is one 50-frame attention
  chunk at positions 0..49) → ``hidden_states[-1]`` (after the final layer norm) →
  ``audio_projection_layer`` (linear-ReLU-linear) → ``AvgPool1d(audio_pool_step)`` — here transformers'
  ``WhisperEncoder`` built for exactly 50 positions (its forward requires a full window) with the
  checkpoint's weights and first 50 position rows;
* ``get_audio_placeholder(chunk_input=True)`` + ``MiniCPMO.get_omni_embedding``: per 1-s chunk
  ``<|audio_start|>`` + 10 ``<unk>`` + ``<|audio_end|>``, the rows between the markers replaced by the
  chunk's embeddings; then ``self.llm`` (transformers' ``Qwen3ForCausalLM``) on ``inputs_embeds``.
"""

from __future__ import annotations

from dataclasses import replace

import grpc
import numpy as np
import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.audio.adapter import AdapterContext, TickAudio
from metronome.audio.omni.minicpm_o import DEFAULT_SYSTEM, THINK_OFF, MiniCpmoAdapter, build_adapter
from metronome.audio.pcm import encode_pcm16
from metronome.models.fp8 import Fp8Linear
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc
from metronome.serving.worker import WorkerConfig, serve_worker
from tests.audio.omni.test_tower_fp8 import TOWER_BOUND, relative_error
from tests.models.omni.test_minicpm_o import build_checkpoint

RESPOND = "<|im_end|>\n<|im_start|>assistant\n" + THINK_OFF
UNIT = "<|audio_start|>" + "<unk>" * 10 + "<|audio_end|>"


def speech_like(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(round(seconds * 16000))
    envelope = np.repeat(10 ** rng.uniform(-2.5, 0, size=n // 400 + 1), 400)[:n]
    return (rng.standard_normal(n) * envelope * 0.3).clip(-1, 1).astype(np.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("minicpmo-audio")
    return path, build_checkpoint(path, seed=3)


@pytest.fixture(scope="module")
def engine(tiny):
    path, _ = tiny
    return Engine(EngineConfig(model=str(path), dtype="float32", num_blocks=160, max_chunk_tokens=256,
                               max_batch_tokens=1024, policy=KVPolicy(sinks=4, window=512, block_size=16)))


def context(engine, max_input_tokens: int = 512) -> AdapterContext:
    return AdapterContext(tokenizer=engine.tokenizer, checkpoint=engine.checkpoint, embed=engine.model.embed,
                          device=engine.device, dtype=torch.float32, max_input_tokens=max_input_tokens,
                          budget_ms=1000.0)


@pytest.fixture(scope="module")
def adapter(engine) -> MiniCpmoAdapter:
    return build_adapter(context(engine))


# ------------------------------------------------------------------------------------------ reference
def ref_features(chunk: np.ndarray) -> torch.Tensor:
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=80)
    feats = fe(chunk, sampling_rate=16000, return_attention_mask=True, return_tensors="pt")   # 30-s padding
    frames = int(feats.attention_mask.sum())
    return feats.input_features[:, :, :frames]


def ref_audio_embeds(ref, chunk: np.ndarray) -> torch.Tensor:
    """[10, hidden] for one 1-s chunk, the published get_audio_embedding on transformers modules."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    mel = ref_features(chunk)
    config = WhisperConfig(**{**ref.audio_config.to_dict(), "max_source_positions": mel.shape[-1] // 2})
    apm = WhisperEncoder(config).eval()
    state = dict(ref.apm.state_dict())
    state["embed_positions.weight"] = state["embed_positions.weight"][:config.max_source_positions]
    apm.load_state_dict(state)
    with torch.no_grad():
        states = apm(mel).last_hidden_state
        x = ref.projector(states)
        x = torch.nn.AvgPool1d(ref.pool_step, stride=ref.pool_step)(x.transpose(1, 2)).transpose(1, 2)
    return x[0]


def ref_inputs_embeds(ref, tokenizer, prompt: str, chunks: list[np.ndarray]) -> torch.Tensor:
    """The published get_omni_embedding: embed the prompt's ids, replace each audio bound with its chunk."""
    ids = torch.tensor(tokenizer.encode(prompt, add_special_tokens=False))
    starts = torch.where(ids == tokenizer.convert_tokens_to_ids("<|audio_start|>"))[0] + 1
    ends = torch.where(ids == tokenizer.convert_tokens_to_ids("<|audio_end|>"))[0]
    assert len(starts) == len(ends) == len(chunks)
    with torch.no_grad():
        embeds = ref.llm.get_input_embeddings()(ids).clone()
        for start, end, chunk in zip(starts, ends, chunks):
            embeds[start:end] = ref_audio_embeds(ref, chunk)
    return embeds


# ------------------------------------------------------------------------------------------ audio path
def test_a_chunk_becomes_ten_rows_equal_to_whisper_then_projection_then_pooling(tiny, adapter):
    _, ref = tiny
    chunk = speech_like(1.0, seed=1)
    assert adapter.spec.tokens_per_chunk == 10
    mel = adapter.mel([chunk])
    torch.testing.assert_close(mel, ref_features(chunk), rtol=0, atol=1e-5)   # the published 30-s padding
    with torch.no_grad():
        got = adapter.tower(mel)
    assert got.shape == (1, 10, 64)
    torch.testing.assert_close(got[0], ref_audio_embeds(ref, chunk), rtol=1e-5, atol=1e-5)
    # Projection before pooling matters (ReLU): pooling first gives different rows.
    with torch.no_grad():
        states = adapter.tower.encode(mel)
        pooled_first = adapter.tower.audio_avg_pooler(states.transpose(1, 2)).transpose(1, 2)
        swapped = adapter.tower.audio_projection_layer(pooled_first)
    assert not torch.allclose(swapped, got, atol=1e-3)


def test_chunks_of_a_batch_are_encoded_independently(adapter):
    a, b = speech_like(1.0, seed=4), speech_like(1.0, seed=5)
    with torch.no_grad():
        both = adapter.tower(adapter.mel([a, b]))
        alone = adapter.tower(adapter.mel([b]))
    torch.testing.assert_close(both[1], alone[0], rtol=1e-5, atol=1e-5)


def test_an_fp8_context_gets_an_fp8_audio_tower(engine, adapter):
    fp8 = build_adapter(replace(context(engine), quantization="fp8")).tower
    assert not any(isinstance(m, Fp8Linear) for m in adapter.tower.modules())
    assert isinstance(fp8.apm.layers[1].self_attn.v_proj, Fp8Linear) and isinstance(fp8.apm.layers[0].fc2, Fp8Linear)
    assert all(type(m) is torch.nn.Linear for m in (fp8.audio_projection_layer.linear1,
                                                    fp8.audio_projection_layer.linear2))
    mel = adapter.mel([speech_like(1.0, seed=6), speech_like(1.0, seed=7)])
    with torch.no_grad():
        assert 0 < relative_error(fp8(mel), adapter.tower(mel)) < TOWER_BOUND


# ------------------------------------------------------------------------------------------ full path
def step_logits(engine, sid, prepared) -> torch.Tensor:
    out, = engine.step([StepInput(sid, token_ids=prepared.token_ids, embeds=prepared.embeds, return_hidden=True)])
    assert out.ok, out.error
    return engine.model.compute_logits(out.hidden[None])[0]


def test_free_running_session_logits_equal_the_published_forward(tiny, engine):
    """Three 1-s ticks in the paper's layout (header, first audio, instruction, assistant prefix, then
    audio keeps arriving): each tick's last-position logits and the greedy continuation equal the
    reference (Qwen3ForCausalLM on the published spliced embeddings of the whole prompt so far)."""
    _, ref = tiny
    adapter = MiniCpmoAdapter.from_context(context(engine), instruction="Transcribe.")
    tok = engine.tokenizer
    adapter.open_session("a", "free_running", "")
    sid = engine.open_session()
    chunks = [speech_like(1.0, seed=10 + k) for k in range(3)]
    prompt = f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n" + UNIT + "Transcribe." + RESPOND
    for k, chunk in enumerate(chunks):
        if k:
            prompt += UNIT
        prepared, = adapter.prepare([TickAudio("a", pcm=chunk, max_tokens=0)])
        assert prepared.error is None and prepared.embeds is not None and prepared.max_new_tokens == 0
        got = step_logits(engine, sid, prepared)
        embeds = ref_inputs_embeds(ref, tok, prompt, chunks[:k + 1])
        assert prepared.embeds.shape[0] == (embeds.shape[0] if k == 0 else len(tok.encode(UNIT)))
        with torch.no_grad():
            want = ref.llm(inputs_embeds=embeds[None]).logits[0, -1]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    out, = engine.step([StepInput(sid, max_new_tokens=5)])
    context_embeds, want_tokens = embeds, []
    with torch.no_grad():
        for _ in range(5):
            token = int(ref.llm(inputs_embeds=context_embeds[None]).logits[0, -1].argmax())
            want_tokens.append(token)
            context_embeds = torch.cat([context_embeds, ref.llm.get_input_embeddings()(torch.tensor([token]))])
    assert out.token_ids == want_tokens
    engine.close_session(sid)


def test_turn_mode_frames_a_spoken_question_and_its_answer(engine):
    adapter = MiniCpmoAdapter.from_context(context(engine), max_response_tokens=6)
    tok = engine.tokenizer
    n = lambda text: len(tok.encode(text, add_special_tokens=False))   # noqa: E731
    header = n("<|im_start|>system\nBe brief.<|im_end|>\n")
    adapter.open_session("t", "turn", "Be brief.")

    first, = adapter.prepare([TickAudio("t", pcm=speech_like(1.5, seed=20), max_tokens=4)])
    assert first.num_tokens == header + n("<|im_start|>user\n") + 12 and first.max_new_tokens == 0
    assert_layout(engine, first.embeds, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n", 1, "")
    assert adapter.session_state("t")["carry_samples"] == 8000 and adapter.session_state("t")["user_open"]

    # Commit: the half second left is padded to a chunk; the turn closes and the answer starts.
    second, = adapter.prepare([TickAudio("t", pcm=np.zeros(0, np.float32), new_turn=True, max_tokens=4)])
    assert second.num_tokens == 12 + n(RESPOND) and second.max_new_tokens == 4
    assert_layout(engine, second.embeds, "", 1, RESPOND)
    assert second.stop_token_ids == tuple(tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|tts_eos|>",
                                                                                 "<|endoftext|>"))
    assert adapter.session_state("t")["carry_samples"] == 0
    adapter.on_output("t", [104, 105], finished=False)

    # Audio during the answer is held; the cap ends the answer after 6 tokens in all.
    third, = adapter.prepare([TickAudio("t", pcm=speech_like(1.0, seed=21), max_tokens=4)])
    assert third.num_tokens == 0 and third.max_new_tokens == 4 and third.ends_response
    assert adapter.session_state("t")["held_chunks"] == 1
    adapter.on_output("t", [33, 33, 33, 33], finished=True)

    # Next tick: the answer is closed, the held chunk opens the next user turn.
    fourth, = adapter.prepare([TickAudio("t", pcm=np.zeros(0, np.float32), max_tokens=4)])
    assert_layout(engine, fourth.embeds, "<|im_end|>\n<|im_start|>user\n", 1, "")
    assert fourth.max_new_tokens == 0 and adapter.session_state("t")["held_chunks"] == 0

    # Typed text is a whole turn (the open spoken turn takes it) and starts an answer.
    fifth, = adapter.prepare([TickAudio("t", text="hi", max_tokens=4)])
    assert fifth.token_ids == tok.encode("hi" + RESPOND, add_special_tokens=False)


def assert_layout(engine, embeds: torch.Tensor, text_before: str, chunks: int, text_after: str) -> None:
    """``embeds`` rows are text_before's tokens, ``chunks`` audio units, then text_after's tokens."""
    tok = engine.tokenizer
    before, after = (tok.encode(t, add_special_tokens=False) for t in (text_before, text_after))
    start, end = tok.convert_tokens_to_ids(["<|audio_start|>", "<|audio_end|>"])
    assert embeds.shape[0] == len(before) + 12 * chunks + len(after)
    with torch.no_grad():
        embed = lambda ids: engine.model.embed(torch.tensor(ids, dtype=torch.long))   # noqa: E731
        torch.testing.assert_close(embeds[:len(before)], embed(before))
        for c in range(chunks):
            unit = embeds[len(before) + 12 * c: len(before) + 12 * (c + 1)]
            torch.testing.assert_close(unit[[0, 11]], embed([start, end]))
        torch.testing.assert_close(embeds[len(embeds) - len(after):], embed(after))


def test_sessions_prepared_in_one_tick_get_what_each_gets_alone(engine):
    """Every session's markers are embedded in one lookup and its chunks encoded in one batch: each prompt is
    still the one that session's tick alone makes (the encoder's batch independence is tested above)."""
    modes = {"x": "free_running", "y": "turn", "z": "free_running"}
    ticks = [{"x": dict(pcm=speech_like(1.0, seed=90)), "y": dict(pcm=speech_like(1.5, seed=91)), "z": dict(text="hi")},
             {"x": dict(pcm=speech_like(2.0, seed=92), text="ok"), "y": dict(new_turn=True),
              "z": dict(pcm=speech_like(1.0, seed=93))}]
    together = MiniCpmoAdapter.from_context(context(engine))
    alone = {sid: MiniCpmoAdapter.from_context(context(engine)) for sid in modes}
    for sid, mode in modes.items():
        together.open_session(sid, mode, "Be brief.")
        alone[sid].open_session(sid, mode, "Be brief.")
    for tick in ticks:
        inputs = [TickAudio(sid, **{"pcm": np.zeros(0, np.float32), **given}, max_tokens=3)
                  for sid, given in tick.items()]
        for inp, got in zip(inputs, together.prepare(inputs)):
            want, = alone[inp.session_id].prepare([inp])
            assert got.error is None and got.token_ids == want.token_ids
            assert (got.embeds is None) == (want.embeds is None)
            if got.embeds is not None:
                torch.testing.assert_close(got.embeds, want.embeds, rtol=1e-5, atol=1e-5)
            together.on_output(inp.session_id, [33], finished=False)
            alone[inp.session_id].on_output(inp.session_id, [33], finished=False)
    assert {sid: together.session_state(sid) for sid in modes} == \
        {sid: alone[sid].session_state(sid) for sid in modes}


def test_free_running_typed_text_closes_the_answer_and_opens_a_user_turn(engine):
    adapter = MiniCpmoAdapter.from_context(context(engine))
    adapter.open_session("f", "free_running", "Be brief.")
    first, = adapter.prepare([TickAudio("f", pcm=speech_like(1.0, seed=70), max_tokens=3)])
    assert_layout(engine, first.embeds, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n", 1, RESPOND)
    assert first.max_new_tokens == 3 and first.stop_token_ids == ()
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    adapter.on_output("f", [104, im_end], finished=False)   # the model ended its answer itself

    second, = adapter.prepare([TickAudio("f", pcm=speech_like(1.0, seed=71), text="hi", max_tokens=3)])
    assert_layout(engine, second.embeds, "\n<|im_start|>user\n", 1, "hi" + RESPOND)   # <|im_end|> is fed back
    adapter.on_output("f", [], finished=False)

    third, = adapter.prepare([TickAudio("f", pcm=speech_like(1.0, seed=72), max_tokens=3)])
    assert_layout(engine, third.embeds, "", 1, "")   # the model keeps hearing
    fourth, = adapter.prepare([TickAudio("f", text="ok", max_tokens=3)])
    assert fourth.token_ids == engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nok" + RESPOND,
                                                       add_special_tokens=False)


def test_bad_input_is_refused_per_session_and_leaves_it_usable(engine):
    adapter = MiniCpmoAdapter.from_context(context(engine, max_input_tokens=200), max_chunks_per_tick=2)
    adapter.open_session("ok", "free_running", "Be brief.")
    adapter.open_session("bad", "free_running", "Be brief.")
    adapter.prepare([TickAudio("bad", pcm=speech_like(0.4, seed=30))])   # 0.4 s carried
    before = adapter.session_state("bad")

    nan = speech_like(1.0, seed=31)
    nan[5] = np.nan
    cases = [TickAudio("bad", pcm=nan), TickAudio("bad", pcm=np.zeros((2, 8000), np.float32)),
             TickAudio("bad", pcm=speech_like(3.0, seed=32)), TickAudio("bad", text="x" * 300),
             TickAudio("nobody", pcm=speech_like(1.0, seed=33))]
    for case in cases:
        good, bad = adapter.prepare([TickAudio("ok", pcm=speech_like(1.0, seed=34)), case])
        assert good.error is None and good.embeds is not None
        assert bad.error, case
        if case.session_id == "bad":
            assert adapter.session_state("bad") == before

    again, = adapter.prepare([TickAudio("bad", pcm=speech_like(0.6, seed=35), max_tokens=2)])
    assert again.error is None and again.embeds is not None and again.max_new_tokens == 2
    assert adapter.session_state("bad")["carry_samples"] == 0 and adapter.session_state("bad")["started"]
    # Every second of audio is 12 positions (markers included): 17 s is 204 > 200, 16 s is 192.
    wide = MiniCpmoAdapter.from_context(context(engine, max_input_tokens=200), max_chunks_per_tick=20)
    wide.open_session("w", "free_running", "Be brief.")
    wide.prepare([TickAudio("w", pcm=speech_like(1.0, seed=36))])
    too_long, = wide.prepare([TickAudio("w", pcm=np.zeros(17 * 16000, np.float32))])
    assert too_long.error and "204 tokens" in too_long.error
    fits, = wide.prepare([TickAudio("w", pcm=np.zeros(16 * 16000, np.float32))])
    assert fits.error is None and fits.embeds.shape[0] == 192

    with pytest.raises(ValueError, match="already open"):
        adapter.open_session("ok", "turn", "")
    with pytest.raises(ValueError, match="mode"):
        adapter.open_session("x", "duplex", "")


def test_state_stays_bounded_over_a_long_session(engine):
    adapter = MiniCpmoAdapter.from_context(context(engine), max_held_chunks=2)
    adapter.open_session("s", "turn", "")
    for k in range(12):
        pcm = speech_like(0.7 + 0.1 * (k % 5), seed=40 + k)
        prepared, = adapter.prepare([TickAudio("s", pcm=pcm, new_turn=k == 3, max_tokens=2)])
        assert prepared.error is None
        adapter.on_output("s", [120, 121] if prepared.max_new_tokens else [], finished=False)
        state = adapter.session_state("s")
        assert state["carry_samples"] < 16000 and state["held_chunks"] <= 2


# ------------------------------------------------------------------------------------------ worker
async def test_worker_serves_minicpm_o_sessions_over_grpc(tiny):
    path, _ = tiny
    engine_config = EngineConfig(model=str(path), dtype="float32", num_blocks=128, max_chunk_tokens=64,
                                 max_batch_tokens=512, policy=KVPolicy(sinks=4, window=256, block_size=16))
    handle = await serve_worker(WorkerConfig(engine_config, adapter="minicpm_o", budget_ms=1000.0,
                                             max_input_tokens=256, port=0))
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for sid in ("a", "b"):
                assert (await stub.OpenSession(pb.OpenSessionRequest(sid=sid, mode="free_running"))).ok
            for tick in range(3):
                request = pb.StepRequest(tick=tick, sessions=[
                    pb.SessionInput(sid="a", audio_pcm16=encode_pcm16(speech_like(1.0, seed=50 + tick)),
                                    sample_rate=16000, max_tokens=3),
                    pb.SessionInput(sid="b", audio_pcm16=encode_pcm16(speech_like(1.0, seed=60 + tick)),
                                    sample_rate=16000, max_tokens=2)])
                response = await stub.Step(request)
                by_sid = {o.sid: o for o in response.outputs}
                assert not by_sid["a"].error and not by_sid["b"].error
                assert len(by_sid["a"].tokens) == 3 and len(by_sid["b"].tokens) == 2
                assert response.frontend_ms > 0
    finally:
        await handle.stop()
