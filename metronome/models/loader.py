"""Load a Llama-family decoder from a Hugging Face checkpoint directory (safetensors, sharded too)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from metronome.errors import ModelLoadError
from metronome.models.embedded import resolve_checkpoint
from metronome.models.llama import LlamaFamilyForCausalLM
from metronome.models.spec import DecoderSpec, spec_from_hf_config

log = logging.getLogger(__name__)

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def load_model(model: str, dtype: torch.dtype, device: str | torch.device) -> tuple[LlamaFamilyForCausalLM, Path]:
    """Build the decoder on ``device`` in ``dtype`` and fill it from the checkpoint; every weight must be found."""
    checkpoint = resolve_checkpoint(model)
    spec = load_spec(checkpoint)
    with torch.device("meta"):
        net = LlamaFamilyForCausalLM(spec)
    net = net.to_empty(device=device).to(dtype)
    params = dict(net.named_parameters())
    missing = set(params)
    for file in _weight_files(checkpoint):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and spec.tie_word_embeddings:
                    continue
                if name not in params:
                    raise ModelLoadError(f"{file.name}: unexpected weight {name!r} for a {spec.model_type} decoder")
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ModelLoadError(
                        f"{file.name}: {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
                with torch.no_grad():
                    params[name].copy_(tensor)
                missing.discard(name)
    if missing:
        raise ModelLoadError(f"{checkpoint}: weights missing from the checkpoint: {sorted(missing)[:5]}")
    net.fuse_projections()
    net.init_rotary(device)
    net.eval().requires_grad_(False)
    log.info("loaded %s (%s, %d layers) on %s as %s", checkpoint, spec.model_type, spec.num_layers, device, dtype)
    return net, checkpoint


def load_tokenizer(checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)
