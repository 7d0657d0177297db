"""MiniCPM-o 4.5's language model: a Qwen3 decoder (Qwen3-8B) inside the ``minicpmo`` checkpoint.

The published model (OpenBMB, ``modeling_minicpmo.py``, class ``MiniCPMO``) wraps a transformers
``Qwen3ForCausalLM`` as ``self.llm``, next to a SigLIP vision tower (``vpm``) and its ``resampler``,
a Whisper-medium audio encoder (``apm``) with ``audio_projection_layer`` (pooling has no weights), and
a TTS head (``tts``). Its config class ``MiniCPMOConfig`` *subclasses* ``Qwen3Config``: the LLM's
fields are top-level keys of ``config.json`` (``hidden_size``, ``num_hidden_layers``, ``head_dim``,
``rope_theta``, ...); the towers' configs are nested (``audio_config``, ``vision_config``,
``tts_config``). transformers has no ``minicpmo`` type (it is remote code), so the Qwen3 fields are
read from the raw ``config.json`` here.

Stored weight names and what the decoder does with them::

    llm.model.embed_tokens.weight, llm.model.layers.N.*, llm.model.norm.weight  -> model.*
    llm.lm_head.weight                                                         -> lm_head.weight
    apm.*, audio_projection_layer.*, vpm.*, resampler.*, tts.*                 -> skipped here
                                         (the audio adapter loads apm.* and audio_projection_layer.*)

Positions are plain 1-D RoPE: the published forward passes ``position_ids=None`` (the cache length
onwards) for text and audio alike, so the engine's positions are exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from metronome.errors import ModelLoadError
from metronome.models.llama import LlamaFamilyForCausalLM
from metronome.models.spec import DecoderSpec, spec_from_hf_config

# Components of the checkpoint that are not the LLM (vision, audio, speech output).
SKIPPED_PREFIXES = ("apm.", "audio_projection_layer.", "audio_avg_pooler.", "vpm.", "resampler.", "tts.")
LLM_PREFIX = "llm."

# Top-level config.json keys that describe the Qwen3 LLM (MiniCPMOConfig inherits them from Qwen3Config).
_QWEN3_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
               "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "tie_word_embeddings",
               "eos_token_id", "bos_token_id", "pad_token_id")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def decoder_spec(config: dict) -> DecoderSpec:
    """The Qwen3 decoder described by a ``minicpmo`` ``config.json`` (its top-level fields)."""
    from transformers import Qwen3Config

    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise ModelLoadError(f"minicpmo config.json lacks the LLM fields {missing} (MiniCPMOConfig is a Qwen3Config)")
    if config.get("use_sliding_window"):
        raise ModelLoadError("minicpmo with use_sliding_window=true is not supported (Qwen3-8B uses full attention)")
    fields = {k: config[k] for k in _QWEN3_KEYS if k in config and config[k] is not None}
    try:
        qwen3 = Qwen3Config(**fields)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"minicpmo config.json: invalid Qwen3 fields: {exc}") from exc
    return spec_from_hf_config(qwen3)


def rename(stored: str) -> str | None:
    """Checkpoint name → decoder parameter name; None for the other towers' tensors.

    A name under none of the published prefixes is refused: it means the directory is not (only) a
    MiniCPM-o checkpoint, and copying it into a same-named decoder parameter would hide that.
    """
    if stored.startswith(SKIPPED_PREFIXES):
        return None
    if stored.startswith(LLM_PREFIX):
        return stored[len(LLM_PREFIX):]
    raise ModelLoadError(f"unexpected weight {stored!r} in a minicpmo checkpoint (expected llm.* or one of "
                         f"{', '.join(p.rstrip('.') + '.*' for p in SKIPPED_PREFIXES)})")


def load_decoder(checkpoint: Path, config: dict, dtype: torch.dtype,
                 device: str | torch.device) -> LlamaFamilyForCausalLM:
    """The LLM of a MiniCPM-o checkpoint directory, ready for the engine."""
    from metronome.models.weights import load_llama_family

    if config.get("model_type") != "minicpmo":
        raise ModelLoadError(f"{checkpoint}: model_type {config.get('model_type')!r} is not 'minicpmo'")
    return load_llama_family(checkpoint, decoder_spec(config), dtype, device, rename)
