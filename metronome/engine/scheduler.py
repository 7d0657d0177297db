"""KV bookkeeping around forwards: admission, block allocation, release, rebasing, preemption.

Bounded sessions reserve ``blocks_per_session`` blocks at admission, so allocation cannot fail for
them. The Unbounded baseline reserves nothing; when the pool runs dry the newest session is
preempted by recompute, as vLLM v1 does: its KV is freed, its history is kept, and it is
re-prefilled once room returns. That baseline exists to reproduce today's failure ("the cliff").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import count

import torch

from metronome.config import KVPolicy
from metronome.engine.blocks import BlockPool, blocks_per_session, cdiv, sink_block_count
from metronome.engine.policy import retention_for
from metronome.engine.session import HistorySegment, Session, SessionStatus
from metronome.errors import AdmissionError, ConfigError

log = logging.getLogger(__name__)


@dataclass
class ForwardSegment:
    """One session's new tokens in a forward: ``token_ids`` then optional ``embeds`` rows."""

    session: Session
    token_ids: list[int]
    embeds: torch.Tensor | None = None  # [n, hidden]

    def __len__(self) -> int:
        return len(self.token_ids) + (0 if self.embeds is None else int(self.embeds.shape[0]))


class InvariantError(AssertionError):
    """The engine's own bookkeeping is inconsistent (a bug, never a user error)."""


class Scheduler:
    def __init__(self, policy: KVPolicy, pool: BlockPool, max_chunk_tokens: int, max_model_len: int,
                 max_batch_tokens: int) -> None:
        self.policy = policy
        self.pool = pool
        self.retention = retention_for(policy)
        self.max_model_len = max_model_len
        self.max_batch_tokens = max_batch_tokens
        self.max_chunk_tokens = max_chunk_tokens
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
            return self.pool.usable // cdiv(self.max_chunk_tokens + 1, self.policy.block_size)
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
            need = cdiv(self.max_chunk_tokens + 1, self.policy.block_size)
            if self.pool.free_count < need:
                raise AdmissionError(f"KV pool full: {self.pool.free_count} free blocks, a new session needs {need}")
        session = Session(session_id=next(self._ids), reservation=need if self.policy.bounded else 0,
                          sink_count=sink_block_count(self.policy), block_size=self.policy.block_size,
                          opened_seq=next(self._admissions), positions=positions)
        self.sessions[session.session_id] = session
        return session

    def check_rebased_fits(self) -> None:
        """Rebased positions stay below sinks + window + Δ + chunk + 1; the model must have that many."""
        p = self.policy
        peak = p.sinks + p.window + p.rebase_interval + self.max_chunk_tokens + 1
        if peak > self.max_model_len:
            raise ConfigError(
                f"rebased positions would reach sinks + window + rebase interval + chunk + 1 = {peak}, "
                f"beyond the model's {self.max_model_len} positions; shrink the window or the chunk")

    def close(self, session: Session) -> None:
        self._release_all(session)
        self.pool.unreserve(session.reservation)
        del self.sessions[session.session_id]

    # ------------------------------------------------------------------ per forward
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

    def rebase_delta(self, session: Session) -> int:
        """How far to move the window's positions back before the next append (0: not yet)."""
        if session.positions != "rebased":
            return 0
        interval = self.policy.rebase_interval
        span = session.num_tokens - session.position_base - (self.policy.sinks + self.policy.window)
        return (span // interval) * interval if span >= interval else 0

    def allocate(self, segments: list[ForwardSegment]) -> tuple[list[ForwardSegment], list[Session]]:
        """Give every segment's session blocks for its new tokens.

        Returns the segments that can run and the sessions preempted on the way (Unbounded only).
        """
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

    def commit(self, segments: list[ForwardSegment]) -> None:
        """After a forward: advance lengths, release blocks that left the window."""
        for seg in segments:
            session = seg.session
            session.num_tokens += len(seg)
            for block in session.release_window_blocks_below(self.retention.releasable_until(session.num_tokens)):
                self.pool.release(block)

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

    def restore_blocks_needed(self, session: Session, extra_tokens: int) -> int:
        return cdiv(sum(len(h) for h in session.history) + extra_tokens, self.policy.block_size)

    def record_history(self, session: Session, seg: ForwardSegment) -> None:
        if not self.policy.bounded:
            if seg.token_ids:
                session.history.append(HistorySegment(token_ids=list(seg.token_ids)))
            if seg.embeds is not None:
                session.history.append(HistorySegment(embeds=seg.embeds))

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
