"""Load a decoder from a Hugging Face checkpoint directory (safetensors, sharded too).

The checkpoint's ``config.json`` ``model_type`` picks the family. The Llama family (llama, qwen2,
qwen3) loads here; the interaction models' decoders (``OMNI_FAMILIES``) live in their own modules,
imported only when such a checkpoint is opened. Each such module defines::

    def load_decoder(checkpoint: Path, config: dict, dtype, device) -> decoder

where ``config`` is the raw ``config.json`` and the decoder has the interface the engine drives
(``spec``, ``embed``, ``forward``, ``compute_logits``, ``rotary``; see ``LlamaFamilyForCausalLM``).
``fill_weights`` below copies a checkpoint into such a module, renaming as the family needs.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from metronome.errors import ModelLoadError
from metronome.models.embedded import resolve_checkpoint
from metronome.models.llama import LlamaFamilyForCausalLM
from metronome.models.spec import SUPPORTED_MODEL_TYPES, DecoderSpec, spec_from_hf_config

log = logging.getLogger(__name__)

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# model_type -> module defining load_decoder(checkpoint, config, dtype, device).
OMNI_FAMILIES = {
    "qwen2_5_omni": "metronome.models.omni.qwen2_5_omni",
    "qwen2_5_omni_thinker": "metronome.models.omni.qwen2_5_omni",
    "qwen3_omni_moe": "metronome.models.omni.qwen3_omni",
    "qwen3_omni_moe_thinker": "metronome.models.omni.qwen3_omni",
    "minicpmo": "metronome.models.omni.minicpm_o",
    "moshi": "metronome.models.omni.moshi",
}


def read_config(checkpoint: Path) -> dict:
    """The raw ``config.json`` (read without transformers, so families it lacks still dispatch)."""
    path = checkpoint / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def load_spec(checkpoint: Path) -> DecoderSpec:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(checkpoint)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {checkpoint / 'config.json'}: {exc}") from exc
    return spec_from_hf_config(config)


def _weight_files(checkpoint: Path) -> list[Path]:
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{checkpoint} holds no *.safetensors weights")
    return files


def fill_weights(net: nn.Module, checkpoint: Path, rename: Callable[[str], str | None] = lambda name: name) -> None:
    """Copy every checkpoint tensor into ``net``'s parameter of the renamed name; all must be found.

    ``rename`` maps a checkpoint name to the module's name, or to ``None`` for tensors this module
    does not hold (an omni checkpoint's audio tower or talker when only the decoder loads here).
    """
    params = dict(net.named_parameters())
    missing = set(params)
    for file in _weight_files(checkpoint):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                if stored.endswith(_IGNORED_SUFFIXES):
                    continue
                name = rename(stored)
                if name is None:
                    continue
                if name not in params:
                    raise ModelLoadError(f"{file.name}: unexpected weight {stored!r} for {type(net).__name__}")
                tensor = f.get_tensor(stored)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ModelLoadError(
                        f"{file.name}: {stored} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
                with torch.no_grad():
                    params[name].copy_(tensor)
                missing.discard(name)
    if missing:
        raise ModelLoadError(f"{checkpoint}: weights missing from the checkpoint: {sorted(missing)[:5]}")


def load_decoder_weights(net: nn.Module, checkpoint: Path, dtype: torch.dtype, device: str | torch.device,
                         rename: Callable[[str], str | None] = lambda name: name) -> nn.Module:
    """Materialise ``net`` (built on the meta device) on ``device`` in ``dtype``, fill it from ``checkpoint``
    (``rename`` as in ``fill_weights``; a tied ``lm_head`` is skipped), fuse its projections and build its
    rotary tables: a decoder ready for the engine."""
    spec = net.spec
    net = net.to_empty(device=device).to(dtype)

    def tied_aware(stored: str) -> str | None:
        name = rename(stored)
        return None if name == "lm_head.weight" and spec.tie_word_embeddings else name

    fill_weights(net, checkpoint, tied_aware)
    net.fuse_projections()
    net.init_rotary(device)
    return net.eval().requires_grad_(False)


def load_llama_family(checkpoint: Path, spec: DecoderSpec, dtype: torch.dtype, device: str | torch.device,
                      rename: Callable[[str], str | None] = lambda name: name) -> LlamaFamilyForCausalLM:
    """A Llama-family decoder of ``spec`` filled from ``checkpoint`` (``rename`` as in ``fill_weights``)."""
    with torch.device("meta"):
        net = LlamaFamilyForCausalLM(spec)
    return load_decoder_weights(net, checkpoint, dtype, device, rename)


def load_model(model: str, dtype: torch.dtype, device: str | torch.device) -> tuple[nn.Module, Path]:
    """Build the decoder on ``device`` in ``dtype`` and fill it from the checkpoint; every weight must be found."""
    checkpoint = resolve_checkpoint(model)
    model_type = read_config(checkpoint).get("model_type")
    if model_type in OMNI_FAMILIES:
        module = importlib.import_module(OMNI_FAMILIES[model_type])
        net = module.load_decoder(checkpoint, read_config(checkpoint), dtype, device)
    elif model_type in SUPPORTED_MODEL_TYPES:
        net = load_llama_family(checkpoint, load_spec(checkpoint), dtype, device)
    else:
        supported = ", ".join((*SUPPORTED_MODEL_TYPES, *OMNI_FAMILIES))
        raise ModelLoadError(f"model_type {model_type!r} is not supported; supported: {supported}")
    log.info("loaded %s (%s, %d layers) on %s as %s", checkpoint, net.spec.model_type, net.spec.num_layers, device, dtype)
    return net, checkpoint


def load_tokenizer(checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)
