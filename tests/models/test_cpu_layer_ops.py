"""A decoder layer's elementwise steps in C (``models/cpu_layer_ops.py``): each against transformers' own
module or a float64 formula, in float32 and bfloat16, what the kernels refuse, and whole engines with them
against transformers' windowed oracle."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from metronome import Engine, EngineConfig, KVPolicy
from metronome.errors import ConfigError
from metronome.models.cpu_layer_ops import CpuLayerOps
from metronome.models.rope import Rotary
from metronome.native import NativeLibrary, find_compiler, load_library
from tests.engine.oracle import hf_windowed_logprobs
from tests.engine.test_engine_fp8 import drive

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler to build the kernels with")

OPS = ("metronome_rms_norm", "metronome_rope", "metronome_silu_mul")


class CountingLibrary:
    """The native library with each elementwise kernel's calls counted (so a test knows the C ran)."""

    def __init__(self, library: NativeLibrary) -> None:
        self.library, self.calls = library, {name: 0 for name in OPS}
        self.path, self.vector_width, self.cdll = library.path, library.vector_width, self

    def __getattr__(self, name):
        if name not in OPS:
            return getattr(self.library.cdll, name)

        def call(*args):
            self.calls[name] += 1
            return getattr(self.library.cdll, name)(*args)
        return call


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> NativeLibrary:
    return load_library(tmp_path_factory.mktemp("kernels"))


@pytest.fixture
def counted(built) -> CountingLibrary:
    return CountingLibrary(built)


def bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within two bf16 roundings: the kernel and transformers round intermediates at different points."""
    torch.testing.assert_close(out.double(), ref.double(), rtol=2 * 2 ** -8, atol=1e-5)


def rounds_as_torch(out: torch.Tensor, torch_path: torch.Tensor) -> None:
    """bf16 results as torch's own operators give them: at most one unit in the last place apart, and that on
    under 1 % of the elements (a float32 intermediate one rounding apart can land on the other bf16 neighbour).
    Leaving out an intermediate rounding to bf16 makes about a quarter of them differ."""
    assert out.dtype == torch_path.dtype == torch.bfloat16
    ulps = (out.view(torch.int16).int() - torch_path.view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1 and (ulps > 0).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (3, 5, 40), (300, 96),
                                   (301, 576)])   # the last past PARALLEL_ELEMENTS
def test_rms_norm_matches_transformers(counted, dtype, shape):
    """Rows with a stride of their own (a view into wider rows, as the C reads them); bf16 as torch rounds it."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from metronome.models.llama import RMSNorm

    torch.manual_seed(shape[-1])
    ref_module = LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    ours = RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        ref_module.weight.copy_(torch.randn(shape[-1]))
        ours.weight.copy_(ref_module.weight)
        x = (torch.randn(*shape[:-1], 2 * shape[-1]) * 3).to(dtype)[..., :shape[-1]]     # rows 2 * dim apart
        out = CpuLayerOps(counted).rms_norm(x, ref_module.weight, 1e-5)
        ref = ref_module(x)
        torch_path = ours(x)                                                            # no cpu_ops: torch's
    assert out.shape == ref.shape and out.dtype == dtype and counted.calls["metronome_rms_norm"] == 1
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        bf16_close(out, ref)
        rounds_as_torch(out, torch_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 9, 3, 64), (5, 4, 2, 32), (26, 2, 1, 128),
                                                      (131, 9, 3, 64)])   # the last past PARALLEL_ELEMENTS
def test_rope_matches_transformers(counted, dtype, tokens, heads, kv_heads, dim):
    """q and k as the split views of one fused projection, rotated in place, against transformers'
    ``apply_rotary_pos_emb`` with the same tables; bf16 as torch rounds it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(dim + tokens)
    rotary = Rotary(tuple((10000.0 ** (-2 * i / dim)) for i in range(dim // 2)), 1.0, "cpu")
    cos, sin = rotary.cos_sin(torch.randint(0, 4000, (tokens,)))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, _ = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)
    # transformers' layout: [batch, heads, tokens, dim], tables [batch, tokens, dim]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None].float(), k.transpose(0, 1)[None].float(),
                                        cos[None], sin[None])
    torch_q, torch_k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    assert CpuLayerOps(counted).rope_qk_(q, k, cos, sin)
    assert counted.calls["metronome_rope"] == 2
    for out, ref, torch_path in ((q, ref_q, torch_q), (k, ref_k, torch_k)):
        ref = ref[0].transpose(0, 1).to(dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        else:
            bf16_close(out, ref)
            rounds_as_torch(out, torch_path)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)     # v is not touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 64), (24, 1536), (3, 7), (67, 1536)])   # the last past PARALLEL_ELEMENTS
def test_silu_mul_matches_float64(counted, dtype, rows, dim):
    """Rows with a stride of their own; bf16 as torch's operators round it."""
    torch.manual_seed(rows + dim)
    gate_up = (torch.randn(rows, 3 * dim) * 4).to(dtype)[:, :2 * dim]          # rows 3 * dim apart
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-30])    # saturating, and about zero
    out = CpuLayerOps(counted).silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    else:   # torch's own bf16 path stores silu(gate) in bf16 before the product; so does the kernel
        bf16_close(out, F.silu(gate) * up)
        g, u = gate_up.chunk(2, dim=-1)
        rounds_as_torch(out, F.silu(g).mul_(u))
    assert counted.calls["metronome_silu_mul"] == 1


