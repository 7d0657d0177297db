"""Moshi's temporal transformer (the 7B "Helium" decoder of Kyutai's Moshi) over the paged KV cache.

Per 80 ms frame Moshi advances ONE position: its input embedding is the sum of the text token's
embedding and 16 audio-codebook embeddings (Moshi's own 8 codebooks and the user's 8, delayed; the
audio adapter, ``metronome/audio/omni/moshi.py``, builds that sum). The last position's final-normed
hidden state feeds the text head and the depth transformer, both run by the adapter. Only this
decoder's KV lives in the engine, under SinkWindow (Moshi's native context is a ring of 3000 steps
with no sinks; RoPE depends only on relative positions, so the engine's rebased positions are exact).

The layer structure follows transformers' ``MoshiForCausalLM`` (``modeling_moshi.py``), which differs
from Llama in three places, each a class here:

- ``MoshiRMSNorm``: x · rsqrt(mean(x²) + eps) · weight, all in float32 (the weight is applied before
  casting back, unlike Llama's norm), with eps = 1e-8;
- ``GatingMLP``: one ``fc1`` to 2·F, split in halves, silu(first) · second, ``fc2`` back (Llama has
  separate gate/up projections);
- the text embedding has ``vocab_size + 1`` rows (the extra row is the "initial" text token that opens
  a stream), while the text head has ``vocab_size`` outputs.

Attention is Llama's (``metronome.models.llama.Attention``: no biases, no q/k norm, standard RoPE with
``rope_theta``), so the fused projections and the Triton RoPE path apply unchanged.

Stored weight names (transformers' ``MoshiForConditionalGeneration.save_pretrained``)::

    decoder.model.embed_tokens.weight                  -> model.embed_tokens.weight
    decoder.model.layers.N.self_attn.{q,k,v,o}_proj.linear.weight -> model.layers.N.self_attn.{q,k,v,o}_proj.weight
    decoder.model.layers.N.mlp.fc{1,2}.weight           -> model.layers.N.mlp.fc{1,2}.weight
    decoder.model.layers.N.{input,post_attention}_layernorm.weight, decoder.model.norm.weight -> model.*
    decoder.lm_head.weight                              -> lm_head.weight
    embed_tokens.{0..15}.weight, depth_decoder.*, audio_encoder.*  -> skipped here (the adapter loads them)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from metronome.errors import ModelLoadError
from metronome.models.llama import Attention, AttentionBackend, RopeInputs
from metronome.models.rope import Rotary
from metronome.models.spec import DecoderSpec

# What the adapter loads (audio embeddings, depth transformer, Mimi); the decoder skips them.
ADAPTER_PREFIXES = ("embed_tokens.", "depth_decoder.", "audio_encoder.")
DECODER_PREFIX = "decoder."


class MoshiRMSNorm(nn.Module):
    """transformers' ``MoshiRMSNorm``: normalise and scale in float32, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class GatingMLP(nn.Module):
    """``fc1`` to 2·F, silu(first half) · second half, ``fc2`` back (transformers' ``MoshiGatingMLP``)."""

    def __init__(self, hidden_size: int, ffn_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_dim, bias=False)
        self.fc2 = nn.Linear(ffn_dim // 2, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate).mul_(up))


class MoshiDecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = GatingMLP(spec.hidden_size, 2 * spec.intermediate_size)
        self.input_layernorm = MoshiRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = MoshiRMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, rope: RopeInputs, kv, attention: AttentionBackend, plan: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, attention, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoshiModel(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size + 1, spec.hidden_size)  # + the initial text token
        self.layers = nn.ModuleList(MoshiDecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = MoshiRMSNorm(spec.hidden_size, spec.rms_norm_eps)


class MoshiTemporalForCausalLM(nn.Module):
    """The engine's decoder interface (see ``LlamaFamilyForCausalLM``) for Moshi's temporal transformer.

    ``forward`` returns final-normed hidden states [T, hidden]; ``compute_logits`` is the text head.
    ``embed`` accepts ids up to ``vocab_size`` inclusive (the initial text token).
    """

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = MoshiModel(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary: Rotary | None = None

    def fuse_projections(self) -> None:
        """Call once after loading: q/k/v become one projection (names mirror transformers' until then)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()

    def init_rotary(self, device: torch.device | str) -> None:
        self.rotary = Rotary(self.spec.inv_freq, self.spec.rope_attention_scaling, device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attention: AttentionBackend,
                plan: Any) -> torch.Tensor:
        rope = RopeInputs.at(positions, self.rotary)
        x = inputs_embeds
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, rope, kv, attention, plan)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight)


def hf_config(config: dict):
    """transformers' ``MoshiConfig`` of a ``config.json`` (clear error if it is not a valid one)."""
    from transformers import MoshiConfig

    if config.get("model_type") != "moshi":
        raise ModelLoadError(f"model_type {config.get('model_type')!r} is not 'moshi'")
    try:
        return MoshiConfig.from_dict(dict(config))
    except Exception as exc:  # noqa: BLE001 - strict config validators raise their own error types
        raise ModelLoadError(f"invalid moshi config.json: {exc}") from exc


def decoder_spec(config) -> DecoderSpec:
    """The temporal transformer's DecoderSpec from a transformers ``MoshiConfig``."""
    params = dict(config.rope_parameters or {})
    if params.get("rope_type", "default") != "default":
        raise ModelLoadError(f"moshi with RoPE type {params.get('rope_type')!r} is not supported (only default)")
    if config.hidden_act != "silu":
        raise ModelLoadError(f"moshi hidden_act {config.hidden_act!r} is not supported (only silu)")
    if config.ffn_dim % 2:
        raise ModelLoadError(f"moshi ffn_dim must be even, got {config.ffn_dim}")
    head_dim = config.head_dim
    theta = float(params.get("rope_theta", 10000.0))
    # float32 and computed as transformers' MoshiRotaryEmbedding does, so angles match bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return DecoderSpec(
        model_type="moshi", vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_dim // 2, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
        rms_norm_eps=float(config.rms_norm_eps), max_position_embeddings=int(config.max_position_embeddings),
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, tie_word_embeddings=False,
        inv_freq=tuple(inv_freq.tolist()), rope_attention_scaling=1.0, eos_token_ids=eos_ids)


def rename(stored: str) -> str | None:
    """Checkpoint name → decoder parameter name; None for what the adapter loads.

    Anything unknown is returned unchanged so that ``fill_weights`` reports it as unexpected.
    """
    if stored.startswith(ADAPTER_PREFIXES):
        return None
    if stored.startswith(DECODER_PREFIX):
        return stored[len(DECODER_PREFIX):].replace("_proj.linear.", "_proj.")
    return stored


def build_decoder(spec: DecoderSpec, dtype: torch.dtype, device: str | torch.device) -> MoshiTemporalForCausalLM:
    """An empty (uninitialised) decoder of ``spec``; fill it, then ``finish_decoder``."""
    with torch.device("meta"):
        net = MoshiTemporalForCausalLM(spec)
    return net.to_empty(device=device).to(dtype)


def finish_decoder(net: MoshiTemporalForCausalLM, device: str | torch.device) -> MoshiTemporalForCausalLM:
    net.fuse_projections()
    net.init_rotary(device)
    return net.eval().requires_grad_(False)


def load_decoder(checkpoint: Path, config: dict, dtype: torch.dtype,
                 device: str | torch.device) -> MoshiTemporalForCausalLM:
    """The temporal transformer of a transformers-format Moshi checkpoint directory, ready for the engine."""
    from metronome.models.weights import fill_weights

    net = build_decoder(decoder_spec(hf_config(config)), dtype, device)
    fill_weights(net, Path(checkpoint), rename)
    return finish_decoder(net, device)
