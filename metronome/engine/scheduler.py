"""The scheduler: the only code that changes a ``Session``.

It admits sessions, turns a step's inputs into a ``StepPlan`` and every forward into a ``ForwardPlan``
(rebases, block allocation, releases), and applies the runner's ``ForwardResult`` back
(``update_from_output``). Bounded sessions reserve ``blocks_per_session`` blocks at admission, so
allocation cannot fail for them. The Unbounded baseline reserves nothing; when the pool runs dry the
newest session is preempted by recompute, as vLLM v1 does: its KV is freed, its history kept, and it
is re-prefilled once room returns. That baseline reproduces today's failure ("the cliff").
"""

from __future__ import annotations

import logging
import numbers
from itertools import count
from typing import Sequence

import torch

from metronome.config import KVPolicy
from metronome.engine.blocks import BlockPool, blocks_per_session, cdiv
from metronome.engine.policy import retention_for
from metronome.engine.request import (ForwardPlan, ForwardResult, ForwardSegment, RebasePlan, SamplingParams,
                                      ScheduledInput, StepInput, StepPlan)
from metronome.engine.session import HistorySegment, Session, SessionStatus, window_slots
from metronome.errors import AdmissionError, ConfigError

log = logging.getLogger(__name__)

__all__ = ["ForwardSegment", "InvariantError", "Scheduler"]


class InvariantError(AssertionError):
    """The engine's own bookkeeping is inconsistent (a bug, never a user error)."""


