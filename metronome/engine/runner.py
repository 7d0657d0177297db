"""ModelRunner: owns the device, the KV tensors and the model; turns segments into one forward.

A *segment* is one session's new tokens for a forward: some token ids followed by optional
embedding rows (audio encoders later). The runner packs all segments back to back, computes
positions and slots with vectorised torch ops (no per-token Python), builds the attention metadata
once and runs the model.
"""

from __future__ import annotations

import itertools
import logging
import os

import numpy as np
import torch

from metronome.attention.metadata import PagedAttentionMetadata
from metronome.attention.reference import TorchPagedAttention
from metronome.config import EngineConfig
from metronome.engine.blocks import sink_block_count
from metronome.engine.scheduler import ForwardSegment, InvariantError
from metronome.engine.session import Session
from metronome.models.llama import LlamaFamilyForCausalLM

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def window_slots(spans: list[tuple[Session, int, int]], block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat cache slots of tokens ``[lo, hi)`` of each ``(session, lo, hi)``, back to back (all live), and
    the span each token belongs to: what a rebase re-rotates. Vectorised over blocks: per-session tensors
    took 24 ms of host time for 320 sessions' 1,024-token windows, this 6-8 ms (bench/rebase_slots_host.py).

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


def _pack(arrays: list[np.ndarray], align: int = 16) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """int64 arrays back to back in one buffer, each at a multiple of ``align`` elements (Triton
    specialises kernels on 16-byte pointer alignment; a view at an odd offset would compile a variant).

    >>> buf, spans = _pack([np.array([1, 2, 3]), np.array([4])], align=4)
    >>> buf.tolist(), spans
    ([1, 2, 3, 0, 4, 0, 0, 0], [(0, 3), (4, 1)])
    """
    spans, total = [], 0
    for a in arrays:
        spans.append((total, len(a)))
        total += -(-len(a) // align) * align
    buf = np.zeros(total, dtype=np.int64)
    for (start, length), a in zip(spans, arrays):
        buf[start:start + length] = a
    return buf, spans


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaFamilyForCausalLM, num_blocks: int) -> None:
        self.config = config
        self.model = model
        self.spec = model.spec
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.policy = config.policy
        self.block_size = config.policy.block_size
        self.sink_blocks = sink_block_count(config.policy)
        self.num_blocks = num_blocks
        # One block past the pool is scratch: padded rows of captured decode graphs write their K/V there.
        shape = (num_blocks + 1, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.scratch_slot = num_blocks * self.block_size
        self.graphs = None
        # Uninitialised (zeroing gigabytes costs seconds at start-up): a block is only ever read after
        # its session wrote it, except the null block 0, which padded gathers read and must be zero.
        self.kv_caches = []
        for _ in range(self.spec.num_layers):
            k, v = (torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(2))
            k[0].zero_()
            v[0].zero_()
            self.kv_caches.append((k, v))
        if config.attention == "triton":
            from metronome.attention.triton_paged import TritonPagedAttention  # needs the triton package

            self.attention = TritonPagedAttention(self.spec.num_heads, num_kv_heads=self.spec.num_kv_heads)
        else:
            self.attention = TorchPagedAttention(self.spec.num_heads)
        if self.device.type == "cuda":
            self._warm_up_kernels()

    def _warm_up_kernels(self) -> None:
        """Compile the Triton kernels a step may launch for the first time mid-run (about a second each on an
        H200, which inside a tick is a one-off tick of over a second): every attention variant, and the
        re-rotation of rebasing windows. They touch only the scratch block."""
        k, v = self.kv_caches[0]
        if not isinstance(self.attention, TorchPagedAttention):
            self.attention.warm_up(k, v, block_size=self.block_size,
                                   sinks=self.policy.sinks if self.policy.bounded else 0,
                                   window=self.policy.window, sink_blocks=self.sink_blocks,
                                   block=self.num_blocks, dtype=self.dtype)
        if self.policy.bounded:  # any bounded session may ask for rebased positions at open_session
            from metronome.models.rope_triton import rerotate_keys_

            half = self.spec.head_dim // 2
            ones, zeros = (torch.full((1, half), x, dtype=torch.float32, device=self.device) for x in (1.0, 0.0))
            rerotate_keys_(k, torch.tensor([self.scratch_slot], device=self.device),  # a rotation by zero
                           torch.zeros(1, dtype=torch.int32, device=self.device), ones, zeros)

    # ------------------------------------------------------------------ forward
    def _metadata(self, segments: list[ForwardSegment]) -> tuple[PagedAttentionMetadata, torch.Tensor]:
        """The forward's attention metadata and positions, computed on the host (numpy) and sent in two
        pinned copies: device-side construction from host lists made a pageable copy per list (each waits
        for the GPU's queued work) and ``repeat_interleave`` a device-to-host sync per forward."""
        bs, n = self.block_size, len(segments)
        query_lens = [len(s) for s in segments]
        starts = [s.session.num_tokens for s in segments]
        context_lens = [a + q for a, q in zip(starts, query_lens)]
        rows = [s.session.table_row() for s in segments]
        row_lens = np.fromiter(map(len, rows), dtype=np.int64, count=n)
        table = np.full((n, max(1, int(row_lens.max()))), -1, dtype=np.int32)
        table[np.arange(table.shape[1]) < row_lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(rows), dtype=np.int32, count=int(row_lens.sum()))
        qlens = np.asarray(query_lens, dtype=np.int64)
        seq = np.repeat(np.arange(n), qlens)
        query_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(qlens, out=query_start[1:])
        token_index = np.asarray(starts, dtype=np.int64)[seq] + np.arange(len(seq)) - query_start[:-1][seq]
        base = np.fromiter((s.session.position_base for s in segments), dtype=np.int64, count=n)
        window_first = np.fromiter((s.session.window_first for s in segments), dtype=np.int64, count=n)
        logical = token_index // bs
        column = np.where(logical < self.sink_blocks, logical, self.sink_blocks + logical - window_first[seq])
        if len(column) and ((column < 0) | (column >= row_lens[seq])).any():
            raise InvariantError("a forward's new token has no live block (the engine allocates first)")
        slot_mapping = table[seq, column].astype(np.int64) * bs + token_index % bs
        packed, spans = _pack([query_start, np.asarray(context_lens, dtype=np.int64), window_first,
                               token_index - base[seq], slot_mapping])
        on_device = self.to_device(torch.from_numpy(packed))
        query_start_t, context_lens_t, window_first_t, positions, slot_mapping_t = (
            on_device[a:a + length] for a, length in spans)
        meta = PagedAttentionMetadata(
            block_size=bs,
            sinks=self.policy.sinks if self.policy.bounded else 0,
            window=self.policy.window,
            sink_blocks=self.sink_blocks,
            query_lens=query_lens,
            context_lens=context_lens,
            query_start=query_start_t,
            context_lens_t=context_lens_t,
            block_tables=self.to_device(torch.from_numpy(table)),
            window_first=window_first_t,
            slot_mapping=slot_mapping_t,
        )
        return meta, positions

    def _inputs_embeds(self, segments: list[ForwardSegment]) -> torch.Tensor:
        ids = [t for s in segments for t in s.token_ids]
        if all(s.embeds is None for s in segments):
            return self.model.embed(self.to_device(torch.tensor(ids, dtype=torch.long)))
        parts = []
        for s in segments:
            if s.token_ids:
                parts.append(self.model.embed(self.to_device(torch.tensor(s.token_ids, dtype=torch.long))))
            if s.embeds is not None:
                parts.append(self.to_device(s.embeds).to(self.dtype))
        return torch.cat(parts, 0)

    def capture_decode_graphs(self, max_batch: int, table_width: int) -> None:
        """CUDA + Triton only: replay captured graphs for decode rounds of up to ``max_batch`` sessions."""
        from metronome.engine.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, max_batch, table_width)

    @torch.inference_mode()
    def forward(self, segments: list[ForwardSegment], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Write every segment's K/V and return final hidden states [T, hidden], segments back to back.

        Each session's block table must already cover its new tokens (the engine allocates first).
        ``input_ids`` (decode rounds: one token per segment): this round's tokens as a device tensor, used
        in place of the segments' token ids, so the tokens sampled last round never visit the host.
        """
        if self.graphs is not None and self.graphs.fits(segments):
            return self.graphs.run(segments, input_ids)
        if input_ids is not None:
            if len(input_ids) != len(segments) or any(len(s) != 1 or s.embeds is not None for s in segments):
                raise ValueError("device-side input ids are one token per segment (a decode round)")
            embeds = self.model.embed(input_ids)
        else:
            embeds = self._inputs_embeds(segments)
        meta, positions = self._metadata(segments)
        plan = self.attention.prepare(meta)
        return self.model(embeds, positions, self.kv_caches, self.attention, plan)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

    # ------------------------------------------------------------------ rebase
    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the runner's device without a blocking copy: a CPU tensor goes through pinned
        memory on CUDA (a copy from pageable memory may first wait for the GPU's queued work)."""
        if self.device.type == "cuda" and tensor.device.type == "cpu":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def rebase(self, moves: list[tuple[Session, int]]) -> None:
        """Move each session's attendable window keys ``delta`` positions back: ``R(-delta)`` in place.

        All sessions of a forward at once, one launch per layer for the lot (per session and layer it was
        ~7 small kernels each, thousands of launches a tick at N = 128): on CUDA one Triton kernel that
        rotates each key in place; elsewhere a gather, rotation and scatter.
        """
        spans, deltas = [], []
        for session, delta in moves:
            lo = max(self.policy.sinks, session.num_tokens - (self.policy.window or 0))
            if lo < session.num_tokens:
                spans.append((session, lo, session.num_tokens))
                deltas.append(-delta)
        if spans:
            slots, rows = window_slots(spans, self.block_size)
            slots_dev = self.to_device(torch.from_numpy(slots))
            rows = self.to_device(torch.from_numpy(rows))
            deltas_dev = self.to_device(torch.tensor(deltas))
            cos, sin = self.model.rotary.shift_tables(deltas_dev)  # [sessions, D], one row per moving session
            if self.device.type == "cuda":
                from metronome.models.rope_triton import rerotate_keys_

                half = cos.shape[1] // 2
                cos, sin = cos[:, :half].contiguous(), sin[:, :half].contiguous()
                for k_cache, _ in self.kv_caches:
                    rerotate_keys_(k_cache, slots_dev, rows, cos, sin)
            else:
                cos, sin = cos[rows.long()], sin[rows.long()]
                for k_cache, _ in self.kv_caches:
                    flat = k_cache.view(-1, self.spec.num_kv_heads, self.spec.head_dim)
                    flat.index_copy_(0, slots_dev, self.model.rotary.apply(flat.index_select(0, slots_dev), cos, sin))
        for session, delta in moves:
            session.position_base += delta
