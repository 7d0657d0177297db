"""Token sampling for a batch of rows, each with its own parameters; greedy rows never draw."""

from __future__ import annotations

import torch

from metronome.engine.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator | None) -> list[int]:
    """One token per row of ``logits`` [n, vocab] (float32)."""
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        rows = torch.tensor(drawn, device=logits.device)
        x = logits[rows] / torch.tensor([params[i].temperature for i in drawn], device=logits.device)[:, None]
        for j, i in enumerate(drawn):
            p = params[i]
            if p.top_k:
                kth = torch.topk(x[j], min(p.top_k, x.shape[-1])).values[-1]
                x[j] = x[j].masked_fill(x[j] < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_x, order = torch.sort(x[j], descending=True)
                cum = torch.softmax(sorted_x, -1).cumsum(-1)
                drop = cum - torch.softmax(sorted_x, -1) > p.top_p  # keep the token that crosses top_p
                x[j, order[drop]] = float("-inf")
        probs = torch.softmax(x, dim=-1)
        tokens[rows] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens.tolist()
