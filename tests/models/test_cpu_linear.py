"""The CPU's linear products (``models/cpu_linear.py``): weights packed for oneDNN and the C kernel for few
float32 rows, each against float64, and whole sessions through an engine with each against transformers'
windowed oracle."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.errors import ConfigError
from metronome.models.cpu_linear import KERNEL_MAX_ROWS, KernelLinear, PackedLinear, pack_linears_, packable
from metronome.native import find_compiler, load_library
from tests.engine.oracle import hf_windowed_logprobs
from tests.engine.test_engine_fp8 import drive

needs_mkldnn = pytest.mark.skipif(not packable(torch.float32), reason="torch built without oneDNN")


@needs_mkldnn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (3, 5, 48), (300, 48)])
def test_packed_product_matches_float64(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(shape)
    ref = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                     None if linear.bias is None else linear.bias.double())
    out = PackedLinear(linear.weight, linear.bias)(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packable(torch.bfloat16), reason="this CPU has no bf16 instructions for oneDNN to pack")
def test_packed_bf16_product_within_bf16_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False).to(torch.bfloat16)
    x = torch.randn(9, 256, dtype=torch.bfloat16)
    ref = x.double() @ linear.weight.double().t()
    out = PackedLinear(linear.weight, linear.bias)(x).double()
    assert ((out - ref).norm() / ref.norm()).item() < 2 ** -7


@needs_mkldnn
def test_pack_replaces_every_linear_and_keeps_the_rest():
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4)))
    assert pack_linears_(block) == 2
    assert [type(m).__name__ for m in block.modules()].count("Linear") == 0
    assert isinstance(block[2][1], nn.LayerNorm)


@needs_mkldnn
def test_engine_with_packed_weights_matches_the_windowed_oracle(llama):
    path, model = llama
    engine = Engine(EngineConfig(model=path, dtype="float32", cpu_linear="packed", num_blocks=200,
                                 max_chunk_tokens=24, max_batch_tokens=64,
                                 policy=KVPolicy(sinks=3, window=13, block_size=4, positions="absolute")))
    layer = engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and isinstance(layer.mlp.down_proj, PackedLinear)
    tokens, logprobs = drive(engine, random.Random(5), 6)
    ref = hf_windowed_logprobs(model, tokens, 3, 13)
    assert max(abs(lp - ref[pos - 1, tokens[pos]].item()) for pos, lp in logprobs) < 1e-3


SMALL = dict(num_blocks=64, max_chunk_tokens=24, max_batch_tokens=64, policy=KVPolicy(sinks=3, window=13, block_size=4))


def test_aten_leaves_float32_to_aten(llama):
    engine = Engine(EngineConfig(model=llama[0], dtype="float32", cpu_linear="aten", **SMALL))
    assert type(engine.model.model.layers[0].mlp.down_proj) is nn.Linear and engine.model.cpu_kernels is None


needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C compiler to build the kernels with")


class CountingLibrary:
    """A native library whose few-row product counts its calls (so a test knows the kernel ran)."""

    def __init__(self, library):
        self.library, self.calls = library, 0
        self.path, self.vector_width = library.path, library.vector_width
        self.cdll = self

    def metronome_skinny_linear(self, *args):
        self.calls += 1
        return self.library.cdll.metronome_skinny_linear(*args)


@pytest.fixture
def library(tmp_path_factory):
    return CountingLibrary(load_library(tmp_path_factory.mktemp("kernels")))


@needs_compiler
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,in_features,out_features,in_kernel", [
    (1, 64, 1, True), (2, 128, 7, True), (3, 576, 960, True), (8, 1536, 576, True), (KERNEL_MAX_ROWS, 64, 130, True),
    (KERNEL_MAX_ROWS + 1, 64, 33, False), (5, 36, 20, False)])
def test_kernel_product_matches_float64(library, rows, in_features, out_features, in_kernel, bias):
    """Row and output counts off every block size; more rows than the kernel takes, and an input width that is
    no multiple of the vector width (36 is none of 8 and 16), go to F.linear and must match too."""
    gen = torch.Generator().manual_seed(rows * 100 + out_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(2, rows, in_features, generator=gen)[1]          # a view: rows with an offset
    with torch.no_grad():
        out = KernelLinear(linear, library)(x)
        ref = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                         None if linear.bias is None else linear.bias.double())
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    assert library.calls == int(in_kernel)


@needs_compiler
def test_what_the_kernel_cannot_take_goes_to_aten(library):
    """Strided rows are followed; bf16, autograd and a weight converted after wrapping never reach the C."""
    linear = nn.Linear(64, 40)
    layer = KernelLinear(linear, library)
    assert layer.weight is linear.weight                       # the layer's own parameters, not copies
    x = torch.randn(4, 128)[:, :64]                            # rows 128 apart
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), torch.nn.functional.linear(
            x.double(), linear.weight.double(), linear.bias.double()), rtol=1e-5, atol=1e-4)
    assert library.calls == 1
    layer(x)                                                   # autograd on: aten
    with torch.no_grad():
        layer.to(torch.bfloat16)(x.to(torch.bfloat16))         # bf16 input and weight: aten
        with pytest.raises(RuntimeError):                      # float32 input, bf16 weight: aten's own error
            layer(x)
    assert library.calls == 1


@needs_compiler
@pytest.mark.parametrize("family", ["llama", "llama-tied"])
def test_engine_with_the_kernel_products_matches_the_windowed_oracle(checkpoints, family, tmp_path, monkeypatch):
    """auto gives float32 to the C kernel (decoder layers and the logits, tied to the embedding or not);
    prompts and greedy decode rounds against transformers' windowed oracle, the products going through it."""
    from metronome import native
    from metronome.models import cpu_linear

    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    calls = []
    real = cpu_linear.skinny_linear

    def counted(where):
        def product(*args):     # counts the products the C took (None: it did not apply)
            out = real(*args)
            if out is not None:
                calls.append(where)
            return out
        return product
    monkeypatch.setattr(cpu_linear, "skinny_linear", counted("layers"))
    monkeypatch.setattr("metronome.models.llama.skinny_linear", counted("logits"))
    path, model = checkpoints[family]
    engine = Engine(EngineConfig(model=path, dtype="float32", num_blocks=200, max_chunk_tokens=24,
                                 max_batch_tokens=64,
                                 policy=KVPolicy(sinks=3, window=13, block_size=4, positions="absolute")))
    layer = engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, KernelLinear) and isinstance(layer.mlp.down_proj, KernelLinear)
    assert engine.model.cpu_kernels is not None
    tokens, logprobs = drive(engine, random.Random(5), 6)
    ref = hf_windowed_logprobs(model, tokens, 3, 13)
    assert max(abs(lp - ref[pos - 1, tokens[pos]].item()) for pos, lp in logprobs) < 1e-3
    assert "layers" in calls and "logits" in calls    # the layers' products and the logits took the kernel


