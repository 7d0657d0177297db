"""Qwen3-Omni's thinker decoder: a Qwen3 MoE decoder, loaded from an omni checkpoint.

The thinker's language model is Qwen3 attention (q/k RMSNorm, no biases unless ``attention_bias``)
with a sparse MoE MLP (``models/moe.py``: 128 experts, 8 active, ``norm_topk_prob``; dense MLP layers
where ``mlp_only_layers`` / ``decoder_sparse_step`` say so). Its rotary positions are multimodal
(interleaved MRoPE over ``mrope_section``), but with audio and text only the three position components
are equal and consecutive (``get_rope_index``; tests/models/omni/test_qwen3_omni.py checks it against
transformers), and three equal components make interleaved MRoPE exactly 1-D RoPE over the default
frequencies: the engine's own positions (absolute or rebased) drive this decoder unchanged.

Checkpoints, as transformers saves them (names checked with ``save_pretrained`` of a tiny model):

* ``Qwen3OmniMoeForConditionalGeneration`` (model_type ``qwen3_omni_moe``): ``thinker.model.*``,
  ``thinker.lm_head.*``, ``thinker.audio_tower.*``, ``thinker.visual.*``, ``talker.*``, ``code2wav.*``;
  the architecture is in ``config.json``'s ``thinker_config.text_config``.
* A thinker-only checkpoint (model_type ``qwen3_omni_moe_thinker``) is the same without ``thinker.``.

Experts are stored one module per expert (``mlp.experts.{e}.gate_proj.weight`` ...; the published
checkpoint and transformers' ``save_pretrained`` both do) or stacked (``mlp.experts.gate_up_proj``,
transformers' in-memory layout); the loader builds whichever the checkpoint holds and stacks after.
Only the decoder loads here (the audio tower is the adapter's, ``audio/omni/qwen3_omni.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from metronome.errors import ModelLoadError
from metronome.models.weights import load_decoder_weights, weight_files
from metronome.models.moe import MoeForCausalLM, MoeSpec
from metronome.models.omni.qwen_thinker import ThinkerLayout

LAYOUT = ThinkerLayout("qwen3_omni_moe", "Qwen3-Omni", speech_parts=("talker.", "code2wav."))
thinker_config = LAYOUT.thinker_config
rename = LAYOUT.decoder_name   # stored tensor name -> decoder parameter name (None: not the decoder)

_FUSED_EXPERTS = ".mlp.experts.gate_up_proj"


def text_config(config: dict):
    """The thinker's ``Qwen3OmniMoeTextConfig`` (transformers fills the defaults the file leaves out)."""
    from transformers import Qwen3OmniMoeTextConfig

    raw = thinker_config(config).get("text_config")
    if not isinstance(raw, dict):
        raise ModelLoadError("the thinker config has no text_config")
    try:
        return Qwen3OmniMoeTextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the thinker's text_config: {exc}") from exc


def text_spec(config: dict) -> MoeSpec:
    """The thinker decoder's MoeSpec from the raw ``config.json`` (full or thinker-only)."""
    text = text_config(config)
    if getattr(text, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {text.hidden_act!r} is not supported (only silu)")
    if text.sliding_window is not None:
        raise ModelLoadError("sliding-window attention is not supported; the KV policy bounds state")
    params = dict(text.rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(f"RoPE type {rope_type!r} is not supported for Qwen3-Omni (default MRoPE only)")
    theta = float(params.get("rope_theta", 1_000_000.0))
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    # float32, as transformers' Qwen3OmniMoeThinkerTextRotaryEmbedding computes them.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    eos = text.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    bias = bool(text.attention_bias)
    return MoeSpec(
        model_type="qwen3_omni_moe", vocab_size=text.vocab_size, hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size, num_layers=text.num_hidden_layers,
        num_heads=text.num_attention_heads, num_kv_heads=text.num_key_value_heads or text.num_attention_heads,
        head_dim=head_dim, rms_norm_eps=float(text.rms_norm_eps),
        max_position_embeddings=int(text.max_position_embeddings), qkv_bias=bias, o_bias=bias, mlp_bias=False,
        qk_norm=True, tie_word_embeddings=bool(thinker_config(config).get("tie_word_embeddings", False)),
        inv_freq=tuple(inv_freq.tolist()), rope_attention_scaling=1.0, eos_token_ids=eos_ids,
        num_experts=int(text.num_experts), num_experts_per_tok=int(text.num_experts_per_tok),
        moe_intermediate_size=int(text.moe_intermediate_size), norm_topk_prob=bool(text.norm_topk_prob),
        decoder_sparse_step=int(text.decoder_sparse_step), mlp_only_layers=tuple(text.mlp_only_layers or ()))


def stores_fused_experts(checkpoint: Path) -> bool:
    """Whether the checkpoint holds stacked expert tensors (else one module per expert)."""
    for file in weight_files(checkpoint):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if any(key.endswith(_FUSED_EXPERTS) for key in f.keys()):
                return True
    return False


def load_decoder(checkpoint: Path, config: dict, dtype: torch.dtype, device: str | torch.device) -> MoeForCausalLM:
    """The thinker's decoder on ``device`` in ``dtype``; every decoder weight must be in the checkpoint."""
    checkpoint = Path(checkpoint)
    spec = text_spec(config)
    with torch.device("meta"):
        net = MoeForCausalLM(spec, per_expert=not stores_fused_experts(checkpoint))
    return load_decoder_weights(net, checkpoint, dtype, device, rename)
