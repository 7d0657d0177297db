"""transformers as the oracle: greedy continuation and windowed masked forwards in float64."""

from __future__ import annotations

import copy

import torch


def hf_greedy(model, context: list[int], n: int) -> list[int]:
    """Greedy continuation by full forwards: no EOS rule, no pad-token inference, no cache."""
    tokens = list(context)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(context):]


def sink_window_mask(length: int, sinks: int, window: int | None) -> torch.Tensor:
    t = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    allowed = j <= t
    if window is not None:
        allowed &= (j < sinks) | (j >= t - window)
    mask = torch.zeros(length, length, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    return mask[None, None]


def hf_windowed_logprobs(model, tokens: list[int], sinks: int, window: int | None) -> torch.Tensor:
    """log p(next token) at every position, float64, attention restricted to [0,S) ∪ [t-W,t]."""
    ref = copy.deepcopy(model).double()
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        logits = ref(torch.tensor([tokens]), attention_mask=sink_window_mask(len(tokens), sinks, window)).logits[0]
    return torch.log_softmax(logits, -1)
