"""The KV block pool (torch-free) and the one reservation formula.

Physical block 0 is the *null block*: never handed out, always zero, the target of padded gathers.

>>> from metronome.config import KVPolicy
>>> blocks_per_session(KVPolicy(sinks=16, window=1024, block_size=16), max_chunk_tokens=256, max_model_len=8192)
82
>>> pool = BlockPool(num_blocks=10)
>>> pool.usable, pool.free_count
(9, 9)
"""

from __future__ import annotations

from metronome.config import KVPolicy
from metronome.engine.policy import cdiv, retention_for

__all__ = ["NULL_BLOCK", "BlockPool", "blocks_per_session", "cdiv", "sink_block_count"]

NULL_BLOCK = 0


def sink_block_count(policy: KVPolicy) -> int:
    """Logical blocks 0..n-1 hold the sink tokens and are pinned for the session's life."""
    return retention_for(policy).sink_blocks


def blocks_per_session(policy: KVPolicy, max_chunk_tokens: int, max_model_len: int) -> int:
    """The most blocks one session can ever hold at once.

    The ONLY reservation formula: pool sizing, admission, the capacity the engine reports and the
    invariant checked after every step all call it. The arithmetic is the policy's (``max_blocks``):
    bounded sessions hold their sink blocks plus the blocks around the window and one chunk, never
    growing with session age; the Unbounded baseline holds the whole context up to the model's limit.
    """
    return retention_for(policy).max_blocks(max_chunk_tokens, max_model_len)


class BlockPool:
    """Free list of physical KV blocks plus the admission ledger of reserved blocks.

    Reservations are accounting only: a bounded session reserves ``blocks_per_session`` blocks when
    it is admitted, so the sum of live blocks can never exceed the pool. The Unbounded baseline
    reserves nothing and may find the pool empty (then the engine preempts).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a pool needs the null block plus at least one more, got {num_blocks}")
        self.num_blocks = num_blocks
        # Pop from the end: low block ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self.reserved = 0

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.usable - len(self._free)

    def can_reserve(self, n: int) -> bool:
        return self.reserved + n <= self.usable

    def reserve(self, n: int) -> None:
        if not self.can_reserve(n):
            raise ValueError(f"reserving {n} blocks would exceed the pool ({self.reserved}/{self.usable} reserved)")
        self.reserved += n

    def unreserve(self, n: int) -> None:
        if n > self.reserved:
            raise ValueError(f"unreserving {n} blocks but only {self.reserved} are reserved")
        self.reserved -= n

    def allocate(self) -> int | None:
        """A free physical block id, or None when the pool is empty."""
        return self._free.pop() if self._free else None

    def release(self, block: int) -> None:
        if block == NULL_BLOCK:
            raise ValueError("the null block is never allocated and cannot be released")
        self._free.append(block)

    def free_block_ids(self) -> list[int]:
        return list(self._free)
