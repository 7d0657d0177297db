"""The MoE routing kernels against torch: softmax + top-k for the expert choice, a stable sort for the layout.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), so shapes stay small.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from metronome.models.moe_routing_triton import max_row_tiles, route, select_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _distinct_logits(t, e, seed=0, dtype=torch.float32):
    """Router logits with no ties within a row (a permutation of spaced values), so the top k is unique."""
    g = torch.Generator().manual_seed(seed)
    values = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).float() * 0.25 - e / 8
    return values.to(DEVICE, dtype)


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (37, 128, 8), (20, 60, 4), (5, 6, 2), (3, 8, 8), (17, 60, 3),
                                   (33, 128, 6)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_matches_softmax_topk(t, e, k, renormalize):
    logits = _distinct_logits(t, e, seed=t + e)
    ids, weights = select_experts(logits, k, renormalize)
    probs = torch.softmax(logits.double(), dim=-1)
    want_w, want_ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert ids.dtype == torch.int32 and torch.equal(ids.long().cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.double().cpu(), want_w.cpu(), atol=1e-6, rtol=1e-5)


def test_select_experts_keeps_the_logits_dtype_and_breaks_ties_to_the_lower_id():
    logits = torch.zeros(2, 16, device=DEVICE, dtype=torch.bfloat16)
    logits[0, [3, 9, 12]] = 1.0                 # three equal leaders, two places
    logits[1, 5] = 2.0
    ids, weights = select_experts(logits, 2, renormalize=True)
    assert weights.dtype == torch.bfloat16
    assert ids.cpu().tolist() == [[3, 9], [5, 0]]
    torch.testing.assert_close(weights[0].float().cpu(), torch.tensor([0.5, 0.5]))
    assert torch.isfinite(weights.float()).all() and weights[1, 0] > weights[1, 1]


def test_a_row_of_nan_or_inf_logits_still_chooses_experts_in_range():
    """A captured round's padding rows may hold anything; their ids must not reach past the experts."""
    logits = _distinct_logits(3, 60)
    logits[0] = float("nan")
    logits[2, 7] = float("inf")
    ids, _ = select_experts(logits, 4, renormalize=True)
    assert ((ids >= 0) & (ids < 60)).all()
    r = route(ids, 60, 16)
    assert r.count.sum().item() == ids.numel() and sorted(r.order.tolist()) == list(range(ids.numel()))


def test_route_leaves_ids_out_of_range_out_of_every_experts_count():
    ids = torch.tensor([[0, 9], [2, -1], [2, 0]], device=DEVICE)   # 9 and -1: no such expert of 4
    r = route(ids, 4, 16)
    assert r.count.cpu().tolist() == [2, 0, 2, 0]
    assert r.order[:4].cpu().tolist() == [0, 5, 2, 4]


def test_select_experts_refuses_more_experts_than_there_are():
    with pytest.raises(ValueError, match="cannot choose"):
        select_experts(torch.zeros(1, 4, device=DEVICE), 5, True)


def _choices(t, e, k, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if skew:  # most tokens pick the same few experts: several row tiles per expert, many experts idle
        logits[:, :3] += 4.0
    return logits.topk(k, -1).indices.to(DEVICE)


@pytest.mark.parametrize("t,e,k,bm,skew", [
    (25, 6, 3, 4, True),
    (1, 128, 8, 16, False),
    (300, 8, 8, 16, True),      # 2,400 assignments: more than one of the kernel's loop steps (ROUTE_BLOCK)
    (7, 5, 2, 32, False),
])
def test_route_is_a_stable_sort_by_expert_within_the_tile_bound(t, e, k, bm, skew):
    ids = _choices(t, e, k, seed=t, skew=skew)
    r = route(ids, e, bm)
    flat = ids.reshape(-1).cpu()
    count = torch.bincount(flat, minlength=e)
    assert r.count.cpu().tolist() == count.tolist()
    assert r.start.cpu().tolist() == (torch.cumsum(count, 0) - count).tolist()
    assert r.order.long().cpu().tolist() == torch.argsort(flat, stable=True).tolist()
    tiles = (count + bm - 1) // bm
    assert r.tile_start.cpu().tolist() == (torch.cumsum(tiles, 0) - tiles).tolist()
    tile_expert = r.tile_expert.cpu()
    assert tile_expert.numel() == max_row_tiles(flat.numel(), e, bm) >= int(tiles.sum())
    assert tile_expert[:int(tiles.sum())].tolist() == torch.repeat_interleave(torch.arange(e), tiles).tolist()
    assert (tile_expert[int(tiles.sum()):] == e).all()                 # the spare tiles return at once


def test_route_takes_int64_choices_as_torch_topk_gives_them():
    ids = _choices(9, 4, 2, seed=3)
    assert ids.dtype == torch.int64
    assert route(ids, 4, 16).order.long().cpu().tolist() == torch.argsort(ids.reshape(-1).cpu(), stable=True).tolist()
