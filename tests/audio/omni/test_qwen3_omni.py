"""The Qwen3-Omni adapter: audio features and encoder against transformers, the full prompt through the
thinker against transformers' own audio path, session modes, refusals, and a worker end to end."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from metronome.audio.adapter import AdapterContext, TickAudio
from metronome.audio.omni.qwen3_omni import (AudioFrontEnd, Qwen3OmniAdapter, build_adapter, feature_extractor_for,
                                             TowerLayout, output_tokens, window_sdpa)
from metronome.audio.pcm import encode_pcm16
from metronome.config import EngineConfig, KVPolicy
from metronome.engine.engine import Engine
from metronome.engine.request import StepInput
from metronome.models.fp8 import Fp8Linear
from tests.audio.omni.test_tower_fp8 import TOWER_BOUND, relative_error
from tests.models.omni.test_qwen3_omni import make_qwen3_omni

RATE = 16000


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * RATE)
    envelope = np.repeat(10 ** rng.uniform(-3, 0, size=n // 400 + 1), 400)[:n]
    return (rng.standard_normal(n) * envelope * 0.3).clip(-1, 1).astype(np.float32)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-omni-audio")
    return str(path), make_qwen3_omni(path, seed=1)


@pytest.fixture(scope="module")
def engine(omni):
    return Engine(EngineConfig(model=omni[0], dtype="float32", num_blocks=96, max_chunk_tokens=128,
                               policy=KVPolicy(sinks=4, window=512, block_size=8, positions="absolute")))


def _adapter(engine, quantization: str | None = None, **kwargs) -> Qwen3OmniAdapter:
    context = AdapterContext(tokenizer=engine.tokenizer, checkpoint=engine.checkpoint, embed=engine.model.embed,
                             device=torch.device("cpu"), dtype=torch.float32, max_input_tokens=256, budget_ms=2000.0,
                             quantization=quantization)
    adapter = build_adapter(context)
    for key, value in kwargs.items():
        setattr(adapter, key, value)
    return adapter


def _processor_features(extractor, clip: np.ndarray):
    """Features as Qwen3-Omni's processor computes them for one clip (its audio_kwargs)."""
    out = extractor(clip, sampling_rate=RATE, padding=True, truncation=False, return_attention_mask=True,
                    return_tensors="pt")
    return out["input_features"], out["attention_mask"]


def test_output_lengths_follow_transformers():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    frames = torch.arange(1, 1000)
    want = _get_feat_extract_output_lengths(frames, 50)
    assert [output_tokens(int(f), 50) for f in frames] == want.tolist()


@pytest.mark.parametrize("frames", [[200], [200, 300, 200, 37], [7], [150, 1000, 99], [1600, 801]])
def test_tower_layout_is_what_transformers_computes(frames):
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    n_window, n_window_infer, mel = 50, 400, 3
    lengths = torch.tensor(frames)
    features = torch.randn(mel, sum(frames))
    padded, chunk_lengths = hf.chunk_and_pad_features(features, lengths, n_window)
    layout = TowerLayout.of(frames, n_window, n_window_infer)
    assert layout.chunk_lengths.tolist() == chunk_lengths.tolist()
    assert layout.full == (len(set(chunk_lengths.tolist())) == 1)
    ours = torch.zeros(len(layout.chunk_lengths) * int(layout.chunk_lengths.max()), mel)
    ours[torch.from_numpy(layout.chunk_slots())] = features.T
    assert torch.equal(ours.view(len(layout.chunk_lengths), -1, mel).transpose(1, 2), padded)
    assert layout.valid_indices.tolist() == hf.get_valid_indices(chunk_lengths, n_window).tolist()
    want = hf.get_audio_cu_seqlens(chunk_lengths, lengths, n_window_infer, n_window)
    assert layout.cu_seqlens.tolist() == want.tolist()


def test_the_tower_is_handed_its_layout_and_computes_none_of_it(engine, monkeypatch):
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    handed = []
    for name in ("chunk_and_pad_features", "get_valid_indices", "get_audio_cu_seqlens", "get_max_seqlen"):
        original = getattr(hf, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            given = kwargs.get("kwargs") or {}
            handed.append((_name, _name == "chunk_and_pad_features" and "padded_feature" in given
                          or _name == "get_valid_indices" and "valid_indices" in given
                          or _name == "get_audio_cu_seqlens" and "cu_seqlens" in given
                          or _name == "get_max_seqlen" and "max_seqlen" in given))
            return _original(*args, **kwargs)

        monkeypatch.setattr(hf, name, spy)
    frontend: AudioFrontEnd = _adapter(engine).frontend
    out = frontend.encode([speech_like(2.0, seed=1), speech_like(0.5, seed=2)])
    assert [o.shape[0] for o in out] == [26, frontend.tokens(RATE // 2)]
    assert {name for name, _ in handed} == {"chunk_and_pad_features", "get_valid_indices", "get_audio_cu_seqlens",
                                            "get_max_seqlen"}
    assert all(given for _, given in handed)   # the attention asks again per layer: handed the same


def test_window_attention_equals_per_window_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 30, 8, generator=g) for _ in range(3))
    for bounds in ([0, 10, 20, 30], [0, 13, 26, 30], [0, 30]):
        cu = torch.tensor(bounds, dtype=torch.int32)
        got, _ = window_sdpa(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu)
        want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=0.3) for a, b in zip(bounds[:-1], bounds[1:])], dim=2)
        torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-6, rtol=1e-5)


