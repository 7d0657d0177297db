"""Per-session state: length, a compact logical→physical block table, RoPE position base.

The table is compact so per-session state stays O(S + W) however old the session is:

    logical blocks  [0 .. sink_count)                 -> sink_blocks (pinned)
    logical blocks  [sink_count .. window_first)      -> freed (None)
    logical blocks  [window_first .. next_logical)    -> window_blocks

>>> s = Session(session_id=1, reservation=8, sink_count=1, block_size=4, opened_seq=0)
>>> for b in (10, 11, 12, 13): s.append_block(b)
>>> s.num_tokens = 16
>>> s.release_window_blocks_below(3)      # logical blocks 1 and 2 leave the window
[11, 12]
>>> [s.physical(b) for b in range(4)]
[10, None, None, 13]
>>> s.table_row()
[10, 13]
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch


class SessionStatus(enum.Enum):
    ACTIVE = "active"
    PREEMPTED = "preempted"  # Unbounded baseline only: KV dropped, history kept for recompute
    FAILED = "failed"        # ended with an error (e.g. position limit); KV released


@dataclass
class HistorySegment:
    """Input the session has consumed, kept only by the Unbounded baseline for recompute."""

    token_ids: list[int] | None = None
    embeds: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else int(self.embeds.shape[0])


@dataclass
class Session:
    session_id: int
    reservation: int          # blocks reserved at admission (0 for the Unbounded baseline)
    sink_count: int           # logical blocks pinned for the sinks
    block_size: int
    opened_seq: int           # admission order; the Unbounded baseline preempts the newest first
    positions: str = "absolute"  # "absolute" or "rebased" (see KVPolicy)
    num_tokens: int = 0       # tokens written to the cache so far (logical length)
    position_base: int = 0    # rebased mode: window token j sits at RoPE position j - position_base
    pending_token: int | None = None       # sampled last step, joins the context next step
    # The stop token that ended the last step was written already (pipelined rounds read stops a round late):
    # the next step's hidden state is the one it left, as if that pending token had been fed.
    stop_written: bool = False
    last_hidden: torch.Tensor | None = None  # final hidden state of the last written token
    status: SessionStatus = SessionStatus.ACTIVE
    error: str | None = None
    sink_blocks: list[int] = field(default_factory=list)
    window_blocks: deque[int] = field(default_factory=deque)
    window_first: int = -1    # logical index of window_blocks[0]; set in __post_init__
    history: list[HistorySegment] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.window_first < 0:
            self.window_first = self.sink_count

    @property
    def next_logical(self) -> int:
        if len(self.sink_blocks) < self.sink_count:
            return len(self.sink_blocks)
        return self.window_first + len(self.window_blocks)

    @property
    def live_blocks(self) -> int:
        return len(self.sink_blocks) + len(self.window_blocks)

    def blocks_needed_for(self, num_tokens: int) -> int:
        """How many more blocks must be appended so tokens ``[0, num_tokens)`` have a home."""
        return max(0, -(-num_tokens // self.block_size) - self.next_logical)

    def append_block(self, physical: int) -> None:
        if len(self.sink_blocks) < self.sink_count:
            self.sink_blocks.append(physical)
        else:
            self.window_blocks.append(physical)

    def physical(self, logical: int) -> int | None:
        if logical < len(self.sink_blocks):
            return self.sink_blocks[logical]
        offset = logical - self.window_first
        if 0 <= offset < len(self.window_blocks):
            return self.window_blocks[offset]
        return None

    def release_window_blocks_below(self, logical_end: int) -> list[int]:
        """Drop window blocks with logical index < ``logical_end``; returns their physical ids."""
        released = []
        while self.window_blocks and self.window_first < logical_end:
            released.append(self.window_blocks.popleft())
            self.window_first += 1
        return released

    def release_all(self) -> list[int]:
        released = self.sink_blocks + list(self.window_blocks)
        self.sink_blocks = []
        self.window_blocks = deque()
        self.window_first = self.sink_count
        return released

    def table_row(self) -> list[int]:
        """The compact table: sink blocks, then window blocks (what attention metadata carries)."""
        return self.sink_blocks + list(self.window_blocks)


def window_slots(spans: list[tuple[Session, int, int]], block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat cache slots of tokens ``[lo, hi)`` of each ``(session, lo, hi)``, back to back (all live), and
    the span each token belongs to: what a rebase re-rotates. Vectorised over blocks, since a tick may
    rebase hundreds of sessions' windows.

    >>> s = Session(session_id=1, reservation=8, sink_count=1, block_size=4, opened_seq=0)
    >>> for b in (10, 11, 12, 13): s.append_block(b)
    >>> s.num_tokens = 16
    >>> s.release_window_blocks_below(2)      # logical block 1 leaves the window
    [11]
    >>> slots, span = window_slots([(s, 1, 3), (s, 10, 13)], block_size=4)
    >>> slots.tolist(), span.tolist()         # block 10 holds tokens 0-3; block 12 tokens 8-11, 13 12-15
    ([41, 42, 50, 51, 52], [0, 0, 1, 1, 1])
    """
    blocks, logical, block_lo, block_hi, per_span = [], [], [], [], []
    for s, lo, hi in spans:
        b0, b1 = lo // block_size, (hi - 1) // block_size + 1       # logical blocks [b0, b1)
        row, n_sink = s.table_row(), len(s.sink_blocks)
        # table_row is sink blocks, then window blocks: logical b sits in column b among the sinks, else
        # in column n_sink + b - window_first (as Session.physical reads it).
        w0 = max(b0, n_sink)
        if b1 > w0 and (w0 < s.window_first or b1 > s.window_first + len(s.window_blocks)):
            raise ValueError(f"session {s.session_id}: tokens [{lo}, {hi}) are not all in live blocks")
        found = row[b0:min(b1, n_sink)] + row[n_sink + w0 - s.window_first:n_sink + b1 - s.window_first]
        blocks += found
        logical.extend(range(b0, b1))
        block_lo.append(lo)
        block_hi.append(hi)
        per_span.append(b1 - b0)
    counts = np.asarray(per_span, dtype=np.int64)
    first_token = np.asarray(logical, dtype=np.int64) * block_size
    within = np.arange(block_size, dtype=np.int64)
    tokens = first_token[:, None] + within                            # [blocks, block_size]
    keep = (tokens >= np.repeat(block_lo, counts)[:, None]) & (tokens < np.repeat(block_hi, counts)[:, None])
    slots = (np.asarray(blocks, dtype=np.int64)[:, None] * block_size + within)[keep]
    span = np.repeat(np.arange(len(spans), dtype=np.int32), [hi - lo for _, lo, hi in spans])
    return slots, span
