"""What a step takes and returns per session, and the typed hand-offs inside a step.

The scheduler turns a step's inputs into a ``StepPlan`` and every forward into a ``ForwardPlan``; the
runner executes a ``ForwardPlan`` and returns a ``ForwardResult``, which the scheduler applies back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from metronome.errors import ConfigError

if TYPE_CHECKING:
    from metronome.engine.session import Session


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
    # The caller vouches that ``embeds`` hold no NaN or infinity: the engine skips its own check, whose result
    # the host must wait for before it can plan the step. Only for embeds made from no client-supplied floats
    # (sums of embedding-table rows, say): a NaN let through ruins that session's cache.
    embeds_finite: bool = False


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


# ---------------------------------------------------------------------- hand-offs inside a step
@dataclass(frozen=True)
class ScheduledInput:
    """An input the scheduler accepted: ``index`` is its place in the step's inputs."""

    index: int
    session: Session
    input: StepInput


@dataclass(frozen=True)
class StepPlan:
    """A step's inputs, sorted: those that run (in input order) and those refused, with why."""

    admitted: tuple[ScheduledInput, ...]
    errors: tuple[tuple[int, str], ...]   # (input index, reason)


@dataclass
class ForwardSegment:
    """One session's new tokens in a forward: ``token_ids`` then optional ``embeds`` rows.

    The runner reads the session (length, table, position base) and never writes it.
    """

    session: Session
    token_ids: list[int]
    embeds: torch.Tensor | None = None  # [n, hidden]

    def __len__(self) -> int:
        return len(self.token_ids) + (0 if self.embeds is None else int(self.embeds.shape[0]))


@dataclass(frozen=True)
class RebasePlan:
    """Keys to re-rotate before the forward: ``slots[i]`` moves by ``deltas[rows[i]]`` positions."""

    slots: np.ndarray            # [K] int64 flat cache slots
    rows: np.ndarray             # [K] int32 index into deltas
    deltas: tuple[int, ...]      # one negative shift per moving session
    sessions: tuple[int, ...] = ()  # the moving sessions' ids, one per delta


@dataclass(frozen=True)
class ForwardPlan:
    """One forward, as the scheduler decided it. Blocks for every segment are allocated already."""

    segments: tuple[ForwardSegment, ...]      # what runs, in order
    rebase: RebasePlan | None = None          # applied before the forward
    preempted: tuple[int, ...] = ()           # session ids preempted to make room (Unbounded baseline)
    release_below: tuple[int, ...] = ()       # per segment: window blocks below this go back after the forward

    @property
    def empty(self) -> bool:
        return not self.segments


@dataclass(frozen=True)
class ForwardResult:
    """What the runner returns: hidden states [T, hidden] and each segment's last row."""

    hidden: torch.Tensor
    last_rows: tuple[torch.Tensor, ...]