def test_silu_mul_spreads_nan_and_infinities(counted):
    gate_up = torch.tensor([[float("nan"), float("inf"), float("-inf"), 1.0, 2.0, 3.0, 4.0, 5.0]])
    out = CpuLayerOps(counted).silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, equal_nan=True)


def test_what_the_kernels_do_not_take_stays_with_torch(counted):
    """float16, mixed dtypes, autograd and an odd width return None (or False) before any C runs."""
    ops = CpuLayerOps(counted)
    weight = torch.ones(64)
    assert ops.rms_norm(torch.randn(3, 64, dtype=torch.float16), weight.half(), 1e-6) is None
    assert ops.rms_norm(torch.randn(3, 64), weight.bfloat16(), 1e-6) is None
    assert ops.rms_norm(torch.randn(3, 64, requires_grad=True), weight, 1e-6) is None
    assert ops.rms_norm(torch.randn(3, 64), torch.ones(32), 1e-6) is None
    assert ops.silu_mul(torch.randn(3, 9)) is None
    assert ops.silu_mul(torch.randn(3, 8, dtype=torch.float16)) is None
    cos = sin = torch.ones(2, 8)
    assert not ops.rope_qk_(torch.randn(2, 3, 8), torch.randn(2, 1, 8, dtype=torch.bfloat16), cos, sin)
    assert not ops.rope_qk_(torch.randn(2, 3, 8), torch.randn(2, 1, 8), cos.double(), sin.double())
    assert not ops.rope_qk_(torch.randn(2, 1, 8).expand(2, 3, 8), torch.randn(2, 1, 8), cos, sin)  # rows overlap
    with torch.no_grad():
        assert ops.rms_norm(torch.randn(3, 64), weight.requires_grad_(), 1e-6) is not None
    assert counted.calls == {"metronome_rms_norm": 1, "metronome_rope": 0, "metronome_silu_mul": 0}


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("qwen3", "float32"), ("qwen2", "bfloat16")])
def test_engine_with_the_kernels_matches_the_windowed_oracle(checkpoints, family, dtype, tmp_path, monkeypatch):
    """Prompts and greedy decode rounds against transformers' windowed oracle (qwen3: q/k norms too), every C
    call of the norms, rotations and activations counted."""
    monkeypatch.setenv("METRONOME_KERNEL_CACHE", str(tmp_path))
    path, model = checkpoints[family]
    engine = Engine(EngineConfig(model=path, dtype=dtype, cpu_elementwise="kernel", num_blocks=200,
                                 max_chunk_tokens=24, max_batch_tokens=64,
                                 policy=KVPolicy(sinks=3, window=13, block_size=4, positions="absolute")))
    cdll = engine.cpu_kernels.cdll
    calls = dict.fromkeys(OPS, 0)
    for name in OPS:
        def counted_call(*args, _call=getattr(cdll, name), _name=name):
            calls[_name] += 1
            return _call(*args)
        setattr(cdll, name, counted_call)
    tokens, logprobs = drive(engine, random.Random(5), 6)
    ref = hf_windowed_logprobs(model, tokens, 3, 13)
    bound = 1e-3 if dtype == "float32" else 1e-2     # bf16: torch's own operators are 3e-3 off here
    assert max(abs(lp - ref[pos - 1, tokens[pos]].item()) for pos, lp in logprobs) < bound
    assert min(calls.values()) > 0, calls


def test_torch_setting_leaves_the_layers_alone(llama):
    engine = Engine(EngineConfig(model=llama[0], dtype="float32", cpu_elementwise="torch", cpu_attention="sdpa",
                                 cpu_linear="aten", num_blocks=64, max_chunk_tokens=24, max_batch_tokens=64,
                                 policy=KVPolicy(sinks=3, window=13, block_size=4)))
    assert all(getattr(m, "cpu_ops", None) is None for m in engine.model.modules())


def test_cpu_elementwise_setting_is_checked():
    with pytest.raises(ConfigError, match="cpu_elementwise"):
        EngineConfig(cpu_elementwise="fast")
    with pytest.raises(ConfigError, match="float32 or bfloat16"):
        EngineConfig(dtype="float16", cpu_elementwise="kernel")
    with pytest.raises(ConfigError, match="cpu_elementwise"):
        EngineConfig(device="cuda", cpu_elementwise="kernel")
