"""The sink + window spec: every piece of window arithmetic the engine uses.

A session of length ``L`` (tokens ``0..L-1`` written) will next be queried at ``t >= L``, which
attends to keys ``[0, S) ∪ [t - W, t]``. So logical block ``b`` can be released once it holds no
sink token (``b * bs >= S``) and lies wholly before ``L - W``.

>>> from metronome.config import KVPolicy
>>> p = retention_for(KVPolicy(sinks=4, window=8, block_size=4))
>>> p.releasable_until(num_tokens=30)    # blocks [1, 5) hold tokens 4..19 < 30 - 8 = 22
5
>>> p.max_blocks(max_chunk_tokens=4, max_model_len=1024)   # 1 sink block + cdiv(12, 4) + 1
5
>>> retention_for(KVPolicy(window=None, positions="absolute")).releasable_until(10_000)
0
"""

from __future__ import annotations

from dataclasses import dataclass

from metronome.attention.metadata import first_window_token, table_column
from metronome.config import KVPolicy


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Unbounded:
    """Keep every block: today's engines. Memory grows with session age (the baseline)."""

    block_size: int = 16
    sinks = 0            # the attention op's view: no sinks, no window
    window = None
    sink_blocks = 0

    def releasable_until(self, num_tokens: int) -> int:
        return 0

    def oldest_attended_token(self, next_query: int) -> int:
        return 0

    def max_blocks(self, max_chunk_tokens: int, max_model_len: int) -> int:
        """The whole context up to the model's length limit."""
        return cdiv(max_model_len, self.block_size)

    def first_chunk_blocks(self, max_chunk_tokens: int) -> int:
        """What admission checks for: room for a first chunk plus one sampled token (it overcommits)."""
        return cdiv(max_chunk_tokens + 1, self.block_size)

    def column(self, logical, window_first):
        return table_column(logical, 0, window_first)


@dataclass(frozen=True)
class SinkWindow:
    """Keep the sink blocks and the blocks overlapping the last ``window`` tokens."""

    sinks: int
    window: int
    block_size: int

    @property
    def sink_blocks(self) -> int:
        """Logical blocks ``0..n-1`` hold the sink tokens and are pinned for the session's life."""
        return cdiv(self.sinks, self.block_size)

    def releasable_until(self, num_tokens: int) -> int:
        """Every non-sink logical block below the returned index is dead."""
        return max(0, (num_tokens - self.window) // self.block_size)

    def oldest_attended_token(self, next_query: int) -> int:
        """The oldest non-sink token a query at ``next_query`` or later may attend to."""
        return first_window_token(self.sinks, self.window, next_query)

    def max_blocks(self, max_chunk_tokens: int, max_model_len: int) -> int:
        """The most blocks a session holds at once (``blocks_per_session`` delegates here).

        During a forward a session holds its sink blocks plus the blocks covering ``[t - window, t + C)``,
        where ``C <= max_chunk_tokens + 1`` (the chunk plus the token sampled last step). A run of ``n``
        tokens at any alignment touches at most ``cdiv(n - 1, bs) + 1`` blocks.
        """
        span = self.window + max_chunk_tokens + 1
        full_context = cdiv(max_model_len, self.block_size)
        return min(full_context, self.sink_blocks + cdiv(span - 1, self.block_size) + 1)

    def column(self, logical, window_first):
        """Column of logical block(s) ``logical`` in a compact table row (ints, numpy or torch)."""
        return table_column(logical, self.sink_blocks, window_first)

    def rebase_delta(self, num_tokens: int, position_base: int, interval: int) -> int:
        """How far to move the window's positions back before the next append (0: not yet)."""
        span = num_tokens - position_base - (self.sinks + self.window)
        return (span // interval) * interval if span >= interval else 0

    def rebased_peak_position(self, interval: int, max_chunk_tokens: int) -> int:
        """Rebased positions stay below sinks + window + interval + chunk + 1."""
        return self.sinks + self.window + interval + max_chunk_tokens + 1


RetentionPolicy = Unbounded | SinkWindow


def retention_for(policy: KVPolicy) -> RetentionPolicy:
    if not policy.bounded:
        return Unbounded(policy.block_size)
    assert policy.window is not None
    return SinkWindow(policy.sinks, policy.window, policy.block_size)