class Scheduler:
    def __init__(self, policy: KVPolicy, pool: BlockPool, max_chunk_tokens: int, max_model_len: int,
                 max_batch_tokens: int, vocab_size: int | None = None, hidden_size: int | None = None) -> None:
        self.policy = policy
        self.pool = pool
        self.retention = retention_for(policy)
        self.max_model_len = max_model_len
        self.max_batch_tokens = max_batch_tokens
        self.max_chunk_tokens = max_chunk_tokens
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.session_blocks = blocks_per_session(policy, max_chunk_tokens, max_model_len)
        self.sessions: dict[int, Session] = {}
        self._ids = count(1)
        self._admissions = count()

    # ------------------------------------------------------------------ admission
    @property
    def capacity(self) -> int:
        """The memory cap reported upstream: sessions the pool holds at their worst case.

        The Unbounded baseline admits the way today's engines do, so its cap is the sessions whose
        first chunk fits (it overcommits on purpose: that is the failure it reproduces).
        """
        if not self.policy.bounded:
            return self.pool.usable // self.retention.first_chunk_blocks(self.max_chunk_tokens)
        return self.pool.usable // self.session_blocks

    def admit(self, positions: str | None = None) -> Session:
        positions = positions or self.policy.positions
        if positions not in ("absolute", "rebased"):
            raise ConfigError(f"positions must be 'absolute' or 'rebased', got {positions!r}")
        if positions == "rebased" and not self.policy.bounded:
            raise ConfigError("positions='rebased' needs a window; an unbounded cache keeps absolute positions")
        if positions == "rebased":
            self.check_rebased_fits()
        if self.policy.bounded:
            need = self.session_blocks
            if not self.pool.can_reserve(need):
                raise AdmissionError(
                    f"KV pool full: a session reserves {need} blocks and only "
                    f"{self.pool.usable - self.pool.reserved} of {self.pool.usable} are unreserved "
                    f"({len(self.sessions)} sessions open, capacity {self.capacity})")
            self.pool.reserve(need)
        else:
            need = self.retention.first_chunk_blocks(self.max_chunk_tokens)
            if self.pool.free_count < need:
                raise AdmissionError(f"KV pool full: {self.pool.free_count} free blocks, a new session needs {need}")
        session = Session(session_id=next(self._ids), reservation=need if self.policy.bounded else 0,
                          sink_count=self.retention.sink_blocks, block_size=self.policy.block_size,
                          opened_seq=next(self._admissions), positions=positions)
        self.sessions[session.session_id] = session
        return session

    def check_rebased_fits(self) -> None:
        """Rebased positions stay below sinks + window + Δ + chunk + 1; the model must have that many."""
        peak = self.retention.rebased_peak_position(self.policy.rebase_interval, self.max_chunk_tokens)
        if peak > self.max_model_len:
            raise ConfigError(
                f"rebased positions would reach sinks + window + rebase interval + chunk + 1 = {peak}, "
                f"beyond the model's {self.max_model_len} positions; shrink the window or the chunk")

    def close(self, session: Session) -> None:
        self._release_all(session)
        self.pool.unreserve(session.reservation)
        del self.sessions[session.session_id]

    # ------------------------------------------------------------------ per step
    def schedule_step(self, inputs: Sequence[StepInput]) -> StepPlan:
        """Check every input; the accepted ones run in input order, the others are refused with a reason."""
        admitted: dict[int, ScheduledInput] = {}
        errors = []
        nonfinite = self._nonfinite_embeds(inputs)
        for i, inp in enumerate(inputs):
            error = self._validate(inp, admitted, i in nonfinite)
            if error:
                errors.append((i, error))
                log.warning("step input for session %s refused: %s", inp.session_id, error)
            else:
                admitted[inp.session_id] = ScheduledInput(i, self.sessions[inp.session_id], inp)
        return StepPlan(tuple(admitted.values()), tuple(errors))

    def _nonfinite_embeds(self, inputs: Sequence[StepInput]) -> set[int]:
        """The indices of the inputs whose embeds hold a NaN or an infinity: a reduction per input and one
        transfer per device for the whole step (a transfer per input would wait on the device once per session).
        Embeds their caller vouches for (``embeds_finite``) are not read."""
        by_device: dict[torch.device, list[int]] = {}
        for i, inp in enumerate(inputs):
            if inp.embeds is not None and not inp.embeds_finite and self._embeds_shape_error(inp.embeds) is None:
                by_device.setdefault(inp.embeds.device, []).append(i)
        bad: set[int] = set()
        for group in by_device.values():
            finite = torch.stack([torch.isfinite(inputs[i].embeds).all() for i in group]).tolist()
            bad.update(i for i, ok in zip(group, finite) if not ok)
        return bad

    def _validate(self, inp: StepInput, seen, nonfinite: bool) -> str | None:
        session = self.sessions.get(inp.session_id)
        if session is None:
            return f"unknown session {inp.session_id}"
        if inp.session_id in seen:
            return f"session {inp.session_id} appears more than once in one step"
        if session.status is SessionStatus.FAILED:
            return f"session {inp.session_id} has ended: {session.error}"
        if not isinstance(inp.sampling, SamplingParams):
            return "sampling must be a SamplingParams"
        if not isinstance(inp.max_new_tokens, numbers.Integral) or inp.max_new_tokens < 0:
            return f"max_new_tokens must be an integer >= 0, got {inp.max_new_tokens!r}"
        if inp.token_ids is not None and inp.embeds is not None:
            return "give token_ids or embeds, not both"
        if inp.return_hidden and inp.max_new_tokens:
            return "return_hidden needs max_new_tokens=0 (the hidden state of the last input position)"
        n = 0
        if inp.token_ids is not None:
            ids = inp.token_ids
            n = len(ids)
            vocab = self.vocab_size
            for t in ids:
                if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab:
                    return f"token id {t!r} is not an integer in [0, {vocab})"
        if inp.embeds is not None:
            error = self._embeds_shape_error(inp.embeds)
            if error:
                return error
            if nonfinite:
                return "embeds contain NaN or infinite values"
            n = int(inp.embeds.shape[0])
        if n > self.max_chunk_tokens:
            return f"chunk of {n} tokens exceeds max_chunk_tokens={self.max_chunk_tokens}"
        if inp.return_hidden and n == 0 and session.pending_token is None and not session.stop_written:
            return "return_hidden needs new input this step (its hidden state is the last input position's)"
        if (inp.max_new_tokens > 0 and n == 0 and session.pending_token is None
                and session.last_hidden is None and not session.history):
            return "nothing to decode from: the session has no context yet; send input first"
        return None

    def _embeds_shape_error(self, e) -> str | None:
        if not isinstance(e, torch.Tensor) or e.dim() != 2 or e.shape[1] != self.hidden_size:
            shape = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
            return f"embeds must be a tensor of shape [n, {self.hidden_size}], got {shape}"
        if e.shape[0] == 0:
            return "embeds must have at least one row (send embeds=None for no new input)"
        return None

    def segment(self, session: Session, token_ids: list[int],
                embeds: torch.Tensor | None = None) -> tuple[ForwardSegment | None, str | None]:
        """The session's next segment, or its error if it would pass the position limit (it then ends)."""
        seg = ForwardSegment(session, token_ids, embeds)
        error = self.position_error(session, len(seg))
        if error:
            self.fail(session, error)
            return None, error
        self.record_history(session, seg)
        return seg, None

    def consume_pending(self, session: Session) -> None:
        """The token sampled last step now leads this step's input."""
        session.pending_token = None

    def clear_stop_written(self, session: Session) -> None:
        """This step's first hidden state follows the stop token written last step."""
        session.stop_written = False

    def finish_step(self, session: Session, last_token: int | None, stop_written: bool = False) -> None:
        """The token sampled and not yet fed joins the context next step; ``stop_written``: it was fed already."""
        if stop_written:
            session.stop_written = True
        if last_token is not None:
            session.pending_token = last_token

    def pack(self, segments: list[ForwardSegment]) -> list[list[ForwardSegment]]:
        """Split segments into forwards of at most ``max_batch_tokens`` tokens, keeping order."""
        batches, batch, size = [], [], 0
        for seg in segments:
            if batch and size + len(seg) > self.max_batch_tokens:
                batches.append(batch)
                batch, size = [], 0
            batch.append(seg)
            size += len(seg)
        if batch:
            batches.append(batch)
        return batches

    def position_error(self, session: Session, num_new: int) -> str | None:
        """Why appending ``num_new`` tokens is impossible under absolute positions, else None."""
        if session.positions == "rebased":
            return None
        if session.num_tokens + num_new > self.max_model_len:
            return (f"position limit reached: the session holds {session.num_tokens} tokens and "
                    f"{num_new} more would pass the model's limit of {self.max_model_len} positions "
                    f"(use positions='rebased' to run past it)")
        return None

    # ------------------------------------------------------------------ per forward
    def rebase_delta(self, session: Session) -> int:
        """How far to move the window's positions back before the next append (0: not yet)."""
        if session.positions != "rebased":
            return 0
        return self.retention.rebase_delta(session.num_tokens, session.position_base, self.policy.rebase_interval)

    def schedule_forward(self, segments: list[ForwardSegment]) -> ForwardPlan:
        """Rebase, then give every segment's session blocks for its new tokens.

        Segments of sessions preempted on the way (Unbounded only) are dropped from the plan.
        """
        rebase = self._schedule_rebase(segments)
        kept, preempted = self._allocate(segments)
        release = tuple(self.retention.releasable_until(seg.session.num_tokens + len(seg)) for seg in kept)
        return ForwardPlan(tuple(kept), rebase, tuple(s.session_id for s in preempted), release)

    def _schedule_rebase(self, segments: list[ForwardSegment]) -> RebasePlan | None:
        """Move each rebasing session's attendable window keys back by its delta: the keys' slots for the
        runner to re-rotate by ``R(-delta)``, and the session's new position base."""
        spans, deltas, moves, moving = [], [], [], []
        for seg in segments:
            session = seg.session
            delta = self.rebase_delta(session)
            if not delta:
                continue
            moves.append((session, delta))
            lo = self.retention.oldest_attended_token(session.num_tokens)
            if lo < session.num_tokens:
                spans.append((session, lo, session.num_tokens))
                deltas.append(-delta)
                moving.append(session.session_id)
        plan = None
        if spans:
            slots, rows = window_slots(spans, self.policy.block_size)
            plan = RebasePlan(slots, rows, tuple(deltas), tuple(moving))
        for session, delta in moves:
            session.position_base += delta
        return plan

    def _allocate(self, segments: list[ForwardSegment]) -> tuple[list[ForwardSegment], list[Session]]:
        kept, preempted = [], []
        for seg in segments:
            session = seg.session
            if session.status is not SessionStatus.ACTIVE:
                continue  # preempted earlier in this loop to make room
            need = session.blocks_needed_for(session.num_tokens + len(seg))
            while self.pool.free_count < need:
                if self.policy.bounded:
                    raise InvariantError(f"pool exhausted under reservation ({self.pool.free_count} free, need {need})")
                holders = [s for s in self.sessions.values() if s.status is SessionStatus.ACTIVE and s.live_blocks]
                victim = max(holders, key=lambda s: s.opened_seq) if holders else session
                self.preempt(victim)
                preempted.append(victim)
                if victim is session:
                    break
            if session.status is not SessionStatus.ACTIVE:
                continue
            for _ in range(need):
                session.append_block(self.pool.allocate())
            kept.append(seg)
        kept = [seg for seg in kept if seg.session.status is SessionStatus.ACTIVE]
        return kept, preempted

    def update_from_output(self, plan: ForwardPlan, result: ForwardResult) -> None:
        """After a forward: advance lengths, release blocks that left the window, keep each last hidden state."""
        for seg, below in zip(plan.segments, plan.release_below):
            session = seg.session
            session.num_tokens += len(seg)
            for block in session.release_window_blocks_below(below):
                self.pool.release(block)
        for seg, row in zip(plan.segments, result.last_rows):
            seg.session.last_hidden = row

    # ------------------------------------------------------------------ session endings
    def _release_all(self, session: Session) -> None:
        for block in session.release_all():
            self.pool.release(block)

    def fail(self, session: Session, reason: str) -> None:
        self._release_all(session)
        session.status, session.error = SessionStatus.FAILED, reason
        session.history.clear()
        log.warning("session %d ended: %s", session.session_id, reason)

    def preempt(self, session: Session) -> None:
        """Unbounded baseline: drop the KV, keep the history, recompute later."""
        self._release_all(session)
        session.num_tokens = 0
        session.last_hidden = None
        session.status = SessionStatus.PREEMPTED
        log.info("preempted session %d (pool dry, %d history tokens to recompute)",
                 session.session_id, sum(len(h) for h in session.history))

    def restore(self, session: Session, extra_tokens: int) -> list[ForwardSegment] | None:
        """Unbounded baseline: if the pool has room for a preempted session's history plus ``extra_tokens``,
        make it active again and return the segments that recompute its history (None: no room yet)."""
        if self.pool.free_count < cdiv(sum(len(h) for h in session.history) + extra_tokens, self.policy.block_size):
            return None
        session.status = SessionStatus.ACTIVE
        limit, segments = self.max_batch_tokens, []
        for piece in session.history:
            for start in range(0, len(piece), limit):
                ids = piece.token_ids[start:start + limit] if piece.token_ids is not None else []
                emb = piece.embeds[start:start + limit] if piece.embeds is not None else None
                segments.append(ForwardSegment(session, ids, emb))
        return segments

    def record_history(self, session: Session, seg: ForwardSegment) -> None:
        if not self.policy.bounded:
            if seg.token_ids:
                session.history.append(HistorySegment(token_ids=list(seg.token_ids)))
            if seg.embeds is not None:
                # A view of a larger tensor (a tick's rows spliced at once) would keep all of it alive.
                embeds = seg.embeds
                if embeds.untyped_storage().nbytes() > embeds.numel() * embeds.element_size():
                    embeds = embeds.clone()
                session.history.append(HistorySegment(embeds=embeds))

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        held = 0
        for s in self.sessions.values():
            held += s.live_blocks
            if s.live_blocks > self.session_blocks:
                raise InvariantError(f"session {s.session_id} holds {s.live_blocks} blocks > {self.session_blocks}")
            if self.policy.bounded and s.live_blocks > s.reservation:
                raise InvariantError(f"session {s.session_id} holds {s.live_blocks} > reserved {s.reservation}")
        if held != self.pool.used:
            raise InvariantError(f"sessions hold {held} blocks but the pool counts {self.pool.used} in use")
        if self.pool.reserved > self.pool.usable:
            raise InvariantError(f"reserved {self.pool.reserved} > usable {self.pool.usable}")
