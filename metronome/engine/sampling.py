"""Token sampling for a batch of rows, each with its own parameters; greedy rows never draw.

The rows that draw are filtered together: one sort serves top-k and top-p for all of them, then one
multinomial call draws every row's token.
"""

from __future__ import annotations

import torch

from metronome.engine.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator | None) -> list[int]:
    """One token per row of ``logits`` [n, vocab] (float32)."""
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        device = logits.device
        rows = torch.tensor(drawn, device=device)
        chosen = [params[i] for i in drawn]
        x = logits.index_select(0, rows) / torch.tensor([p.temperature for p in chosen], device=device)[:, None]
        vocab = x.shape[-1]
        top_k = torch.tensor([min(p.top_k, vocab) or vocab for p in chosen], device=device)
        top_p = torch.tensor([p.top_p for p in chosen], device=device)
        if (top_k < vocab).any() or (top_p < 1.0).any():
            x = filter_top_k_top_p(x, top_k, top_p)
        probs = torch.softmax(x, dim=-1)
        tokens[rows] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens.tolist()


def filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``x`` [m, vocab] with -inf outside each row's top ``top_k`` values (ties with the k-th kept), then outside
    the smallest set of those whose probability reaches ``top_p`` (the token that crosses it is kept)."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    kth = sorted_x.gather(1, (top_k - 1)[:, None])
    x = x.masked_fill(x < kth, float("-inf"))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    drop_sorted = (probs.cumsum(-1) - probs > top_p[:, None]) & (top_p < 1.0)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))
