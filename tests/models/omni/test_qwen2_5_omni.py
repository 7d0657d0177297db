"""Qwen2.5-Omni's thinker decoder on the engine against transformers' own thinker (tiny random config)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.errors import ModelLoadError
from metronome.models.loader import load_model
from metronome.models.omni.qwen2_5_omni import load_decoder, rename, text_spec

AUDIO, AUDIO_START, AUDIO_END = 250, 251, 252
MEL = 16


def tiny_thinker_config(vocab: int = 256, **text_overrides):
    from transformers import Qwen2_5OmniThinkerConfig

    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                **text_overrides)
    audio = dict(num_mel_bins=MEL, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                 output_dim=64, n_window=10, max_source_positions=64)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[0])
    return Qwen2_5OmniThinkerConfig(text_config=text, audio_config=audio, vision_config=vision,
                                    audio_token_index=AUDIO, audio_start_token_id=AUDIO_START,
                                    audio_end_token_id=AUDIO_END, image_token_index=253, video_token_index=254,
                                    vision_start_token_id=249)  # published configs carry it; get_rope_index reads it


def perturb(model) -> None:
    """Random biases and norm weights, so those code paths matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """A Qwen2_5OmniForConditionalGeneration checkpoint (thinker only: no talker) and its thinker."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5OmniConfig(thinker_config=tiny_thinker_config().to_dict(), enable_audio_output=False)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    perturb(model)
    path = tmp_path_factory.mktemp("qwen2_5_omni")
    model.save_pretrained(path)
    return path, model.thinker.eval()


def clip_features(frames: int, seed: int) -> torch.Tensor:
    return torch.randn(MEL, frames, generator=torch.Generator().manual_seed(seed))


def audio_rows(thinker, clips: list[torch.Tensor]) -> list[torch.Tensor]:
    """transformers' audio tower output per clip (the thinker's get_audio_features)."""
    lengths = torch.tensor([c.shape[1] for c in clips])
    padded = torch.zeros(len(clips), MEL, int(lengths.max()))
    mask = torch.zeros(len(clips), int(lengths.max()), dtype=torch.long)
    for i, c in enumerate(clips):
        padded[i, :, :c.shape[1]] = c
        mask[i, :c.shape[1]] = 1
    with torch.no_grad():
        rows = thinker.get_audio_features(padded, feature_attention_mask=mask).last_hidden_state
    # Where the encoder (and get_rope_index) sit depends on the transformers version: on the thinker in 5.17 (the
    # GPU machine), on thinker.model in 5.24 (here).
    tower = thinker.model.audio_tower if hasattr(thinker.model, "audio_tower") else thinker.audio_tower
    _, counts = tower._get_feat_extract_output_lengths(lengths)
    return list(rows.split(counts.tolist()))


def session_chunks(thinker):
    """Three ticks of a session: (token ids with audio placeholders, audio rows or None) each, and the
    features of its clips, as transformers takes them."""
    clips = [clip_features(20, 1), clip_features(13, 2)]
    rows = audio_rows(thinker, clips)
    chunks = [
        ([5, 6, 7, 8, 9] + [AUDIO_START] + [AUDIO] * len(rows[0]) + [AUDIO_END] + [10, 11], rows[0]),
        ([AUDIO_START] + [AUDIO] * len(rows[1]) + [AUDIO_END], rows[1]),
        ([12, 13, 14, 15], None),
    ]
    return chunks, clips


def splice(embed, ids: list[int], rows: torch.Tensor | None) -> torch.Tensor:
    t = torch.tensor(ids)
    e = embed(t).clone()
    if rows is not None:
        e[t == AUDIO] = rows
    return e


def reference_logits(thinker, ids: list[int], clips: list[torch.Tensor]) -> torch.Tensor:
    """transformers' thinker on the whole sequence, from input ids + mel features (its own splicing and
    TMRoPE position ids)."""
    lengths = [c.shape[1] for c in clips]
    padded = torch.zeros(len(clips), MEL, max(lengths))
    mask = torch.zeros(len(clips), max(lengths), dtype=torch.long)
    for i, c in enumerate(clips):
        padded[i, :, :c.shape[1]] = c
        mask[i, :c.shape[1]] = 1
    with torch.no_grad():
        out = thinker(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      input_features=padded, feature_attention_mask=mask, use_cache=False)
    return out.logits[0]


def test_names_in_saved_checkpoints_are_mapped(full, tmp_path):
    path, _ = full
    stored = load_file(str(path / "model.safetensors"))
    assert any(k.startswith("thinker.audio_tower.") for k in stored)      # what save_pretrained really writes
    kept = {rename(k) for k in stored} - {None}
    assert kept and all(k.startswith(("model.layers.", "model.embed_tokens", "model.norm", "lm_head")) for k in kept)
    assert rename("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"


def test_tmrope_positions_of_audio_and_text_are_one_dimensional(full):
    """get_rope_index, in both its text branch and its multimodal branch, gives audio-and-text prompts
    the same consecutive position in all three TMRoPE components."""
    _, thinker = full
    chunks, clips = session_chunks(thinker)
    ids = torch.tensor([[t for c, _ in chunks for t in c]])
    mask = torch.ones_like(ids)
    lengths = torch.tensor([c.shape[1] for c in clips])
    expected = torch.arange(ids.shape[1]).expand(3, 1, -1)
    rope_index = (thinker.model if hasattr(thinker.model, "get_rope_index") else thinker).get_rope_index  # as above
    plain, _ = rope_index(ids, None, None, mask, False, lengths)
    assert torch.equal(plain, expected)
    multimodal, delta = rope_index(ids, torch.zeros(0, 3, dtype=torch.long), None, mask, False, lengths)
    assert torch.equal(multimodal, expected) and int(delta) == 0


@pytest.mark.parametrize("positions", ["absolute", "rebased"])
def test_engine_matches_transformers_over_a_multi_chunk_session(full, positions):
    path, thinker = full
    engine = Engine(EngineConfig(model=str(path), policy=KVPolicy(sinks=4, window=256, block_size=16,
                                                                  positions=positions),
                                 num_blocks=64, max_chunk_tokens=64, max_batch_tokens=256))
    chunks, clips = session_chunks(thinker)
    ids = [t for c, _ in chunks for t in c]
    ref = reference_logits(thinker, ids, clips)

    sid = engine.open_session()
    end = 0
    for n, (chunk, rows) in enumerate(chunks):
        end += len(chunk)
        embeds = splice(engine.model.embed, chunk, rows)
        last = n == len(chunks) - 1
        out, = engine.step([StepInput(sid, embeds=embeds, return_hidden=not last, max_new_tokens=6 if last else 0)])
        assert out.ok, out.error
        if not last:
            torch.testing.assert_close(engine.model.compute_logits(out.hidden[None])[0], ref[end - 1],
                                       rtol=1e-4, atol=1e-4)

    # Greedy continuation: transformers' thinker re-run on the growing sequence.
    greedy, seq = [], list(ids)
    for _ in range(6):
        token = int(reference_logits(thinker, seq, clips)[-1].argmax())
        greedy.append(token)
        seq.append(token)
    assert out.token_ids == greedy


def test_thinker_only_checkpoints_load_too(tmp_path, full):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    torch.manual_seed(1)
    model = Qwen2_5OmniThinkerForConditionalGeneration(tiny_thinker_config()).eval()
    perturb(model)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_omni_thinker"
    net = load_decoder(tmp_path, config, torch.float32, "cpu")
    ids = torch.tensor([3, 4, 5, 6])
    torch.testing.assert_close(net.embed(ids), model.model.get_input_embeddings()(ids))
    torch.testing.assert_close(net.lm_head.weight, model.lm_head.weight)


def test_the_loader_dispatches_full_checkpoints_here(full):
    path, thinker = full
    net, checkpoint = load_model(str(path), torch.float32, "cpu")
    assert checkpoint == path and net.spec.model_type == "qwen2" and net.spec.num_layers == 2
    assert not net.spec.tie_word_embeddings
    torch.testing.assert_close(net.lm_head.weight, thinker.lm_head.weight)


def test_missing_weights_and_bad_configs_are_refused_clearly(full, tmp_path):
    path, _ = full
    config = json.loads((path / "config.json").read_text())
    stored = load_file(str(path / "model.safetensors"))
    del stored["thinker.model.layers.1.mlp.down_proj.weight"]
    save_file(stored, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing.*layers.1.mlp.down_proj"):
        load_decoder(tmp_path, config, torch.float32, "cpu")

    with pytest.raises(ModelLoadError, match="not a Qwen2.5-Omni"):
        text_spec({"model_type": "qwen2"})
    with pytest.raises(ModelLoadError, match="thinker_config"):
        text_spec({"model_type": "qwen2_5_omni"})
    sliding = json.loads(json.dumps(config))
    sliding["thinker_config"]["text_config"].update(use_sliding_window=True, sliding_window=64, max_window_layers=1,
                                                    layer_types=None)
    with pytest.raises(ModelLoadError, match="sliding"):
        text_spec(sliding)
    yarn = json.loads(json.dumps(config))
    yarn["thinker_config"]["text_config"]["rope_parameters"] = {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 1e4}
    with pytest.raises(ModelLoadError, match="RoPE type 'linear'"):
        text_spec(yarn)


def test_legacy_rope_scaling_keys_are_read():
    """Published Qwen2.5-Omni configs spell TMRoPE as rope_scaling {mrope_section, type} + rope_theta."""
    config = {"model_type": "qwen2_5_omni", "thinker_config": {"text_config": dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=1e6, rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default",
                                                               "type": "default"},
        use_sliding_window=False, sliding_window=32768, max_window_layers=28)}}
    spec = text_spec(config)
    assert spec.head_dim == 16 and spec.qkv_bias and not spec.o_bias and not spec.tie_word_embeddings
    torch.testing.assert_close(torch.tensor(spec.inv_freq), 1e6 ** -(torch.arange(0, 16, 2).float() / 16))
