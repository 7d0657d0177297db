"""E4M3 KV pages with per-head scales: the Triton kernel (interpreted on the CPU) and the torch reference
against the float64 masked softmax over the dequantised keys and values, and against the unquantised ones.

The caches come from ``build_case``: shuffled physical blocks, freed blocks NaN (E4M3 has a NaN, so a
single read of a freed block would still reach the output), sinks, windows ending mid-block.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from metronome.attention.fp8 import E4M3, CalibratingAttention, head_scales  # noqa: E402
from metronome.attention.reference import TorchPagedAttention, paged_attention_reference, plan_reference  # noqa: E402
from metronome.attention.triton_paged import TritonPagedAttention, paged_attention_triton, plan_triton  # noqa: E402
from tests.attention.test_reference import CASES, build_case, dense_oracle  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Both backends compute in float32 on exactly the dequantised values: only summation order differs.
TIGHT = dict(atol=2e-5, rtol=1e-4)


def e4m3_bound(query, seqs, dense, deq) -> float:
    """How far attention over the dequantised K/V can be from attention over the originals, per sequence.

    Logits move by at most ``d = max |q . (k' - k)| / sqrt(D)``, so every softmax weight by a factor within
    ``exp(±2d)``; the output, a convex mix of values, moves by at most ``max |v' - v| + (exp(2d) - 1) max |v|``.
    """
    bound, start = 0.0, 0
    for (ctx, qlen), (keys, values), (k2, v2) in zip(seqs, dense, deq):
        q = query[start:start + qlen].double()
        g = q.shape[1] // keys.shape[1]
        dk = (k2.double() - keys.double()).repeat_interleave(g, 1)
        d = torch.einsum("qhd,khd->qhk", q, dk).abs().max().item() / q.shape[-1] ** 0.5
        dv = (v2.double() - values.double()).abs().max().item()
        bound = max(bound, dv + (torch.tensor(2 * d).exp().item() - 1) * values.abs().max().item())
        start += qlen
    return bound


def _quantize(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The test's own E4M3 rounding, per KV head (NaN blocks stay NaN, the zero null block stays zero)."""
    return (cache / scale[:, None]).clamp(-448, 448).to(E4M3)


def _on_device(meta):
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(DEVICE) for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


def _fp8_case(name, heads=4, kv_heads=2, head_dim=16, seed=0):
    """Caches, queries, metadata and scales on the device; dense K/V (original and dequantised) on the CPU."""
    seqs, sinks, window, bs = CASES[name]
    meta, query, k_cache, v_cache, dense = build_case(seqs, sinks, window, bs, heads, kv_heads, head_dim, seed)
    # Scales with room to spare (2x the largest live element), as calibrated ones have.
    scale = torch.stack([torch.stack([keys.abs().amax((0, 2)) for keys, _ in dense]).amax(0),
                         torch.stack([values.abs().amax((0, 2)) for _, values in dense]).amax(0)]) * 2 / 448
    kq, vq = _quantize(k_cache, scale[0]), _quantize(v_cache, scale[1])
    deq = [((_quantize(k, scale[0]).float() * scale[0][:, None]), _quantize(v, scale[1]).float() * scale[1][:, None])
           for k, v in dense]
    return (seqs, sinks, window, _on_device(meta), query.to(DEVICE), kq.to(DEVICE), vq.to(DEVICE), scale.to(DEVICE),
            dense, deq)


def _oracle(query, seqs, sinks, window, dense):
    query, out, start = query.cpu(), [], 0
    for (ctx, qlen), (keys, values) in zip(seqs, dense):
        out.append(dense_oracle(query[start:start + qlen], keys, values, ctx - qlen, sinks, window))
        start += qlen
    return torch.cat(out)


@pytest.mark.parametrize("name", ["t<S", "t>>W", "window ends mid-block", "S=0 plain sliding window",
                                  "no window (causal)", "mixed prefill and decode"])
def test_triton_and_reference_match_float64_over_dequantised_kv(name):
    seqs, sinks, window, meta, query, kq, vq, scale, dense, deq = _fp8_case(name)
    want = _oracle(query, seqs, sinks, window, deq)
    ref = paged_attention_reference(query, kq, vq, plan_reference(meta, query.shape[1]), kv_scale=scale).cpu()
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(ref.double(), want, **TIGHT)
    # Unsplit, and split-KV partials combined (the value scale applies to each); then the decode launch with
    # tiles twice the prefill launch's, as the engine runs decode over E4M3 pages.
    for splits, decode_block_n in ((1, None), (3, None), (1, 32), (3, 32)):
        plan = plan_triton(meta, query.shape[1], kq.shape[2], block_n=16, decode_block_n=decode_block_n,
                           force_splits=splits)
        out = torch.full_like(query, float("nan"))
        paged_attention_triton(query, kq, vq, meta, plan=plan, out=out, kv_scale=scale)
        assert torch.isfinite(out).all(), "a freed (NaN) block or an unwritten row reached the output"
        torch.testing.assert_close(out.double().cpu(), want, **TIGHT)
    error = (ref.double() - _oracle(query, seqs, sinks, window, dense)).abs().max().item()
    assert 0 < error <= e4m3_bound(query.cpu(), seqs, dense, deq)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (32, 8, 128), (32, 4, 128)],
                         ids=["gqa3-d64", "qwen3-8b", "qwen3-30b-a3b"])
