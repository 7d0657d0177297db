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
    (1, 64, 1, True), (1, 80, 9, True), (1, 576, 960, True), (2, 128, 7, True), (3, 576, 960, True),
    (8, 1536, 576, True), (KERNEL_MAX_ROWS, 64, 130, True), (KERNEL_MAX_ROWS + 1, 64, 33, False), (5, 36, 20, False)])
def test_kernel_product_matches_float64(library, rows, in_features, out_features, in_kernel, bias):
    """Row and output counts off every block size; one row through its own loop, with inputs past its four
    vectors a step (80 = 2 x 32 + 16 at 8 lanes, 64 + 16 at 16); more rows than the kernel takes, and an input
    width that is no multiple of the vector width (36 is none of 8 and 16), go to F.linear and must match too."""
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


# ---------------------------------------------------------------------------------------- FP8 (E4M3) weights
def e4m3_layer(out_features, in_features, seed):
    from metronome.models.fp8 import quantize

    gen = torch.Generator().manual_seed(seed)
    codes, scale = quantize(torch.randn(out_features, in_features, generator=gen))
    return codes, scale, torch.randn(out_features, generator=gen)


def within_rounding(out, x, codes, scale, bias):
    """|out - x W^T - b| within float32 sums (1e-5 of the sum of |terms|) plus, for bf16, one rounding of the
    result (2^-8 of it); W = codes x scale in float64, the oracle."""
    w = codes.double() * scale.double()
    ref = x.double() @ w.t() + (0 if bias is None else bias.double())
    size = x.double().abs() @ w.abs().t() + (0 if bias is None else bias.double().abs())
    rounding = 2 ** -8 if out.dtype == torch.bfloat16 else 0
    return bool(((out.double() - ref).abs() <= 1e-5 * size + rounding * ref.abs()).all())


@needs_compiler
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype,pairs", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("rows,in_features,out_features", [
    (1, 64, 48), (5, 576, 960), (13, 96, 112), (25, 160, 32), (200, 64, 16), (3, 48, 32), (7, 80, 48), (0, 64, 32)])
def test_e4m3_product_matches_float64(cpu_library, dtype, pairs, rows, in_features, out_features, bias):
    """Row counts off every block size (4, 3 and 12 rows) and none, channel counts off the panels (32) and blocks
    (4 and 16), input widths off the widening's 64 and the pair products' 32, the row-major layout for both dtypes
    and the pair layout for bf16; rows with an offset and a stride; the kernels built for this CPU and for each
    narrower instruction set it runs."""
    from metronome.models.cpu_linear import E4m3Product

    library = cpu_library
    if pairs and not library.cdll.metronome_e4m3_pairs_available():
        pytest.skip("this build has no AVX512-BF16 for the pair layout")
    if in_features % library.vector_width:
        pytest.skip(f"{in_features} inputs are no multiple of this build's vector width")
    codes, scale, b = e4m3_layer(out_features, in_features, rows * 100 + out_features)
    b = b if bias else None
    x = torch.randn(rows, 2 * in_features + 16, generator=torch.Generator().manual_seed(rows))[:, 16:16 + in_features]
    x = x.to(dtype)
    product = E4m3Product(dtype, pairs, library)
    out = product(x, product.stored(codes), scale, b)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    assert within_rounding(out, x, codes.float(), scale, b)
    if rows:
        assert not within_rounding(out * (1 + 2 ** -6), x, codes.float(), scale, b)   # the bound can fail


@needs_compiler
def test_e4m3_product_takes_what_its_kernels_can(cpu_library):
    """Per-channel scales, float32 or bf16 rows, an input width of whole vectors, CPU tensors; the pair layout
    only for bf16 rows, where the build has AVX512-BF16 and the channels come in groups of 16. Rows of another
    dtype are refused, not misread."""
    from metronome.models.cpu_linear import E4m3Product, from_pair_layout, to_pair_layout

    library = cpu_library
    codes, scale, _ = e4m3_layer(48, 64, 0)
    pairs_here = bool(library.cdll.metronome_e4m3_pairs_available())
    assert E4m3Product.for_layer(codes, scale, torch.bfloat16, library).pairs == pairs_here
    assert not E4m3Product.for_layer(codes, scale, torch.float32, library).pairs
    assert not E4m3Product.for_layer(codes[:40], scale[:40], torch.bfloat16, library).pairs
    assert E4m3Product.for_layer(codes, scale.expand(48, 2), torch.bfloat16, library) is None  # scales by group
    assert E4m3Product.for_layer(codes, scale, torch.float16, library) is None
    assert E4m3Product.for_layer(codes[:, :30], scale, torch.float32, library) is None   # no vector width
    layout = to_pair_layout(codes).view(torch.uint8)     # [group][input pair][channel][input of the pair]
    assert layout.shape == (3, 32, 16, 2) and torch.equal(layout[1, 5, 7], codes.view(torch.uint8)[16 + 7, 10:12])
    assert torch.equal(from_pair_layout(to_pair_layout(codes)).view(torch.uint8), codes.view(torch.uint8))
    product = E4m3Product.for_layer(codes, scale, torch.float32, library)
    with pytest.raises(ValueError, match="float32 rows"):
        product(torch.randn(2, 64, dtype=torch.bfloat16), product.stored(codes), scale, None)