def test_without_a_compiler_auto_uses_torch_and_kernel_says_why(llama, tmp_path, monkeypatch, caplog):
    """No C kernels: auto leaves float32 products to aten and decode rounds to SDPA, with a warning saying why;
    either setting asking for "kernel" is an error."""
    from metronome import native
    from metronome.native import KernelBuildError

    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", "false")
    engine = Engine(EngineConfig(model=llama[0], dtype="float32", **SMALL))
    assert type(engine.model.model.layers[0].mlp.down_proj) is nn.Linear and engine.model.cpu_kernels is None
    assert engine.runner.decode_window.kernel is None and "exited" in caplog.text
    for setting in (dict(cpu_linear="kernel"), dict(cpu_attention="kernel")):
        with pytest.raises(KernelBuildError):
            Engine(EngineConfig(model=llama[0], dtype="float32", **setting, **SMALL))


def test_kernel_setting_is_for_float32(llama):
    with pytest.raises(ConfigError, match="float32"):
        Engine(EngineConfig(model=llama[0], dtype="bfloat16", cpu_linear="kernel", **SMALL))


def test_cpu_linear_setting_is_checked(llama):
    with pytest.raises(ConfigError, match="cpu_linear"):
        EngineConfig(cpu_linear="fast")
    if not packable(torch.bfloat16):
        with pytest.raises(ConfigError, match="cannot pack"):
            Engine(EngineConfig(model=llama[0], dtype="bfloat16", cpu_linear="packed", **SMALL))


@pytest.mark.skipif(not packable(torch.bfloat16), reason="this CPU has no bf16 instructions for oneDNN to pack")
@pytest.mark.parametrize("family", ["llama", "llama-tied"])
def test_bf16_engine_packs_the_head_and_its_logits_match_float64(checkpoints, family):
    """The logits' product goes through a packed copy of the head (the embedding's, where tied, which the lookup
    still reads); the logits are within bf16 rounding of float64 and their argmax is float64's."""
    engine = Engine(EngineConfig(model=checkpoints[family][0], dtype="bfloat16", **SMALL))
    model = engine.model
    assert isinstance(model.packed_head, PackedLinear) and model.head_weight().dtype == torch.bfloat16
    hidden = torch.randn(6, model.spec.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        logits = model.compute_logits(hidden).double()
    ref = hidden.double() @ model.head_weight().double().t()
    assert ((logits - ref).norm() / ref.norm()).item() < 2 ** -7
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    again = Engine(EngineConfig(model=checkpoints[family][0], dtype="bfloat16", cpu_linear="aten", **SMALL),
                   model=model)
    assert again.model.packed_head is None       # a model handed to an engine that packs nothing: the plain head
