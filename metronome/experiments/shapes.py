"""Decoders in real shapes with random weights, for the GPU presets (nothing downloaded, nothing carried).

A tick's cost depends on the decoder's shape, not on its weights' values, so the latency experiments
(cliff, fill model, admission) run a Qwen2.5-7B-shaped decoder whose weights are drawn on the GPU at
start (``random_weights.py``): the scale of the paper's 7B omni model, which the packaged
SmolLM2-135M is far below (on an H200 its tick stays a few per cent of B at any N the pool holds).
The checkpoint directory holds only ``config.json`` and the packaged SmolLM2 tokenizer (the energy
adapter needs digit tokens and a chat template); sampled ids past the tokenizer's 49,152 decode to "".

    >>> d = make_shape_checkpoint("/tmp/q7", "qwen2.5-7b")            # doctest: +SKIP
    >>> json.load(open(f"{d}/config.json"))["num_hidden_layers"]       # doctest: +SKIP
    28

A preset names one as ``"random:qwen2.5-7b"``; ``sweep.prepare_model`` makes the directory and the
server builds the decoder with random weights instead of loading it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

RANDOM_PREFIX = "random:"
TOKENIZER_ENV = "METRONOME_TOKENIZER_DIR"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

# config.json fields of the shapes the GPU benchmarks time (bench/engine_gpu.py reads them too).
SHAPES = {
    # Qwen2.5-7B-Instruct, the fields the engine reads.
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       hidden_act="silu"),
    # SmolLM2-135M's matrices; RoPE base, position limit and untied head as the 7B shape's (timing only).
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rope_theta=1000000.0,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         hidden_act="silu", eos_token_id=None),
}


def shape_config(shape: str):
    """The shape's transformers config (no file written)."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    fields = dict(SHAPES[shape])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def is_random(model: str) -> bool:
    return model.startswith(RANDOM_PREFIX)


def tokenizer_source() -> Path:
    """``$METRONOME_TOKENIZER_DIR`` (a machine without the packaged model, like the GPU box) or the packaged
    SmolLM2 checkpoint."""
    if os.environ.get(TOKENIZER_ENV):
        return Path(os.environ[TOKENIZER_ENV])
    from metronome.models.embedded import embedded_checkpoint

    return embedded_checkpoint("smollm2-135m")


def make_shape_checkpoint(path: str | Path, shape: str) -> str:
    """A checkpoint directory with the shape's config and the SmolLM2 tokenizer, no weights."""
    config = shape_config(shape)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    source = tokenizer_source()
    found = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in found:
        raise FileNotFoundError(f"no tokenizer.json in {source} (set ${TOKENIZER_ENV} to a directory holding one)")
    for name in found:
        shutil.copy(source / name, path / name)
    return str(path)


def random_engine(engine_cfg, checkpoint: str):
    """An ``Engine`` over a random-weight decoder in the checkpoint's shape (built on the engine's device)."""
    import torch

    from metronome.engine.engine import DTYPES, Engine
    from metronome.models.llama import LlamaFamilyForCausalLM
    from metronome.models.loader import load_spec

    from metronome.experiments.random_weights import random_decoder

    net = random_decoder(LlamaFamilyForCausalLM, load_spec(Path(checkpoint)), torch.device(engine_cfg.device),
                         DTYPES[engine_cfg.dtype], seed=engine_cfg.seed)
    return Engine(engine_cfg, model=net, checkpoint=Path(checkpoint))
