"""The sparse MoE block and the MoE decoder's layer layout against transformers' Qwen3-Omni thinker classes."""

from __future__ import annotations

import pytest
import torch

from metronome.models.moe import MoeForCausalLM, MoeSpec, SparseMoeBlock
from metronome.models.spec import DecoderSpec


def _hf_config(**overrides):
    from transformers import Qwen3OmniMoeTextConfig

    kwargs = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2)
    return Qwen3OmniMoeTextConfig(**{**kwargs, **overrides})


def _spec(config) -> MoeSpec:
    base = dict(model_type="qwen3_omni_moe", vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
                num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, max_position_embeddings=128,
                qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, tie_word_embeddings=False,
                inv_freq=(1.0,) * (config.head_dim // 2), rope_attention_scaling=1.0, eos_token_ids=())
    return MoeSpec(**base, num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                   moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                   decoder_sparse_step=config.decoder_sparse_step, mlp_only_layers=tuple(config.mlp_only_layers))


def _pair(norm_topk_prob: bool, seed: int = 0):
    """transformers' block with random weights, and ours loaded per expert from it (as from a checkpoint)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextSparseMoeBlock

    config = _hf_config(norm_topk_prob=norm_topk_prob)
    torch.manual_seed(seed)
    ref = Qwen3OmniMoeThinkerTextSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    ours = SparseMoeBlock(_spec(config), per_expert=True)
    inter = config.moe_intermediate_size
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_proj.weight.copy_(ref.experts.gate_up_proj[e, :inter])
            expert.up_proj.weight.copy_(ref.experts.gate_up_proj[e, inter:])
            expert.down_proj.weight.copy_(ref.experts.down_proj[e])
    ours.fuse()
    return ref, ours.requires_grad_(False)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_block_matches_transformers(norm_topk_prob, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    ref, ours = _pair(norm_topk_prob)
    ours.experts.backend = backend
    x = torch.randn(1, 11, 32, generator=torch.Generator().manual_seed(3))
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # else the interpreter
    with torch.no_grad():
        want = ref(x)[0]
        got = ours.to(device)(x[0].to(device)).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_routing_weights_follow_norm_topk_prob():
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    for norm in (True, False):
        _, ours = _pair(norm)
        ids, w = ours.route(x)
        assert ids.shape == w.shape == (5, 2)
        sums = w.sum(-1)
        assert torch.allclose(sums, torch.ones(5)) == norm   # without renormalisation the top-2 sum is < 1


@pytest.mark.parametrize("overrides", [dict(), dict(mlp_only_layers=[0, 2]), dict(decoder_sparse_step=2),
                                       dict(decoder_sparse_step=2, mlp_only_layers=[1])])
def test_sparse_layers_follow_transformers(overrides):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerTextDecoderLayer, Qwen3OmniMoeThinkerTextSparseMoeBlock)

    config = _hf_config(**overrides)
    spec = _spec(config)
    with torch.device("meta"):
        ours = MoeForCausalLM(spec)
        theirs = [Qwen3OmniMoeThinkerTextDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
    want = [isinstance(layer.mlp, Qwen3OmniMoeThinkerTextSparseMoeBlock) for layer in theirs]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == want
    assert [spec.is_sparse(i) for i in range(config.num_hidden_layers)] == want
    dense = [layer.mlp for layer in ours.model.layers if not isinstance(layer.mlp, SparseMoeBlock)]
    assert all(m.gate_proj.weight.shape == (config.intermediate_size, config.hidden_size) for m in dense)


def test_spec_is_a_decoder_spec_and_unknown_backend_is_refused():
    spec = _spec(_hf_config())
    assert isinstance(spec, DecoderSpec)
    with torch.device("meta"):
        net = MoeForCausalLM(spec, per_expert=False)
    with pytest.raises(ValueError, match="backend"):
        net.set_expert_backend("cublas")
    net.set_expert_backend("loop")
    assert {layer.mlp.experts.backend for layer in net.model.layers} == {"loop"}
