"""Qwen2.5-Omni's thinker decoder: a Qwen2 decoder, loaded from an omni checkpoint.

The thinker's language model is architecturally Qwen2 (q/k/v bias, no o bias, SiLU MLP, RMSNorm);
only its rotary positions are multimodal (TMRoPE: three position components, temporal / height /
width, over ``mrope_section`` slices of the rotary frequencies). With audio and text only, the three
components are equal and consecutive (``get_rope_index`` gives text and audio tokens ``arange``
positions in all three rows; tests/models/omni checks it against transformers), and three equal
components make TMRoPE exactly 1-D RoPE over the default frequencies. So the engine's own
positions (absolute or rebased) drive this decoder unchanged.

Checkpoints, as transformers saves them (names checked against ``save_pretrained`` of tiny models):

* ``Qwen2_5OmniForConditionalGeneration`` (model_type ``qwen2_5_omni``): ``thinker.model.*``,
  ``thinker.lm_head.*``, ``thinker.audio_tower.*``, ``thinker.visual.*``, ``talker.*``, ``token2wav.*``;
  the architecture is in ``config.json``'s ``thinker_config.text_config``.
* ``Qwen2_5OmniThinkerForConditionalGeneration`` (model_type ``qwen2_5_omni_thinker``): the same
  without the ``thinker.`` prefix; the architecture is in ``text_config``.

Only the decoder loads here (the audio tower is the adapter's, ``audio/omni/qwen2_5_omni.py``).
``lm_head`` is tied to the embeddings only when the thinker config says so (as transformers does).
"""

from __future__ import annotations

from pathlib import Path

import torch

from metronome.errors import ModelLoadError
from metronome.models.llama import LlamaFamilyForCausalLM
from metronome.models.weights import load_llama_family
from metronome.models.omni.qwen_thinker import ThinkerLayout
from metronome.models.spec import DecoderSpec

LAYOUT = ThinkerLayout("qwen2_5_omni", "Qwen2.5-Omni", speech_parts=("talker.", "token2wav."))
thinker_config = LAYOUT.thinker_config
rename = LAYOUT.decoder_name   # stored tensor name -> decoder parameter name (None: not the decoder)


def text_spec(config: dict) -> DecoderSpec:
    """The thinker decoder's DecoderSpec from the raw ``config.json`` (full or thinker-only)."""
    from transformers import Qwen2_5OmniTextConfig

    thinker = thinker_config(config)
    raw = thinker.get("text_config")
    if not isinstance(raw, dict):
        raise ModelLoadError("the thinker config has no text_config")
    try:
        text = Qwen2_5OmniTextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the thinker's text_config: {exc}") from exc
    if getattr(text, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {text.hidden_act!r} is not supported (only silu)")
    if any(t != "full_attention" for t in text.layer_types):
        raise ModelLoadError("sliding-window layers (use_sliding_window) are not supported; the KV policy bounds state")
    params = dict(text.rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ModelLoadError(f"RoPE type {rope_type!r} is not supported for Qwen2.5-Omni (default TMRoPE only)")
    theta = float(params.get("rope_theta", 1_000_000.0))
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    # float32, as transformers' Qwen2_5OmniRotaryEmbedding computes them.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    eos = text.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return DecoderSpec(
        model_type="qwen2", vocab_size=text.vocab_size, hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size, num_layers=text.num_hidden_layers,
        num_heads=text.num_attention_heads, num_kv_heads=text.num_key_value_heads or text.num_attention_heads,
        head_dim=head_dim, rms_norm_eps=float(text.rms_norm_eps),
        max_position_embeddings=int(text.max_position_embeddings), qkv_bias=True, o_bias=False, mlp_bias=False,
        qk_norm=False, tie_word_embeddings=bool(thinker.get("tie_word_embeddings", False)),
        inv_freq=tuple(inv_freq.tolist()), rope_attention_scaling=1.0, eos_token_ids=eos_ids)


def load_decoder(checkpoint: Path, config: dict, dtype: torch.dtype,
                 device: str | torch.device) -> LlamaFamilyForCausalLM:
    """The thinker's decoder on ``device`` in ``dtype``; every decoder weight must be in the checkpoint."""
    return load_llama_family(Path(checkpoint), text_spec(config), dtype, device, rename)
