"""The fused Triton RoPE (interpreted on the CPU) against the eager rotate-half implementation."""

import pytest
import torch

from metronome.models.rope import Rotary

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("qh,kh,d", [(4, 2, 16), (7, 1, 64), (3, 3, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_matches_eager(qh, kh, d, dtype):
    from metronome.models.rope_triton import rope_qk_

    torch.manual_seed(0)
    rope = Rotary(tuple((1.0 / 10000 ** (torch.arange(0, d, 2) / d)).tolist()), 1.0, DEVICE)
    positions = torch.tensor([0, 5, 17, 1000, 4095], device=DEVICE)
    qkv = torch.randn(5, (qh + 2 * kh) * d, device=DEVICE, dtype=dtype)
    q, k, _ = qkv.split((qh * d, kh * d, kh * d), dim=-1)
    q, k = q.reshape(5, qh, d), k.reshape(5, kh, d)   # strided views into the fused projection, as in the model
    cos, sin = rope.cos_sin(positions)
    want_q, want_k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
    rope_qk_(q, k, positions, rope.inv_freq)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)


@pytest.mark.parametrize("qh,kh,d", [(4, 2, 16), (3, 1, 24), (32, 4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_norms_then_rope_match_rms_norm_and_eager_rope(qh, kh, d, dtype):
    """Qwen3's per-head q/k RMSNorms folded into the RoPE pass, against float64 RMSNorm and the eager rotation
    (head_dim 24: a half that is not a power of two, masked lanes kept out of the mean)."""
    from metronome.models.rope_triton import rope_qk_

    torch.manual_seed(2)
    eps = 1e-6
    rope = Rotary(tuple((1.0 / 10000 ** (torch.arange(0, d, 2) / d)).tolist()), 1.0, DEVICE)
    positions = torch.tensor([0, 3, 99, 2047], device=DEVICE)
    qkv = (torch.randn(4, (qh + 2 * kh) * d, device=DEVICE) * 3).to(dtype)
    q, k, v = qkv.split((qh * d, kh * d, kh * d), dim=-1)
    q, k = q.reshape(4, qh, d), k.reshape(4, kh, d)
    q[1, 0] = 1e-4   # a tiny head: eps decides its scale
    q_weight, k_weight = (torch.rand(d, device=DEVICE) + 0.5).to(dtype), (torch.rand(d, device=DEVICE) + 0.5).to(dtype)
    v_before = v.clone()
    cos, sin = (c.double() for c in rope.cos_sin(positions))

    def want(x, w):
        normed = torch.nn.functional.rms_norm(x.double(), (d,), w.double(), eps)
        return Rotary.apply(normed, cos, sin)

    want_q, want_k = want(q, q_weight), want(k, k_weight)
    rope_qk_(q, k, positions, rope.inv_freq, norms=(q_weight, k_weight, eps))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(q.double(), want_q, **tol)
    torch.testing.assert_close(k.double(), want_k, **tol)
    assert torch.equal(v, v_before)   # the projection's values, beside q and k, are left alone


@pytest.mark.parametrize("kh,d", [(2, 16), (1, 64), (3, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rerotated_keys_match_the_eager_shift_and_nothing_else_moves(kh, d, dtype):
    """The in-place Triton re-rotation of stored keys (rebasing windows) against ``Rotary.apply`` with
    ``shift_tables``: keys of several sessions, each moved by its own delta; other slots stay bitwise."""
    from metronome.models.rope_triton import rerotate_keys_

    torch.manual_seed(1)
    rope = Rotary(tuple((1.0 / 10000 ** (torch.arange(0, d, 2) / d)).tolist()), 1.0, DEVICE)
    cache = torch.randn(9, 4, kh, d, device=DEVICE).to(dtype)   # 9 blocks of 4 slots
    before = cache.clone()
    slots = torch.tensor([3, 4, 5, 17, 30, 31, 2], device=DEVICE)   # three sessions' keys, anywhere
    rows = torch.tensor([0, 0, 0, 1, 2, 2, 1], dtype=torch.int32, device=DEVICE)
    deltas = torch.tensor([-256, -4096, -1], device=DEVICE)
    cos, sin = rope.shift_tables(deltas)
    flat = before.view(-1, kh, d)
    want = Rotary.apply(flat[slots], cos[rows.long()], sin[rows.long()])
    rerotate_keys_(cache, slots, rows, cos[:, : d // 2].contiguous(), sin[:, : d // 2].contiguous())
    got = cache.view(-1, kh, d)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[slots], want, **tol)
    untouched = torch.ones(got.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(got[untouched], flat[untouched])