def test_encoder_outputs_equal_the_audio_tower(omni, engine):
    _, ref = omni
    adapter = _adapter(engine)
    frontend: AudioFrontEnd = adapter.frontend
    clips = [speech_like(2.0, seed=1), speech_like(3.0, seed=2), speech_like(2.0, seed=3), speech_like(0.37, seed=4)]
    ours = frontend.encode(clips)
    extractor = feature_extractor_for(None, ref.config.thinker_config.audio_config.num_mel_bins)
    for clip, got in zip(clips, ours):
        feats, mask = _processor_features(extractor, clip)
        with torch.no_grad():
            want = ref.thinker.get_audio_features(feats, feature_attention_mask=mask).last_hidden_state
        hidden = ref.config.thinker_config.text_config.hidden_size
        assert got.shape == want.shape == (frontend.tokens(clip.size), hidden)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert frontend.tokens_per_block == 13 and frontend.tokens(2 * RATE) == 26
    whole = frontend.encode([clips[0], clips[2]])   # every chunk whole: the padded chunks are a reshape
    for got, want in zip(whole, (ours[0], ours[2])):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_an_fp8_context_gets_an_fp8_audio_tower(engine):
    plain, fp8 = _adapter(engine).frontend, _adapter(engine, quantization="fp8").frontend
    assert not any(isinstance(m, Fp8Linear) for m in plain.encoder.modules())
    assert isinstance(fp8.encoder.layers[1].self_attn.k_proj, Fp8Linear) and isinstance(fp8.encoder.layers[0].fc1,
                                                                                         Fp8Linear)
    assert all(type(m) is torch.nn.Linear for m in (fp8.encoder.conv_out, fp8.encoder.proj1, fp8.encoder.proj2))
    clips = [speech_like(2.0, seed=1), speech_like(1.0, seed=2)]
    assert 0 < relative_error(torch.cat(fp8.encode(clips)), torch.cat(plain.encode(clips))) < TOWER_BOUND


def test_free_running_prompt_matches_transformers_with_input_features(omni, engine):
    """Two ticks of a free-running session on the engine vs transformers' thinker on the same token ids
    with the two clips as ``input_features`` (its own encoder call, masked_scatter and positions)."""
    _, ref = omni
    adapter = _adapter(engine)
    adapter.instruction = adapter.tokenizer.encode("Answer briefly.", add_special_tokens=False)
    adapter.open_session("s", "free_running", "You are a helpful assistant.")
    sid = engine.open_session()
    clips = [speech_like(2.0, seed=5), speech_like(2.0, seed=6)]
    extractor = feature_extractor_for(None, ref.config.thinker_config.audio_config.num_mel_bins)
    all_ids: list[int] = []
    for n, clip in enumerate(clips):
        prepared = adapter.prepare([TickAudio("s", pcm=clip, max_tokens=0)])[0]
        assert prepared.error is None and prepared.embeds is not None
        out = engine.step([StepInput(sid, embeds=prepared.embeds, return_hidden=True)])[0]
        got = engine.model.compute_logits(out.hidden[None])[0]
        # the token ids behind this tick's embeds (the pads are where the audio went)
        ids = _ids_of(adapter, prepared.embeds, engine)
        all_ids += ids
        feats = [_processor_features(extractor, c) for c in clips[:n + 1]]
        longest = max(f.shape[-1] for f, _ in feats)
        features = torch.cat([torch.nn.functional.pad(f, (0, longest - f.shape[-1])) for f, _ in feats])
        masks = torch.cat([torch.nn.functional.pad(m, (0, longest - m.shape[-1])) for _, m in feats])
        input_ids = torch.tensor([all_ids])
        with torch.no_grad():
            want = ref.thinker(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), input_features=features,
                               feature_attention_mask=masks, use_cache=False).logits[0, -1]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    tok, m = adapter.tokenizer, adapter.markers
    first = tok.decode(all_ids[:all_ids.index(m.start)])
    assert "You are a helpful assistant." in first                      # the header the sinks pin
    assert all_ids.count(m.start) == all_ids.count(m.end) == 2 and all_ids.count(m.pad) == 52
    assert "Answer briefly." in tok.decode(all_ids) and adapter.session_state("s")["pending_samples"] == 0


def _ids_of(adapter, embeds: torch.Tensor, engine) -> list[int]:
    """Recover token ids from embeddings (pads: any row that is not a token's embedding)."""
    table = engine.model.model.embed_tokens.weight
    ids = []
    for row in embeds:
        hit = (table == row).all(-1).nonzero()
        ids.append(int(hit[0]) if hit.numel() else adapter.markers.pad)
    return ids


