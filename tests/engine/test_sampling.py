"""Batched sampling: every row keeps exactly the tokens its own parameters allow, computed in float64 one row
at a time from the definitions; greedy rows take the argmax; draws follow the filtered distribution."""

from __future__ import annotations

import torch

from metronome.engine.request import SamplingParams
from metronome.engine.sampling import filter_top_k_top_p, sample


def allowed(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The definition: the top_k largest logits, then the most likely of those until top_p is reached."""
    x = row.double() / p.temperature
    order = sorted(range(len(x)), key=lambda i: -x[i].item())
    keep = order[:p.top_k] if p.top_k else order
    if p.top_p < 1.0:
        probs = torch.softmax(x[keep], 0)
        total, cut = 0.0, []
        for i, prob in zip(keep, probs.tolist()):
            cut.append(i)
            total += prob
            if total >= p.top_p:
                break
        keep = cut
    return set(keep)


def test_each_row_keeps_what_its_own_parameters_allow():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    params = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.5, top_p=0.6),
              SamplingParams(temperature=2.0, top_k=10, top_p=0.3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.7, top_k=80, top_p=0.95)]
    x = logits / torch.tensor([p.temperature for p in params])[:, None]
    top_k = torch.tensor([min(p.top_k, 50) or 50 for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    kept = torch.isfinite(filter_top_k_top_p(x, top_k, top_p))
    for i, p in enumerate(params):
        assert set(kept[i].nonzero().flatten().tolist()) == allowed(logits[i], p), f"row {i}: {p}"


def test_greedy_rows_take_the_argmax_and_drawn_rows_stay_in_their_set():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=gen)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=3), SamplingParams(),
              SamplingParams(temperature=1.0, top_p=0.5)]
    sets = [allowed(logits[i], p) for i, p in enumerate(params)]
    assert 1 < len(sets[3]) < 30
    seen = [set() for _ in params]
    for _ in range(200):
        for i, token in enumerate(sample(logits, params, gen)):
            seen[i].add(token)
    assert seen[0] == {int(logits[0].argmax())} and seen[2] == {int(logits[2].argmax())}
    assert seen[1] == sets[1] and seen[3] <= sets[3] and len(seen[3]) > 1


def test_draws_follow_the_tempered_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    gen = torch.Generator().manual_seed(2)
    p = SamplingParams(temperature=0.8)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample(logits, [p], gen)[0]] += 1
    expect = torch.softmax(logits[0].double() / 0.8, 0)
    assert torch.allclose(counts.double() / 4000, expect, atol=0.03)
