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


class Transcript:
    """Everything one session was fed and produced, to check against the windowed oracle at the end."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.checks: list[tuple[int, int, float | None]] = []  # (position, token, prompt logprob or None)

    def record(self, chunk: list[int], out) -> None:
        self.checks.extend((len(self.tokens) + i, t, lp) for i, (t, lp) in enumerate(zip(chunk, out.prompt_logprobs)))
        self.tokens.extend(chunk)
        self.checks.extend((len(self.tokens) + i, t, None) for i, t in enumerate(out.token_ids))
        self.tokens.extend(out.token_ids)

    def assert_matches(self, model, sinks: int, window: int | None, abs: float) -> None:
        """Input logprobs equal the oracle's; generated tokens are the oracle's argmax."""
        import pytest

        ref = hf_windowed_logprobs(model, self.tokens, sinks, window)
        for pos, token, lp in self.checks:
            if pos == 0:
                continue
            if lp is None:
                assert ref[pos - 1].argmax().item() == token, f"generated token at {pos}"
            else:
                assert lp == pytest.approx(ref[pos - 1, token].item(), abs=abs), f"logprob at {pos}"
