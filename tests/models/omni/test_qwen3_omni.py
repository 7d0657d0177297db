"""Qwen3-Omni's thinker decoder (MoE) on the engine against transformers' Qwen3OmniMoeForConditionalGeneration.

The tiny checkpoint is a full omni model (audio tower, vision tower, thinker; no talker) saved with
``save_pretrained``, plus the SmolLM2 tokenizer extended with Qwen3-Omni's audio marker tokens (the
audio adapter's tests reuse ``make_qwen3_omni``).
"""

from __future__ import annotations

import json

import pytest
import torch

from metronome import ModelLoadError
from metronome.config import EngineConfig, KVPolicy
from metronome.engine.engine import Engine
from metronome.engine.request import StepInput
from metronome.models.loader import load_model
from metronome.models.moe import MoeForCausalLM, SparseMoeBlock
from metronome.models.omni.qwen3_omni import rename, stores_fused_experts, text_spec

AUDIO_TOKENS = ("<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")
HIDDEN = 32


def make_qwen3_omni(path, seed: int = 0, mlp_only_layers=(1,), num_mel_bins: int = 128, tokenizer: bool = True):
    """Save a random tiny Qwen3-Omni (thinker: 2 layers, one MoE and one dense), with a tokenizer unless
    ``tokenizer=False`` (then the vocabulary is 512 and the audio markers are its last ids).

    Returns the transformers model (the reference, eval mode, float32).
    """
    from transformers import AutoTokenizer, Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from tests.conftest import save_smollm2_tokenizer

    if tokenizer:
        save_smollm2_tokenizer(path)
        tok = AutoTokenizer.from_pretrained(path)
        tok.add_special_tokens({"additional_special_tokens": list(AUDIO_TOKENS)})
        tok.save_pretrained(path)
        start, end, pad = tok.convert_tokens_to_ids(list(AUDIO_TOKENS))
        vocab = (len(tok) + 15) // 16 * 16
    else:
        vocab = 512
        start, end, pad = vocab - 6, vocab - 5, vocab - 4
    text = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=16, num_experts=6,
                num_experts_per_tok=2, max_position_embeddings=1024, mlp_only_layers=list(mlp_only_layers),
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3],
                                 "interleaved": True})
    audio = dict(num_mel_bins=num_mel_bins, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32,
                 d_model=16, output_dim=HIDDEN, downsample_hidden_size=8, max_source_positions=200, n_window=50,
                 n_window_infer=400)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=HIDDEN, patch_size=4,
                  deepstack_visual_indexes=[0], num_position_embeddings=16)
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision, audio_token_id=pad,
                   audio_start_token_id=start, image_token_id=vocab - 3, video_token_id=vocab - 2,
                   vision_start_token_id=vocab - 1)
    config = Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # random norm weights / biases and a sharper router so those paths matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-omni")
    return str(path), make_qwen3_omni(path)


def _engine(path: str, window: int = 256) -> Engine:
    return Engine(EngineConfig(model=path, dtype="float32", num_blocks=64, max_chunk_tokens=64,
                               policy=KVPolicy(sinks=4, window=window, block_size=8, positions="absolute")))


def _text_model(ref):
    """The thinker's text model (transformers 5.2x nests it as ``model.language_model``; 5.1x had it as ``model``)."""
    return getattr(ref.thinker.model, "language_model", ref.thinker.model)