def test_free_running_decodes_every_tick_and_keeps_state_bounded(engine):
    adapter = _adapter(engine)
    adapter.open_session("f", "free_running", "")
    # 0.7 s is short of a second: nothing is heard, nothing decoded yet
    first = adapter.prepare([TickAudio("f", pcm=speech_like(0.7), max_tokens=3)])[0]
    assert first.token_ids and first.embeds is None and first.max_new_tokens == 0
    assert adapter.session_state("f")["pending_samples"] == int(0.7 * RATE)
    for tick in range(6):
        p = adapter.prepare([TickAudio("f", pcm=speech_like(2.0, seed=tick), max_tokens=3)])[0]
        assert p.embeds is not None and p.max_new_tokens == 3
        adapter.on_output("f", [5, 6, 7], False)
        assert adapter.session_state("f")["pending_samples"] < adapter.frontend.block_samples
    assert p.embeds.shape[0] == 2 + 26          # later ticks: <|audio_start|> 26 pads <|audio_end|>
    assert adapter.input_tokens_per_tick(2000.0) >= p.embeds.shape[0]


def test_turn_mode_answers_after_commit_and_holds_audio_while_answering(engine):
    adapter = _adapter(engine)
    adapter.open_session("t", "turn", "")
    heard = adapter.prepare([TickAudio("t", pcm=speech_like(1.5), max_tokens=4)])[0]
    assert heard.embeds is not None and heard.max_new_tokens == 0     # 1 s heard, 0.5 s pending, no answer yet
    commit = adapter.prepare([TickAudio("t", pcm=speech_like(0.2), new_turn=True, max_tokens=4)])[0]
    assert commit.embeds is not None and commit.max_new_tokens == 4 and commit.stop_token_ids
    assert adapter.session_state("t")["responding"] and adapter.session_state("t")["pending_samples"] == 0
    busy = adapter.prepare([TickAudio("t", pcm=speech_like(1.0), max_tokens=4)])[0]
    assert busy.embeds is None and busy.max_new_tokens == 4            # audio waits while answering
    assert adapter.session_state("t")["pending_samples"] == RATE
    stop = adapter.stop_token_ids[0]
    adapter.on_output("t", [9, stop], True)
    after = adapter.prepare([TickAudio("t", pcm=np.zeros(0, np.float32), max_tokens=4)])[0]
    assert after.max_new_tokens == 0 and after.embeds is not None      # answer closed, held second heard


def test_bad_input_is_refused_per_session_and_the_session_stays_usable(engine):
    adapter = _adapter(engine)
    adapter.open_session("a", "free_running", "")
    adapter.open_session("b", "free_running", "")
    bad = adapter.prepare([
        TickAudio("ghost", pcm=speech_like(1.0)),
        TickAudio("a", pcm=np.full(RATE, np.nan, np.float32)),
        TickAudio("b", pcm=np.zeros((2, RATE), np.float32)),
        TickAudio("a", text="word " * 400),
    ])
    assert "not open" in bad[0].error and "NaN" in bad[1].error and "1-D" in bad[2].error
    assert "at most 256" in bad[3].error
    assert adapter.session_state("a") == adapter.session_state("b")
    assert adapter.session_state("a")["pending_samples"] == 0 and not adapter.session_state("a")["started"]
    good = adapter.prepare([TickAudio("a", pcm=speech_like(1.0), max_tokens=2),
                            TickAudio("b", pcm=speech_like(1.0), max_tokens=2)])
    assert all(p.error is None and p.embeds is not None and p.max_new_tokens == 2 for p in good)
    with pytest.raises(ValueError, match="mode"):
        adapter.open_session("c", "karaoke", "")


async def test_worker_serves_qwen3_omni_end_to_end(omni):
    from metronome.serving.proto import worker_pb2 as pb
    from metronome.serving.proto import worker_pb2_grpc
    from metronome.serving.worker import WorkerConfig, serve_worker

    engine = EngineConfig(model=omni[0], dtype="float32", num_blocks=64, max_chunk_tokens=64,
                          policy=KVPolicy(sinks=4, window=128, block_size=8))
    handle = await serve_worker(WorkerConfig(engine, adapter="qwen3_omni", max_input_tokens=256, port=0))
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for sid in ("x", "y"):
                assert (await stub.OpenSession(pb.OpenSessionRequest(sid=sid, mode="free_running"))).ok
            tokens = {}
            for tick in (1, 2):
                response = await stub.Step(pb.StepRequest(tick=tick, tokens_per_tick=3, sessions=[
                    pb.SessionInput(sid=sid, audio_pcm16=encode_pcm16(speech_like(2.0, seed=tick)), sample_rate=RATE)
                    for sid in ("x", "y")]))
                for out in response.outputs:
                    assert not out.error and len(out.tokens) == 3
                    tokens.setdefault(out.sid, []).extend(out.tokens)
            assert tokens["x"] == tokens["y"]          # same audio, same context: same greedy tokens
            assert response.frontend_ms > 0 and response.prefill_ms > 0
    finally:
        await handle.stop(0)