@needs_compiler
def test_fp8_layers_use_the_kernel_and_give_the_dequantised_product(cpu_library):
    """One copy of the codes, in the kernel's layout; the dequantised product wherever the kernel does not apply
    (another dtype, autograd); moved or loaded, a layer leaves the kernel with its codes row-major."""
    from metronome.models.fp8 import Fp8Linear, Product, use_cpu_kernel_

    library = cpu_library
    net = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32))
    layers = nn.Sequential(*(Fp8Linear.from_linear(linear) for linear in net))
    codes = layers[0].weight.clone()
    x = torch.randn(6, 64)
    with torch.no_grad():
        want = layers[0](x)                              # not given the kernel: the dequantised product
        assert use_cpu_kernel_(layers, library, torch.bfloat16) == 2
        assert layers[0].weight.untyped_storage().nbytes() == codes.numel()   # the codes once, in its layout
        assert torch.equal(layers[0].codes().view(torch.uint8), codes.view(torch.uint8))
        assert use_cpu_kernel_(layers, library, torch.float32) == 2
        assert layers[0].product(6, torch.float32) == Product.CPU_KERNEL
        assert layers[0].product(6, torch.bfloat16) == Product.DEQUANTIZED   # given for float32 rows only
        torch.testing.assert_close(layers[0](x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layers[0](x.reshape(2, 3, 64)), want.reshape(2, 3, 48), rtol=1e-5, atol=1e-5)
    grad = torch.randn(6, 64, requires_grad=True)
    assert layers[0](grad).requires_grad                 # autograd: the dequantised product, which tracks it
    state = {k: torch.zeros_like(v) if k.endswith("weight_scale") else v for k, v in layers.state_dict().items()}
    use_cpu_kernel_(layers, library, torch.bfloat16)
    layers.load_state_dict({k: v.clone() for k, v in state.items()} | {
        "0.weight": codes, "1.weight": layers[1].codes().clone()})
    assert layers[0].cpu_product is None and torch.equal(layers[0].weight.view(torch.uint8), codes.view(torch.uint8))
    with torch.no_grad():                                # the loaded zero scales, not a stale copy, decide
        torch.testing.assert_close(layers[0](x), state["0.bias"].expand(6, 48))
    use_cpu_kernel_(layers, library, torch.float32)
    moved = layers.to("meta")
    assert all(layer.cpu_product is None and layer.weight.shape == (layer.out_features, layer.in_features)
               for layer in moved)


@needs_compiler
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_fp8_weights_on_the_cpu_matches_their_dequantised_products(llama, dtype, monkeypatch):
    """quantization="fp8" on the CPU: every decoder layer multiplies through the C kernel, and sessions get the
    log-probabilities of the same engine whose layers dequantise their weights for each product (aten). An
    engine asked for aten over a model an earlier engine gave the kernel takes it away."""
    from metronome.models import cpu_linear
    from metronome.models.fp8 import Fp8Linear

    if dtype == "bfloat16" and not packable(torch.bfloat16):
        pytest.skip("this CPU has no bf16 instructions")
    calls = []
    real = cpu_linear.E4m3Product.__call__
    monkeypatch.setattr(cpu_linear.E4m3Product, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    results, engines = {}, {}
    for choice in ("auto", "aten"):
        engine = engines[choice] = Engine(EngineConfig(model=llama[0], dtype=dtype, quantization="fp8",
                                                       cpu_linear=choice, **SMALL))
        fp8 = [m for m in engine.model.model.layers.modules() if isinstance(m, Fp8Linear)]
        assert fp8 and all((m.cpu_product is not None) == (choice == "auto") for m in fp8)
        results[choice] = drive(engine, random.Random(7), 6)
    assert calls
    (tokens, got), (ref_tokens, want) = results["auto"], results["aten"]
    # float32: the same products summed in another order (5e-7 here); bf16: aten rounds the dequantised weight to
    # bf16 first and each product's output once more (0.003 here)
    bound = 1e-4 if dtype == "float32" else 0.02
    worst = max(abs(a - b) for (_, a), (_, b) in zip(got, want))
    assert len(got) == len(want) and worst < bound, worst
    assert dtype != "float32" or tokens == ref_tokens
    again = Engine(EngineConfig(model=llama[0], dtype=dtype, quantization="fp8", cpu_linear="aten", **SMALL),
                   model=engines["auto"].model)
    assert all(m.cpu_product is None for m in again.model.model.layers.modules() if isinstance(m, Fp8Linear))