def test_fp8_kv_against_the_bf16_kernel(heads, kv_heads, head_dim):
    """bf16 queries: the FP8-KV kernel against the same kernel over bf16 pages. On a GPU the first two shapes widen
    their values where loaded (``widen_values_at_load``) and the last (8 query heads a KV head) leaves the cast to
    Triton."""
    seqs, sinks, window, meta, query, kq, vq, scale, dense, deq = _fp8_case(
        "mixed prefill and decode", heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=4)
    _, _, k_cache, v_cache, _ = build_case(seqs, sinks, window, 16, heads, kv_heads, head_dim, 4)
    q = query.to(torch.bfloat16)
    plan = plan_triton(meta, heads, kv_heads, block_n=32, force_splits=1)
    bf16 = paged_attention_triton(q, k_cache.to(DEVICE, torch.bfloat16), v_cache.to(DEVICE, torch.bfloat16), meta,
                                  plan=plan)
    fp8 = paged_attention_triton(q, kq, vq, meta, plan=plan, kv_scale=scale)
    assert torch.isfinite(fp8).all()
    # The E4M3 bound, plus bf16's own rounding of the inputs and the output (2**-8 relative, |o| < 2).
    bound = e4m3_bound(query.cpu(), seqs, dense, deq) + 2e-2
    error = (fp8.float() - bf16.float()).abs().max().item()
    assert error <= bound, (error, bound)


@pytest.mark.parametrize("heads,kv_heads", [(32, 4), (32, 8)], ids=["qwen3-30b-a3b", "qwen3-8b"])
def test_crowded_decode_launch_options_give_the_engines_output(heads, kv_heads):
    """The options a crowded decode launch can be timed with (bench/attention_gpu.py --crowded-stages,
    --widen-v-max-group; one SM, so every decode launch is crowded): 2-4 stages, capped at 128 registers or not,
    the values widened where loaded or not, all give the default launch's output over E4M3 pages."""
    seqs, sinks, window, meta, query, kq, vq, scale, dense, deq = _fp8_case(
        "mixed prefill and decode", heads=heads, kv_heads=kv_heads, head_dim=128, seed=5)
    q = query.to(torch.bfloat16)

    def run(**options):
        plan = plan_triton(meta, heads, kv_heads, num_sms=1, force_splits=1, **options)
        assert any(ln.crowded for ln in plan.launches)
        return paged_attention_triton(q, kq, vq, meta, plan=plan, kv_scale=scale)

    want = run()
    assert torch.isfinite(want).all()
    # The interpreter has no stages, register caps or widening (PTX): one variant checks the options reach the plan.
    variants = ([(s, r, w) for s in (2, 3, 4) for r in (None, 128) for w in (4, 8)] if DEVICE == "cuda"
                else [(3, 128, 8)])
    for stages, registers, widen in variants:
        got = run(crowded_stages=stages, max_registers=registers, widen_v_max_group=widen)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f"{stages} stages, cap {registers}, widen {widen}: {m}")


