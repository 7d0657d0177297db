"""Filling a decoder built on the meta device from a Hugging Face checkpoint directory (safetensors, sharded too).

Every family's loader uses these (``models.loader`` for the Llama family, ``models/omni/*`` for the
interaction models, the omni audio adapters for their encoders); this module imports no family, so
none of them forms a cycle through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from metronome.errors import ModelLoadError
from metronome.models.fp8 import E4M3, Fp8Checkpoint, per_channel_for_tensor_cores_
from metronome.models.llama import LlamaFamilyForCausalLM
from metronome.models.spec import DecoderSpec

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(checkpoint: Path) -> dict:
    """The raw ``config.json`` (read without transformers, so families it lacks still dispatch)."""
    path = checkpoint / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def weight_files(checkpoint: Path) -> list[Path]:
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{checkpoint} holds no *.safetensors weights")
    return files


def fill_weights(net: nn.Module, checkpoint: Path, rename: Callable[[str], str | None] = lambda name: name) -> None:
    """Copy every checkpoint tensor into ``net``'s parameter of the renamed name; all must be found.

    ``rename`` maps a checkpoint name to the module's name, or to ``None`` for tensors this module
    does not hold (an omni checkpoint's audio tower or talker when only the decoder loads here).
    An FP8 checkpoint's E4M3 weights come with their scales (``models/fp8.py``: ``Fp8Checkpoint.install``).
    """
    params = dict(net.named_parameters())
    missing = set(params)
    files = weight_files(checkpoint)
    fp8 = Fp8Checkpoint.read(read_config(checkpoint), files) if (checkpoint / "config.json").exists() else None
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                if stored.endswith(_IGNORED_SUFFIXES) or (fp8 is not None and fp8.is_extra(stored)):
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
                if tensor.dtype == E4M3 and fp8 is not None:
                    fp8.install(net, name, stored, tensor)
                else:
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
    per_channel_for_tensor_cores_(net)
    net.init_rotary(device)
    return net.eval().requires_grad_(False)


def load_llama_family(checkpoint: Path, spec: DecoderSpec, dtype: torch.dtype, device: str | torch.device,
                      rename: Callable[[str], str | None] = lambda name: name) -> LlamaFamilyForCausalLM:
    """A Llama-family decoder of ``spec`` filled from ``checkpoint`` (``rename`` as in ``fill_weights``)."""
    with torch.device("meta"):
        net = LlamaFamilyForCausalLM(spec)
    return load_decoder_weights(net, checkpoint, dtype, device, rename)
