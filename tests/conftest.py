"""Shared fixtures: tiny random checkpoints written with transformers' own classes (the oracle)."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on the CPU through the interpreter (set before anything imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6)


def tiny_config(family: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kwargs = {**TINY, **overrides}
    if family == "llama":
        return LlamaConfig(**kwargs, tie_word_embeddings=False)
    if family == "llama-tied":
        return LlamaConfig(**kwargs, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**kwargs, tie_word_embeddings=False, use_sliding_window=False)
    if family == "qwen3":
        return Qwen3Config(**kwargs, head_dim=32, tie_word_embeddings=False, use_sliding_window=False)
    raise ValueError(family)


def make_checkpoint(path, family: str, seed: int = 0, **overrides):
    """Save a random model of ``family``; returns the transformers model (the reference) in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():  # random biases/norm weights so those code paths matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(path)
    return model


FAMILIES = ("llama", "llama-tied", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> (checkpoint dir, transformers reference model)."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        out[family] = (str(path), make_checkpoint(path, family))
    return out


@pytest.fixture(scope="session")
def llama(checkpoints):
    return checkpoints["llama"]


# vocab_size matches the SmolLM2 tokenizer, so every id it produces is a valid input to the tiny model.
CHAT_VOCAB = 49152


def save_smollm2_tokenizer(path) -> None:
    from transformers import AutoTokenizer

    from metronome.models.embedded import embedded_checkpoint

    AutoTokenizer.from_pretrained(embedded_checkpoint("smollm2-135m")).save_pretrained(path)


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory) -> str:
    """A checkpoint dir: random tiny Llama (2 layers, hidden 64) + the packaged SmolLM2 tokenizer.

    Loads in about a second; the first use on a machine converts the packaged SmolLM2 once (~40 s, cached).
    """
    path = tmp_path_factory.mktemp("chat-llama")
    make_checkpoint(path, "llama", vocab_size=CHAT_VOCAB, max_position_embeddings=2048)
    save_smollm2_tokenizer(path)
    return str(path)


@pytest.fixture(autouse=True, scope="session")
def float32_unless_asked():
    """``EngineConfig(dtype="auto")`` is float32 in tests whatever the CPU (on one with native bf16 it would be
    bfloat16): the oracles compare in float32. Tests of the choice itself fake the capability they need."""
    import metronome.config
    from metronome.cpu import CpuCapability, auto_dtype

    no_bf16 = CpuCapability("a CPU without native bf16", frozenset({"avx2"}), cores=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metronome.config, "auto_dtype", lambda device, capability=None: auto_dtype(device, no_bf16))
        yield


def instruction_sets() -> list[tuple[str, tuple[str, ...]]]:
    """Builds of the C kernels that this CPU runs, as (name, compiler flags): its own, and narrower instruction sets
    where it has the wider one, so that one machine takes every branch the kernels take on others (E4M3 widened by
    table lookups, through float16 with and without AVX512-BF16, AVX2 with F16C, plain x86-64)."""
    import platform

    from metronome.cpu import read_capability

    flags = read_capability().flags
    builds = [("native", ())]
    if "avx512vbmi" in flags:
        builds.append(("no-vbmi", ("-mno-avx512vbmi",)))
    if "avx512_bf16" in flags:
        builds.append(("no-bf16", ("-mno-avx512bf16", "-mno-avx512vbmi")))
    if "avx512f" in flags and {"avx2", "fma", "f16c"} <= flags:
        builds.append(("x86-64-v3", ("-march=x86-64-v3",)))
    if platform.machine() == "x86_64" and "avx" in flags:
        builds.append(("x86-64", ("-march=x86-64",)))
    return builds


@pytest.fixture(scope="session", params=instruction_sets(), ids=lambda build: build[0])
def cpu_library(request, tmp_path_factory):
    """Metronome's C kernels for each of ``instruction_sets()`` (skipped without a C compiler)."""
    from metronome.native import find_compiler, load_library

    if find_compiler() is None:
        pytest.skip("no C compiler to build the kernels with")
    name, target = request.param
    return load_library(tmp_path_factory.mktemp(f"kernels-{name}"), target)
