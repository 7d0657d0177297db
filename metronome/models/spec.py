"""DecoderSpec: the architecture facts the engine needs, read from a Hugging Face config.

One class serves the Llama family; the members differ only in a few switches:

| model_type | q/k/v bias          | o_proj bias     | q/k RMSNorm |
|------------|---------------------|-----------------|-------------|
| llama      | attention_bias      | attention_bias  | no          |
| qwen2      | yes                 | no              | no          |
| qwen3      | attention_bias      | attention_bias  | yes         |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metronome.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class DecoderSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    inv_freq: tuple[float, ...]   # RoPE inverse frequencies, head_dim // 2 of them
    rope_attention_scaling: float  # multiplies cos/sin (1.0 except for yarn-like scalings)
    eos_token_ids: tuple[int, ...]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _rope(config) -> tuple[tuple[float, ...], float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        # float32, computed as transformers does, so positions match the reference bit for bit.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return tuple(inv_freq.tolist()), 1.0
    if rope_type in ("dynamic", "longrope"):
        # Their frequencies change with the sequence length; a re-rotated cache cannot follow.
        raise ModelLoadError(f"RoPE scaling {rope_type!r} is not supported (positions must be static)")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return tuple(inv_freq.float().tolist()), float(scaling)


def spec_from_hf_config(config) -> DecoderSpec:
    """Translate a transformers ``PretrainedConfig`` of the Llama family."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = {"llama": attention_bias, "qwen2": True, "qwen3": attention_bias}[model_type]
    o_bias = {"llama": attention_bias, "qwen2": False, "qwen3": attention_bias}[model_type]
    eos = getattr(config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    inv_freq, scaling = _rope(config)
    return DecoderSpec(
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        rms_norm_eps=float(config.rms_norm_eps),
        max_position_embeddings=int(config.max_position_embeddings),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        inv_freq=inv_freq,
        rope_attention_scaling=scaling,
        eos_token_ids=eos_ids,
    )
