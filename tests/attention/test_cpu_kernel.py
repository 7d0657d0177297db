"""The CPU decode-attention kernel (``attention/cpu_kernel.py``), built for this CPU and for the narrower
instruction sets it also runs, against a float64 masked softmax; in the engine; and what ``cpu_attention`` does
where no compiler works."""

from __future__ import annotations

import pytest
import torch

from metronome import native
from metronome.attention import cpu_kernel
from metronome.attention.cpu_kernel import CpuDecodeKernel, kernel_for
from metronome.attention.fp8 import E4M3, to_e4m3
from metronome.native import KernelBuildError, find_compiler

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler to build the kernel with")


@pytest.fixture
def kernel(cpu_library):
    """The kernel built for this CPU and for each narrower instruction set it runs (``cpu_library``)."""
    return CpuDecodeKernel(cpu_library)


def oracle(q, k, v, mask, scale):
    """float64 softmax over the allowed columns; a row with none allowed gives zeros (the kernel's contract)."""
    scores = torch.einsum("nhgd,nhjd->nhgj", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    return torch.einsum("nhgj,nhjd->nhgd", weights, v.double())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("n,kv_heads,group,dim,width", [
    (1, 1, 1, 64, 1), (3, 3, 3, 64, 300), (5, 2, 4, 128, 65), (2, 4, 1, 64, 1040), (4, 1, 7, 32, 129),
    # the bf16 value pass takes a group's rows in twos or threes: groups of 2 and 5 leave each remainder; a dim
    # that is not a multiple of four vectors takes the float32 tile path and its one-vector tail
    (2, 2, 2, 64, 77), (3, 2, 5, 128, 70), (2, 1, 3, 48, 70)])
def test_kernel_matches_a_float64_softmax(kernel, dtype, tol, n, kv_heads, group, dim, width):
    if not kernel.supports(dtype, dim):
        pytest.skip(f"head dim {dim} is not a multiple of this CPU's vector width {kernel.vector_width}")
    gen = torch.Generator().manual_seed(n * 1000 + width)
    q = torch.randn(n, kv_heads, group, dim, generator=gen).to(dtype)
    # Buffers with spare rows and columns, as the decode window has: the kernel must follow their strides.
    k, v = (torch.randn(n + 2, kv_heads, width + 40, dim, generator=gen).mul(2).to(dtype) for _ in range(2))
    mask = torch.rand(n, width, generator=gen) > 0.3
    mask[:, -1] = True                        # the round's own token is always attended
    scale = 0.3 if width % 2 else dim ** -0.5     # the engine's scale, and one that is not
    out = kernel(q, k, v, mask, scale)
    assert out.dtype == dtype and out.shape == q.shape
    expect = oracle(q, k[:n, :, :width], v[:n, :, :width], mask, scale)
    torch.testing.assert_close(out.double(), expect, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("n,kv_heads,group,dim,width", [(1, 1, 1, 64, 1), (3, 3, 3, 64, 300), (5, 2, 4, 128, 65),
                                                        (2, 1, 3, 48, 70)])
def test_e4m3_keys_and_values_match_a_float64_softmax_of_their_values(kernel, dtype, tol, n, kv_heads, group, dim,
                                                                      width):
    """E4M3 codes with a scale per (K or V, KV head), the FP8 cache's layout: the oracle reads code x scale."""
    if not kernel.supports(E4M3, dim):
        pytest.skip(f"head dim {dim} is not a multiple of this CPU's vector width {kernel.vector_width}")
    gen = torch.Generator().manual_seed(n * 1000 + width)
    q = torch.randn(n, kv_heads, group, dim, generator=gen).to(dtype)
    kv_scale = torch.rand(2, kv_heads, generator=gen) * 0.05 + 0.01
    k, v = (to_e4m3(torch.randn(n + 2, kv_heads, width + 40, dim, generator=gen) * 3, s[:, None, None])
            for s in kv_scale)
    mask = torch.rand(n, width, generator=gen) > 0.3
    mask[:, -1] = True
    out = kernel(q, k, v, mask, dim ** -0.5, kv_scale)
    assert out.dtype == dtype and out.shape == q.shape
    k_values, v_values = (x[:n, :, :width].double() * s.double()[:, None, None] for x, s in zip((k, v), kv_scale))
    torch.testing.assert_close(out.double(), oracle(q, k_values, v_values, mask, dim ** -0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 48])
def test_every_e4m3_code_reads_as_torchs_cast(kernel, dtype, dim):
    """One key: its weight is exactly 1, so the output is the value row times its scale, exactly: every code,
    subnormals, both zeros and both NaNs (which reach the output, as a NaN in bf16 pages does) included. A head dim
    of 48 leaves a tail shorter than a vector for the scalar conversion."""
    if not kernel.supports(E4M3, dim):
        pytest.skip(f"head dim {dim} is not a multiple of this CPU's vector width {kernel.vector_width}")
    rows = -(-256 // dim)
    codes = torch.cat([torch.arange(256), torch.zeros(rows * dim - 256, dtype=torch.long)]).to(torch.uint8)
    v = codes.view(E4M3).view(rows, 1, 1, dim)
    kv_scale = torch.tensor([[1.0], [0.5]])
    out = kernel(torch.ones(rows, 1, 1, dim, dtype=dtype), torch.zeros_like(v), v,
                 torch.ones(rows, 1, dtype=torch.bool), 0.125, kv_scale)
    assert out.dtype == dtype and int(out.float().isnan().sum()) == 2
    torch.testing.assert_close(out.float(), v.float() * 0.5, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_e4m3_rows_are_torchs(kernel, dtype):
    """Every code (NaNs included) of gathered rows [rows, heads, dim] times its head's scale, rounded once: the values
    ``(codes.float() * scale).to(dtype)`` gives, which the reference computes elsewhere."""
    gen = torch.Generator().manual_seed(4)
    codes = torch.cat([torch.arange(256), torch.randint(0, 256, (3 * 5 * 48 - 256,), generator=gen)])
    codes = codes.to(torch.uint8).view(E4M3).view(5, 3, 48)
    scale = torch.rand(3, generator=gen) + 0.01
    got = kernel.dequantize(codes, scale, dtype)
    assert got.dtype == dtype and got.shape == codes.shape
    torch.testing.assert_close(got, (codes.float() * scale[:, None]).to(dtype), rtol=0, atol=0, equal_nan=True)
    assert kernel.dequantize(codes.transpose(0, 1), scale, dtype) is None      # not contiguous: the caller's torch
    assert kernel.dequantize(codes, scale[:2], dtype) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_rows_are_torchs_bytes(kernel, dtype):
    """Keys [T, heads, dim] over a scale a head, rounded to E4M3 as ``to_e4m3`` rounds them, byte for byte: every
    code's value and every midpoint between neighbours (ties go to the even code), the subnormals, values past ±448
    and ±inf (saturated), NaN, -0, magnitudes from 1e-6 to 1e4; rows read through a strided view."""
    gen = torch.Generator().manual_seed(9)
    values = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    finite = values[torch.isfinite(values)].unique()
    midpoints = (finite[1:] + finite[:-1]) / 2
    special = torch.tensor([0.0, -0.0, 447.9, 448.0, 449.0, 464.0, 480.0, 1e9, float("inf"), -float("inf"),
                            float("nan"), 2 ** -9, 2 ** -10, 3 * 2 ** -11, 2 ** -6, 2 ** -6 - 2 ** -10])
    spread = torch.randn(4000, generator=gen) * torch.logspace(-6, 4, 4000)
    flat = torch.cat([finite, midpoints, -midpoints, special, -special, spread])
    dim, heads = 16, 3
    flat = torch.cat([flat, torch.zeros(-len(flat) % (heads * dim))])
    x = flat.view(-1, heads, dim).to(dtype)
    wide = torch.zeros(x.shape[0], heads + 1, dim, dtype=dtype)     # rows with a spare head between tokens
    wide[:, :heads] = x
    strided = wide[:, :heads]
    for scale in (torch.ones(heads), torch.tensor([0.5, 3.0, 1e-3])):
        got = kernel.quantize(strided, scale)
        want = to_e4m3(x, scale[:, None]).view(torch.uint8)
        assert got.dtype == torch.uint8 and got.shape == x.shape
        assert torch.equal(got, want), (got != want).nonzero()[:5]
    assert kernel.quantize(x, torch.ones(2)) is None                  # scales of another head count: torch's
    assert kernel.quantize(x.half(), torch.ones(heads)) is None


def test_the_reference_dequantises_e4m3_pages_through_the_kernel_to_the_same_output(kernel):
    from tests.attention.test_reference import build_case
    from metronome.attention.reference import paged_attention_reference, plan_reference

    meta, query, k_cache, v_cache = build_case([(70, 26), (33, 1)], 4, 24, 4, heads=6, kv_heads=3, head_dim=32)[:4]
    kv_scale = torch.tensor([[0.02, 0.05, 0.1], [0.03, 0.01, 0.2]])
    k8, v8 = (to_e4m3(c.float(), s[:, None]) for c, s in ((k_cache, kv_scale[0]), (v_cache, kv_scale[1])))
    plan = plan_reference(meta, 6)
    calls = []

    def counted(codes, scale, dtype):
        calls.append(codes.shape)
        return kernel.dequantize(codes, scale, dtype)

    query = query.to(torch.bfloat16)
    got = paged_attention_reference(query, k8, v8, plan, kv_scale=kv_scale, dequantize=counted)
    want = paged_attention_reference(query, k8, v8, plan, kv_scale=kv_scale)
    assert len(calls) == 2 * len(plan.groups)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_e4m3_pages_without_their_scales_are_refused(kernel):
    q, k = torch.randn(2, 1, 3, 64), torch.randn(2, 1, 9, 64).to(E4M3)
    mask = torch.ones(2, 9, dtype=torch.bool)
    for bad_v, scales in ((k, None), (k.float(), torch.ones(2, 1)), (k, torch.ones(2, 2))):
        with pytest.raises(ValueError, match="E4M3|CPU kernel"):
            kernel(q, k, bad_v, mask, 0.125, scales)
    with pytest.raises(ValueError, match="CPU kernel"):     # scales for float pages
        kernel(q, k.float(), k.float(), mask, 0.125, torch.ones(2, 1))


def test_bf16_results_are_rounded_to_nearest_even(kernel):
    """Two equal keys weigh exactly 1/2 each: the result is the mean of two values, rounded once to bf16."""
    a = torch.tensor([1.0, 1.0 + 2 ** -7, -3.0, 0.5], dtype=torch.float32).repeat(16)    # 64 values
    b = (a + torch.tensor([2 ** -8, 2 ** -8 + 2 ** -10, 2 ** -6, 2 ** -9]).repeat(16))
    k = torch.ones(1, 1, 2, 64, dtype=torch.bfloat16)
    v = torch.stack([a, b]).to(torch.bfloat16).view(1, 1, 2, 64)
    out = kernel(torch.ones(1, 1, 1, 64, dtype=torch.bfloat16), k, v, torch.ones(1, 2, dtype=torch.bool), 0.125)
    expect = ((v[0, 0, 0].float() + v[0, 0, 1].float()) * 0.5).to(torch.bfloat16)   # torch's own rounding
    assert torch.equal(out.view(64), expect)


def test_a_nan_score_reaches_the_output_as_in_sdpa(kernel):
    q, k, v = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 5, 64), torch.randn(1, 1, 5, 64)
    k[0, 0, 2, 3] = float("nan")
    assert torch.isnan(kernel(q, k, v, torch.ones(1, 5, dtype=torch.bool), 0.125)).all()


def test_what_the_kernel_cannot_read_is_refused(kernel):
    q, k = torch.randn(2, 1, 3, 64), torch.randn(2, 1, 9, 64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    for bad_k, bad_v, bad_mask in ((k.to(torch.bfloat16), k.to(torch.bfloat16), mask),   # dtypes differ
                                   (k.transpose(1, 2), k.transpose(1, 2), mask),       # not [n, heads, keys, dim]
                                   (k, k[:, :, :, :32], mask),                         # values of another shape
                                   (k, k, mask.to(torch.uint8)),                       # not a bool mask
                                   (k[:1], k[:1], mask)):                              # fewer rows than queries
        with pytest.raises(ValueError, match="CPU kernel"):
            kernel(q, bad_k, bad_v, bad_mask, 0.125)


def test_masked_columns_are_never_read_into_the_result(kernel):
    """Huge values in masked columns (stale keys behind a window) change nothing."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 3, 64, generator=gen)
    k, v = torch.randn(2, 2, 50, 64, generator=gen), torch.randn(2, 2, 50, 64, generator=gen)
    mask = torch.ones(2, 50, dtype=torch.bool)
    mask[:, 10:20] = False
    out = kernel(q, k, v, mask, 0.125)
    k[:, :, 10:20], v[:, :, 10:20] = 1e4, -1e4
    torch.testing.assert_close(kernel(q, k, v, mask, 0.125), out)


def test_a_row_with_no_allowed_key_gives_zeros(kernel):
    q, k, v = torch.randn(2, 1, 2, 64), torch.randn(2, 1, 9, 64), torch.randn(2, 1, 9, 64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1] = False
    out = kernel(q, k, v, mask, 0.125)
    assert torch.isfinite(out).all() and (out[1] == 0).all() and out[0].abs().sum() > 0


def test_without_the_c_kernels_or_when_asked_the_rounds_attend_with_sdpa(kernel):
    assert kernel_for("auto", None, torch.float32, 64) == (
        None, "decode attention: SDPA (the C kernels are not available; the warning above says why)")
    assert kernel_for("sdpa", kernel.library, torch.float32, 64) == (None, "decode attention: SDPA (as asked)")


def test_e4m3_pages_take_the_kernel_under_float32_or_bfloat16_models_only(kernel):
    dim = 4 * kernel.vector_width
    for dtype in (torch.float32, torch.bfloat16):
        assert kernel_for("auto", kernel.library, dtype, dim, E4M3)[0] is not None
    taken, line = kernel_for("auto", kernel.library, torch.float16, dim, E4M3)
    assert taken is None and "SDPA" in line and "over torch.float8_e4m3fn pages" in line
    assert kernel_for("auto", kernel.library, torch.float32, dim, torch.bfloat16)[0] is None


def test_a_model_the_kernel_does_not_take_attends_with_sdpa_and_the_line_says_so(kernel):
    for dtype, head_dim in ((torch.float16, 64), (torch.float32, kernel.vector_width + 1)):
        taken, line = kernel_for("kernel", kernel.library, dtype, head_dim)
        assert taken is None and "SDPA" in line and f"{dtype} and {head_dim}" in line
    taken, line = kernel_for("auto", kernel.library, torch.bfloat16, 4 * kernel.vector_width)
    assert taken is not None and "C kernel" in line


@pytest.mark.parametrize("choice", ["kernel", "sdpa"])
def test_a_cpu_engine_with_either_attention_matches_the_windowed_oracle(llama, choice, tmp_path, monkeypatch):
    """Two sessions through the engine (prefill, then greedy decode rounds) against transformers' windowed
    oracle, decode rounds attending through the C kernel or SDPA: every prompt token's log-probability
    matches (later prompts attend over keys the decode rounds wrote), and every decoded token is the
    oracle's most likely one (within 1e-3, so a near-tie may go either way). The tiny model's query and key
    weights are scaled up so that its attention is sharp: at random init it is nearly uniform, and a wrong
    decode-round attention would change almost nothing."""
    import copy
    import random

    from metronome import Engine, EngineConfig, KVPolicy, StepInput
    from tests.engine.oracle import hf_windowed_logprobs

    original_call = cpu_kernel.CpuDecodeKernel.__call__
    model = copy.deepcopy(llama[1])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    model.save_pretrained(tmp_path / "model")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "kernels"))
    calls, scattered = [], []
    original_scatter = cpu_kernel.CpuDecodeKernel.scatter_rows_
    monkeypatch.setattr(cpu_kernel.CpuDecodeKernel, "__call__",
                        lambda self, *a: calls.append(1) or original_call(self, *a))
    monkeypatch.setattr(cpu_kernel.CpuDecodeKernel, "scatter_rows_",
                        lambda self, *a: original_scatter(self, *a) and not scattered.append(1))
    engine = Engine(EngineConfig(model=str(tmp_path / "model"), dtype="float32", cpu_attention=choice, num_blocks=200,
                                 max_chunk_tokens=24, max_batch_tokens=64,
                                 policy=KVPolicy(sinks=3, window=13, block_size=4, positions="absolute")))
    assert (engine.runner.decode_window.kernel is not None) == (choice == "kernel")
    rng, sid, other = random.Random(5), engine.open_session(), engine.open_session()
    tokens, logprobs, decoded = [], [], []
    for _ in range(6):
        chunk = [rng.randrange(128) for _ in range(rng.randint(1, 12))]
        out, _ = engine.step([StepInput(sid, token_ids=chunk, max_new_tokens=4, prompt_logprobs=True),
                              StepInput(other, token_ids=[rng.randrange(128)], max_new_tokens=3)])
        logprobs += [(len(tokens) + i, lp) for i, lp in enumerate(out.prompt_logprobs) if lp is not None]
        tokens += chunk
        decoded += range(len(tokens), len(tokens) + len(out.token_ids))
        tokens += out.token_ids
    ref = hf_windowed_logprobs(model, tokens, 3, 13)
    assert max(abs(lp - ref[pos - 1, tokens[pos]].item()) for pos, lp in logprobs) < 1e-3
    assert len(decoded) == 24 and all(ref[p - 1].max() - ref[p - 1, tokens[p]] < 1e-3 for p in decoded)
    assert bool(calls) == (choice == "kernel")     # the kernel attended every decode round it was asked to
    assert bool(scattered) == (choice == "kernel")  # and wrote the rounds' keys and values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,width", [(1, 1, 192), (7, 3, 64), (24, 1, 192)])
def test_scattered_rows_match_index_copy(kernel, dtype, tokens, heads, width):
    """A round's keys as the fused projection's strided views, into a cache or buffer: as torch's index_copy_."""
    gen = torch.Generator().manual_seed(tokens * 10 + heads)
    qkv = torch.randn(tokens, 3 * heads * width, generator=gen).to(dtype)
    rows = qkv[:, heads * width:2 * heads * width].view(tokens, heads, width)       # token stride 3 * heads * width
    index = torch.randperm(50, generator=gen)[:tokens * heads]
    dest, ref = torch.zeros(50, width, dtype=dtype), torch.zeros(50, width, dtype=dtype)
    assert kernel.scatter_rows_(rows, dest, index)
    ref.index_copy_(0, index, rows.reshape(-1, width))
    assert torch.equal(dest, ref)


def test_scatter_refuses_what_it_does_not_take_and_checks_the_index(kernel):
    rows, dest = torch.randn(2, 1, 8), torch.zeros(4, 8)
    assert not kernel.scatter_rows_(rows, dest.double(), torch.tensor([0, 1]))            # dtypes differ
    assert not kernel.scatter_rows_(rows, dest, torch.tensor([0, 1], dtype=torch.int32))  # index dtype
    assert not kernel.scatter_rows_(rows, dest, torch.tensor([0]))                         # one index a row
    assert not kernel.scatter_rows_(rows, torch.zeros(8, 4).t(), torch.tensor([0, 1]))    # strided destination
    with pytest.raises(IndexError):
        kernel.scatter_rows_(rows, dest, torch.tensor([1, 4]))
    assert torch.equal(dest, torch.zeros(4, 8))                                           # nothing written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [0, 1, 37, 5000])
def test_copied_rows_match_index_select_then_index_copy(kernel, dtype, count):
    """Rows gathered by one index and placed by another (repeated sources, any order; 5,000 rows of 512 bytes
    run on the threads): as torch's index_select then index_copy_."""
    gen = torch.Generator().manual_seed(count)
    src = torch.randn(6000, 128, generator=gen).to(dtype)
    src_index = torch.randint(0, 6000, (count,), generator=gen)
    dest_index = torch.randperm(7000, generator=gen)[:count]
    dest, ref = torch.zeros(7000, 128, dtype=dtype), torch.zeros(7000, 128, dtype=dtype)
    assert kernel.copy_rows_(src, src_index, dest, dest_index)
    ref.index_copy_(0, dest_index, src.index_select(0, src_index))
    assert torch.equal(dest, ref)


def test_copy_refuses_what_it_does_not_take_and_checks_both_indices(kernel):
    src, dest, two = torch.randn(3, 8), torch.zeros(4, 8), torch.tensor([0, 1])
    assert not kernel.copy_rows_(src, two, dest.double(), two)                            # dtypes differ
    assert not kernel.copy_rows_(src, two.int(), dest, two)                               # index dtype
    assert not kernel.copy_rows_(src, two, dest, torch.tensor([0]))                       # lengths differ
    assert not kernel.copy_rows_(src, two, torch.zeros(8, 4).t(), two)                    # strided destination
    assert not kernel.copy_rows_(src, two, torch.zeros(4, 6), two)                        # widths differ
    for src_index, dest_index in ((torch.tensor([0, 3]), two), (two, torch.tensor([-1, 0]))):
        with pytest.raises(IndexError):
            kernel.copy_rows_(src, src_index, dest, dest_index)
    assert torch.equal(dest, torch.zeros(4, 8))                                           # nothing written


def test_write_kv_with_the_kernel_takes_an_empty_round(kernel):
    from metronome.attention.metadata import write_kv

    k_cache, v_cache = torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8)
    empty = torch.zeros(0, 3, 8)
    write_kv(empty, empty, k_cache, v_cache, torch.zeros(0, dtype=torch.long), kernel=kernel)
    assert not k_cache.any() and not v_cache.any()


def test_write_kv_over_e4m3_pages_stores_the_same_bytes_with_the_kernel_as_without(kernel):
    """The row scatter writes E4M3 pages as bytes; quantised by ``write_kv`` or handed over as ``e4m3_codes``."""
    from metronome.attention.metadata import e4m3_codes, write_kv

    gen = torch.Generator().manual_seed(2)
    key, value = (torch.randn(5, 3, 8, generator=gen) for _ in range(2))
    kv_scale = torch.tensor([[0.01, 0.02, 0.03], [0.015, 0.004, 0.02]])
    slots = torch.tensor([7, 0, 12, 3, 9])
    pages = [[torch.zeros(4, 4, 3, 8, dtype=E4M3) for _ in range(2)] for _ in range(3)]
    write_kv(key, value, *pages[0], slots, kv_scale)
    write_kv(key, value, *pages[1], slots, kv_scale, kernel=kernel)
    write_kv(*e4m3_codes(key, value, kv_scale), *pages[2], slots, kernel=kernel)
    for got in pages[1:]:
        for a, b in zip(pages[0], got):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert pages[0][0].view(torch.uint8).any()