def _reference_logits(ref, embeds: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref.thinker(inputs_embeds=embeds[None], use_cache=False).logits[0]


def test_stored_names_and_spec(omni):
    from safetensors import safe_open

    path, ref = omni
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "thinker.model.layers.0.mlp.experts.5.gate_proj.weight" in keys   # one module per expert
    assert not stores_fused_experts(__import__("pathlib").Path(path))
    assert any(k.startswith("thinker.audio_tower.") for k in keys)
    spec = text_spec(json.loads(open(f"{path}/config.json").read()))
    text = ref.config.thinker_config.text_config
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (6, 2, 16)
    assert spec.mlp_only_layers == (1,) and spec.qk_norm and spec.norm_topk_prob == text.norm_topk_prob
    inv = _text_model(ref).rotary_emb.inv_freq
    torch.testing.assert_close(torch.tensor(spec.inv_freq), inv, atol=0, rtol=0)


def test_loaded_weights_equal_the_reference(omni):
    path, ref = omni
    net, _ = load_model(path, torch.float32, "cpu")
    assert isinstance(net, MoeForCausalLM)
    moe, dense = net.model.layers[0].mlp, net.model.layers[1].mlp
    assert isinstance(moe, SparseMoeBlock) and not isinstance(dense, SparseMoeBlock)
    theirs = _text_model(ref).layers[0].mlp.experts
    torch.testing.assert_close(moe.experts.gate_up_proj, theirs.gate_up_proj, atol=0, rtol=0)
    torch.testing.assert_close(moe.experts.down_proj, theirs.down_proj, atol=0, rtol=0)
    torch.testing.assert_close(net.lm_head.weight, ref.thinker.lm_head.weight, atol=0, rtol=0)


def test_audio_only_positions_are_one_dimensional(omni):
    """get_rope_index on header + audio placeholders + instruction: three equal, consecutive rows.

    Checked in both of transformers' branches (the multimodal one runs when any grid is given), so
    interleaved MRoPE over these positions is plain RoPE at 0, 1, 2, ...
    """
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    _, ref = omni
    cfg = ref.config.thinker_config
    mel_frames = torch.tensor([200, 137])   # a 2-s chunk and a ragged one
    n_audio = _get_feat_extract_output_lengths(mel_frames, cfg.audio_config.n_window).tolist()
    ids = [5, 6, 7]
    for n in n_audio:
        ids += [cfg.audio_start_token_id] + [cfg.audio_token_id] * n + [cfg.audio_start_token_id + 1] + [8, 9]
    input_ids = torch.tensor([ids])
    mask = torch.ones_like(input_ids)
    for grid in (None, torch.zeros((0, 3), dtype=torch.long)):
        owner = ref.thinker.model if hasattr(ref.thinker.model, "get_rope_index") else ref.thinker
        pos, delta = owner.get_rope_index(input_ids, image_grid_thw=grid, attention_mask=mask, audio_seqlens=mel_frames)
        want = torch.arange(len(ids), dtype=pos.dtype)
        for row in range(3):
            torch.testing.assert_close(pos[row, 0], want)
        assert int(delta.flatten()[0]) == 0


def test_engine_logits_and_greedy_match_transformers(omni):
    """A multi-chunk session (header tokens, spliced 'audio' embeddings, instruction) then greedy decode."""
    path, ref = omni
    engine = _engine(path)
    embed = engine.model.embed
    g = torch.Generator().manual_seed(7)
    header = torch.randint(0, 400, (9,), generator=g)
    audio1 = torch.randn(13, HIDDEN, generator=g) * 0.5     # stands in for encoder output at the pads
    audio2 = torch.randn(13, HIDDEN, generator=g) * 0.5
    instruction = torch.randint(0, 400, (6,), generator=g)
    chunks = [embed(header), audio1, torch.cat([audio2, embed(instruction)])]
    sid = engine.open_session()
    seen = []
    for chunk in chunks:
        out = engine.step([StepInput(sid, embeds=chunk, return_hidden=True)])[0]
        seen.append(chunk)
        full = torch.cat(seen)
        want = _reference_logits(ref, full)[-1]
        got = engine.model.compute_logits(out.hidden[None].float())[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    decoded = engine.step([StepInput(sid, max_new_tokens=6)])[0].token_ids
    expected, context = [], torch.cat(seen)
    for _ in range(6):
        nxt = int(_reference_logits(ref, context)[-1].argmax())
        expected.append(nxt)
        context = torch.cat([context, embed(torch.tensor([nxt]))])
    assert decoded == expected


def test_prompt_logprobs_at_every_position_match(omni):
    path, ref = omni
    engine = _engine(path)
    ids = torch.randint(0, 400, (40,), generator=torch.Generator().manual_seed(3))
    sid = engine.open_session()
    got = []
    for part in ids.split(16):
        got += engine.step([StepInput(sid, token_ids=part.tolist(), prompt_logprobs=True)])[0].prompt_logprobs
    logp = torch.log_softmax(_reference_logits(ref, engine.model.embed(ids)), -1)
    want = [None] + [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert got[0] is None
    torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(want[1:]), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_engine_with_graphs_and_grouped_gemm_matches_transformers(tmp_path):
    """On CUDA (float32): Triton attention, the grouped-GEMM experts and captured decode rounds."""
    ref = make_qwen3_omni(tmp_path, seed=2, tokenizer=False)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", num_blocks=160,
                                 max_chunk_tokens=64, policy=KVPolicy(sinks=4, window=256, block_size=16,
                                                                      positions="absolute")))
    assert engine.runner.graphs is not None
    g = torch.Generator().manual_seed(4)
    chunks = [engine.model.embed(torch.randint(0, 400, (n,), generator=g).cuda()) for n in (9, 20, 7)]
    sids = [engine.open_session() for _ in range(3)]   # three sessions share the decode rounds
    seen = []
    for chunk in chunks:
        outs = engine.step([StepInput(s, embeds=chunk, return_hidden=True) for s in sids])
        seen.append(chunk.cpu())
        want = _reference_logits(ref, torch.cat(seen))[-1]
        for out in outs:
            got = engine.model.compute_logits(out.hidden[None]).cpu()[0]
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    decoded = engine.step([StepInput(s, max_new_tokens=6) for s in sids])
    context, expected = torch.cat(seen), []
    for _ in range(6):
        nxt = int(_reference_logits(ref, context)[-1].argmax())
        expected.append(nxt)
        context = torch.cat([context, ref.thinker.get_input_embeddings()(torch.tensor([nxt]))])
    assert all(d.token_ids == expected for d in decoded)


def test_fused_expert_checkpoints_load_too(omni, tmp_path):
    from safetensors.torch import load_file, save_file

    path, ref = omni
    weights = load_file(f"{path}/model.safetensors")
    prefix = "thinker.model.layers.0.mlp.experts."
    n = ref.config.thinker_config.text_config.num_experts
    gate_up = torch.stack([torch.cat([weights.pop(f"{prefix}{e}.gate_proj.weight"),
                                      weights.pop(f"{prefix}{e}.up_proj.weight")]) for e in range(n)])
    weights[prefix + "gate_up_proj"] = gate_up
    weights[prefix + "down_proj"] = torch.stack([weights.pop(f"{prefix}{e}.down_proj.weight") for e in range(n)])
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(open(f"{path}/config.json").read())
    a, _ = load_model(path, torch.float32, "cpu")
    b, _ = load_model(str(tmp_path), torch.float32, "cpu")
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(b.model.layers[0].mlp(x), a.model.layers[0].mlp(x), atol=0, rtol=0)


def test_loader_errors_are_clear(omni, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = omni
    weights = load_file(f"{path}/model.safetensors")
    del weights["thinker.model.layers.0.mlp.experts.2.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    config = json.loads(open(f"{path}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="experts.2.down_proj"):
        load_model(str(tmp_path), torch.float32, "cpu")
    del config["thinker_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="thinker_config"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_rename_skips_everything_but_the_decoder():
    assert rename("thinker.model.norm.weight") == "model.norm.weight"
    assert rename("thinker.visual.blocks.0.attn.qkv.weight") is None
    assert rename("thinker.audio_tower.layers.0.fc1.weight") is None
    assert rename("code2wav.decoder.0.weight") is None and rename("talker.codec_head.weight") is None
