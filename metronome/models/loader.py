"""Load a decoder from a Hugging Face checkpoint directory (safetensors, sharded too).

The checkpoint's ``config.json`` ``model_type`` picks the family. The Llama family (llama, qwen2,
qwen3) loads here; an interaction model's decoder loads through its record in ``models/omni/registry.py``
(``load_decoder(checkpoint, config, dtype, device)``, where ``config`` is the raw ``config.json``).
Either way the decoder has the interface the engine drives (``spec``, ``embed``, ``forward``,
``compute_logits``, ``rotary``; see ``LlamaFamilyForCausalLM``). The weight-loading functions every family shares
are in ``models/weights.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from metronome.errors import ModelLoadError
from metronome.models.embedded import resolve_checkpoint
from metronome.models.omni.registry import omni_model, omni_model_types, resolve
from metronome.models.spec import SUPPORTED_MODEL_TYPES, DecoderSpec, spec_from_hf_config
from metronome.models.weights import fill_weights, load_llama_family, read_config

__all__ = ["fill_weights", "load_model", "load_spec", "load_tokenizer", "read_config", "resolve_checkpoint"]

log = logging.getLogger(__name__)


def load_spec(checkpoint: Path) -> DecoderSpec:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(checkpoint)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {checkpoint / 'config.json'}: {exc}") from exc
    return spec_from_hf_config(config)


def load_model(model: str, dtype: torch.dtype, device: str | torch.device) -> tuple[nn.Module, Path]:
    """Build the decoder on ``device`` in ``dtype`` and fill it from the checkpoint; every weight must be found."""
    checkpoint = resolve_checkpoint(model)
    config = read_config(checkpoint)
    model_type = config.get("model_type")
    if (omni := omni_model(model_type)) is not None:
        net = resolve(omni.decoder)(checkpoint, config, dtype, device)
    elif model_type in SUPPORTED_MODEL_TYPES:
        net = load_llama_family(checkpoint, load_spec(checkpoint), dtype, device)
    else:
        supported = ", ".join((*SUPPORTED_MODEL_TYPES, *omni_model_types()))
        raise ModelLoadError(f"model_type {model_type!r} is not supported; supported: {supported}")
    log.info("loaded %s (%s, %d layers) on %s as %s", checkpoint, net.spec.model_type, net.spec.num_layers, device, dtype)
    return net, checkpoint


def load_tokenizer(checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)
