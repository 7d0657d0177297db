"""What one step takes and returns per session."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from metronome.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """``temperature=0`` is greedy. ``stop_token_ids`` end this step's decode early (``finished``)."""

    temperature: float = 0.0
    top_k: int = 0          # 0: no top-k cut
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


@dataclass
class StepInput:
    """One session's share of a step.

    The new input (``token_ids`` or ``embeds`` [n, hidden], at most ``max_chunk_tokens``) is
    prefilled, then up to ``max_new_tokens`` tokens are decoded. Decoded tokens join the context: the
    last one is fed at the start of the session's next step (a stop token that ended greedy rounds of a
    bounded session may have been fed already, read a round late; the context is the same).
    """

    session_id: int
    token_ids: Sequence[int] | None = None
    embeds: torch.Tensor | None = None
    max_new_tokens: int = 0
    prompt_logprobs: bool = False
    sampling: SamplingParams = GREEDY
    # Return the final-normed hidden state of the last input position (for models whose own heads
    # run outside the engine, e.g. Moshi's depth transformer); with max_new_tokens=0.
    return_hidden: bool = False


@dataclass
class StepOutput:
    """``prompt_logprobs[i]`` is log p(token_ids[i] | everything before); None for a session's first token."""

    session_id: int
    token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    finished: bool = False   # a stop token ended this step's decode
    preempted: bool = False  # Unbounded baseline: the KV pool ran dry, the session is waiting for room
    error: str | None = None
    hidden: torch.Tensor | None = None  # [hidden_size] when StepInput.return_hidden

    @property
    def ok(self) -> bool:
        return self.error is None
