"""Retention policies: which logical blocks a session may drop at a given length.

A session of length ``L`` (tokens ``0..L-1`` written) will next be queried at ``t >= L``, which
attends to keys ``[0, S) ∪ [t - W, t]``. So logical block ``b`` can be released once it holds no
sink token (``b * bs >= S``) and lies wholly before ``L - W``.

>>> from metronome.config import KVPolicy
>>> p = retention_for(KVPolicy(sinks=4, window=8, block_size=4))
>>> p.releasable_until(num_tokens=30)    # blocks [1, 5) hold tokens 4..19 < 30 - 8 = 22
5
>>> retention_for(KVPolicy(window=None, positions="absolute")).releasable_until(10_000)
0
"""

from __future__ import annotations

from dataclasses import dataclass

from metronome.config import KVPolicy


@dataclass(frozen=True)
class Unbounded:
    """Keep every block: today's engines. Memory grows with session age (the baseline)."""

    def releasable_until(self, num_tokens: int) -> int:
        return 0

    def oldest_attended_token(self, next_query: int) -> int:
        return 0


@dataclass(frozen=True)
class SinkWindow:
    """Keep the sink blocks and the blocks overlapping the last ``window`` tokens."""

    sinks: int
    window: int
    block_size: int

    def releasable_until(self, num_tokens: int) -> int:
        """Every non-sink logical block below the returned index is dead."""
        return max(0, (num_tokens - self.window) // self.block_size)

    def oldest_attended_token(self, next_query: int) -> int:
        """The oldest non-sink token a query at ``next_query`` or later may attend to."""
        return max(self.sinks, next_query - self.window)


RetentionPolicy = Unbounded | SinkWindow


def retention_for(policy: KVPolicy) -> RetentionPolicy:
    if not policy.bounded:
        return Unbounded()
    assert policy.window is not None
    return SinkWindow(policy.sinks, policy.window, policy.block_size)