@pytest.mark.parametrize("backend", [TorchPagedAttention(4), TritonPagedAttention(4, num_kv_heads=2)],
                         ids=["torch", "triton"])
def test_backends_write_e4m3_saturating_and_calibrate(backend):
    seqs = [(10, 3)]
    meta, query, k_cache, v_cache, dense = build_case(seqs, 2, 4, 4)
    meta, query = _on_device(meta), query.to(DEVICE)
    keys, values = dense[0]
    new_k, new_v = keys[7:].clone(), values[7:].clone()
    new_k[0, 1, 0] = 1e6  # far past any scale: must saturate, not turn into inf or NaN
    kq, vq = k_cache.to(DEVICE, E4M3), v_cache.to(DEVICE, E4M3)
    scale = torch.full((2, 2), 0.05, device=DEVICE)
    backend(query, new_k.to(DEVICE), new_v.to(DEVICE), kq, vq, backend.prepare(meta), scale)
    slots = meta.slot_mapping.cpu()
    stored_k = kq.cpu().view(-1, 2, 16)[slots].float() * 0.05
    assert stored_k[0, 1, 0] == 448 * 0.05
    new_k[0, 1, 0] = stored_k[0, 1, 0]
    torch.testing.assert_close(stored_k, new_k, atol=0.05 * 2 ** -10, rtol=2 ** -4)
    torch.testing.assert_close(vq.cpu().view(-1, 2, 16)[slots].float() * 0.05, new_v, atol=0.05 * 2 ** -10,
                               rtol=2 ** -4)

    # Calibration: the scales become amax * 16 / 448 per head, set before this forward's keys are written.
    calibrating = CalibratingAttention(backend)
    calibrating(query, new_v.to(DEVICE), new_v.to(DEVICE), kq, vq, calibrating.prepare(meta), scale)
    scale = scale.cpu()
    torch.testing.assert_close(scale[0], new_v.abs().amax((0, 2)) * 16 / 448)
    torch.testing.assert_close(head_scales(new_v), scale[1])
    torch.testing.assert_close(kq.cpu().view(-1, 2, 16)[slots].float() * scale[0][:, None], new_v, rtol=2 ** -4,
                               atol=0)


def test_float8_caches_need_scales():
    seqs, sinks, window, meta, query, kq, vq, scale, _, _ = _fp8_case("t<S")
    with pytest.raises(ValueError, match="scales"):
        paged_attention_triton(query, kq, vq, meta)
    with pytest.raises(ValueError, match="scales"):
        paged_attention_triton(query, kq.float(), vq.float(), meta, kv_scale=scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="e4m3_to_f16 is PTX: it needs a compiled kernel on a GPU")
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (32, 32)], ids=["gqa4", "mha"])
def test_values_widened_where_loaded_equal_the_cast(heads, kv_heads, monkeypatch):
    """The widened values give the output the cast gives (the same fp16 values, summed in the same order)."""
    import metronome.attention.triton_paged as tp

    seqs, sinks, window, meta, query, kq, vq, scale, dense, deq = _fp8_case(
        "mixed prefill and decode", heads=heads, kv_heads=kv_heads, head_dim=128, seed=5)
    q = query.to(torch.bfloat16)
    plan = plan_triton(meta, heads, kv_heads, block_n=32, force_splits=1)
    assert tp.widen_values_at_load(True, True, q.dtype, heads // kv_heads)
    widened = paged_attention_triton(q, kq, vq, meta, plan=plan, kv_scale=scale)
    monkeypatch.setattr(tp, "WIDEN_V_MAX_GROUP", 0)
    cast = paged_attention_triton(q, kq, vq, meta, plan=plan, kv_scale=scale)
    torch.testing.assert_close(widened, cast, atol=1e-3, rtol=1e-3)
