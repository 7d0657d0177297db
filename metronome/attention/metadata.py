"""Attention metadata, passed explicitly to the attention op (no module-global context).

A forward carries ``T`` new query tokens from ``B`` sequences, packed back to back. Sequence ``b``
owns queries ``query_start[b] : query_start[b + 1]``; after this forward's writes its cache holds
tokens ``0 .. context_lens[b] - 1``, so its queries sit at token indices
``context_lens[b] - query_lens[b] ..  context_lens[b] - 1``.

The query at token index ``t`` attends to keys ``j <= t`` with ``j < sinks`` or ``j >= t - window``
(``window=None``: all ``j <= t``).

Block tables are *compact*: column ``c < sink_blocks`` holds logical block ``c``; column
``c >= sink_blocks`` holds logical block ``window_first[b] + c - sink_blocks``; ``-1`` marks an unused
column. Logical token ``j`` lives in slot ``block * block_size + j % block_size`` of the flattened cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the engine's block arithmetic imports this module
    import torch

    from metronome.attention.cpu_kernel import CpuDecodeKernel


@dataclass(frozen=True)
class PagedAttentionMetadata:
    block_size: int
    sinks: int
    window: int | None
    sink_blocks: int
    query_lens: list[int]          # host copies: the reference plans on the host without a sync
    context_lens: list[int]
    query_start: torch.Tensor      # [B + 1] int64, device
    context_lens_t: torch.Tensor   # [B] int64, device
    block_tables: torch.Tensor     # [B, R] int32, device, -1 padded
    window_first: torch.Tensor     # [B] int64, device
    slot_mapping: torch.Tensor     # [T] int64, device: where each new token's K/V is written

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))


def first_window_token(sinks: int, window: int, query: int) -> int:
    """The oldest non-sink key a query at token index ``query`` (or later) attends to.

    The one statement of the mask's window edge; the engine's policy reads it from here.
    """
    return max(sinks, query - window)


def table_column(logical, sink_blocks: int, window_first):
    """Column of logical block(s) ``logical`` in a compact table row; ints, numpy arrays or tensors.

    >>> [table_column(b, 1, 3) for b in (0, 3, 4)]   # sink block 0, then window blocks from logical 3
    [0, 1, 2]
    """
    return logical + (logical >= sink_blocks) * (sink_blocks - window_first)


def token_slots(meta: PagedAttentionMetadata, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Flat cache slot of logical token ``tokens[i, k]`` of sequence ``rows[i]`` (all must be live)."""
    import torch

    bs = meta.block_size
    column = table_column(tokens // bs, meta.sink_blocks, meta.window_first[rows].unsqueeze(-1))
    column = column.clamp(0, meta.block_tables.shape[1] - 1)
    physical = torch.gather(meta.block_tables[rows].long(), 1, column)
    return physical * bs + tokens % bs


def e4m3_codes(key: torch.Tensor, value: torch.Tensor, kv_scale: torch.Tensor,
               kernel: CpuDecodeKernel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [T, kv_heads, head_dim] as the E4M3 pages store them (``x / scale``), as bytes:
    index_copy_ and index_select have no float8 kernels on the CPU. ``kernel``: the CPU's C kernels, which
    quantise each in one call (torch takes four operators)."""
    import torch

    from metronome.attention.fp8 import to_e4m3

    codes = []
    for x, scale in ((key, kv_scale[0]), (value, kv_scale[1])):
        quantized = None if kernel is None else kernel.quantize(x, scale)
        codes.append(to_e4m3(x, scale[:, None]).view(torch.uint8) if quantized is None else quantized)
    return codes[0], codes[1]


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None,
             kernel: CpuDecodeKernel | None = None) -> None:
    """Store the new tokens' keys/values ([T, kv_heads, head_dim]) at their slots.

    ``kv_scale`` [2, kv_heads]: the caches are E4M3 and hold ``x / scale`` (``attention/fp8.py``); keys and values
    already in those codes (``e4m3_codes``) go in as they are, without it. ``kernel``: the CPU's C kernels, whose
    row scatter writes the rows (index_copy_ costs far more than a few rows' copy).
    """
    import torch

    kv_heads, head_dim = key.shape[-2:]
    tokens = key.shape[0]
    if kv_scale is not None:
        key, value = e4m3_codes(key, value, kv_scale, kernel)
    if key.dtype == torch.uint8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if kernel is not None and tokens:
        if all(kernel.scatter_rows_(x.reshape(tokens, 1, -1), cache.view(-1, kv_heads * head_dim), slot_mapping)
               for x, cache in ((key, k_cache), (value, v_cache))):
            return
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
