"""ModelRunner: owns the device, the KV tensors and the model; executes one ``ForwardPlan``.

A plan's segments are sessions' new tokens: some token ids followed by optional embedding rows. The
runner applies the plan's rebase, packs the segments back to back, computes positions and slots with
vectorised numpy (no per-token Python), builds the attention metadata once, runs the model and
returns a ``ForwardResult``. It reads sessions through the plan and never changes them.
"""

from __future__ import annotations

import itertools
import logging
import os
from contextlib import contextmanager

import numpy as np
import torch

from metronome.attention.cpu_kernel import kernel_for
from metronome.attention.decode_window import DecodeWindow
from metronome.attention.fp8 import E4M3, E4M3_MAX, CalibratingAttention
from metronome.attention.metadata import PagedAttentionMetadata
from metronome.attention.reference import TorchPagedAttention
from metronome.config import EngineConfig
from metronome.device_copy import to_device
from metronome.engine.blocks import blocks_per_session
from metronome.engine.policy import retention_for
from metronome.engine.request import ForwardPlan, ForwardResult, ForwardSegment, RebasePlan
from metronome.engine.scheduler import InvariantError
from metronome.engine.session import window_slots  # noqa: F401  (its former home; benchmarks import it here)
from metronome.models.cpu_decode_round import DirectDecodeRound
from metronome.models.llama import LlamaFamilyForCausalLM
from metronome.native import NativeLibrary

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_dtype(config: EngineConfig) -> torch.dtype:
    """What the KV pages store: the compute dtype, or E4M3 (``kv_cache_dtype="fp8"``)."""
    return E4M3 if config.kv_cache_dtype == "fp8" else DTYPES[config.dtype]


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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
    def __init__(self, config: EngineConfig, model: LlamaFamilyForCausalLM, num_blocks: int,
                 cpu_kernels: NativeLibrary | None = None) -> None:
        """``cpu_kernels``: Metronome's C kernels where the engine loaded them (decode rounds on the CPU)."""
        self.config = config
        self.model = model
        self.spec = model.spec
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.policy = config.policy
        self.retention = retention_for(config.policy)
        self.block_size = config.policy.block_size
        self.sink_blocks = self.retention.sink_blocks
        self.num_blocks = num_blocks
        # One block past the pool is scratch: padded rows of captured decode graphs write their K/V there.
        shape = (num_blocks + 1, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.scratch_slot = num_blocks * self.block_size
        self.graphs = None
        # Uninitialised (zeroing gigabytes costs seconds at start-up): a block is only ever read after
        # its session wrote it, except the null block 0, which padded gathers read and must be zero.
        self.kv_caches = []
        # FP8 pages carry one scale per (layer, K/V, KV head) as a third element of each layer's cache; the
        # first forward sets them from its own keys and values (attention/fp8.py), before any page is written.
        self.kv_dtype = kv_dtype(config)
        self.kv_scales = None
        if self.kv_dtype == E4M3:
            # Each layer's [2, KV heads] starts 16 bytes aligned: Triton specialises pointers on that, and a layer
            # whose scales did not would compile kernel variants of its own in the first tick, not the warm-up.
            per_layer = 2 * self.spec.num_kv_heads
            self.kv_scales = torch.ones((self.spec.num_layers, -(-per_layer // 4) * 4), device=self.device)[
                :, :per_layer].unflatten(1, (2, self.spec.num_kv_heads))
        self.kv_calibrated = self.kv_scales is None
        for layer in range(self.spec.num_layers):
            k, v = (torch.empty(shape, dtype=self.kv_dtype, device=self.device) for _ in range(2))
            k[0].zero_()
            v[0].zero_()
            self.kv_caches.append((k, v) if self.kv_scales is None else (k, v, self.kv_scales[layer]))
        if config.attention == "triton":
            from metronome.attention.triton_paged import TritonPagedAttention  # needs the triton package

            self.attention = TritonPagedAttention(self.spec.num_heads, num_kv_heads=self.spec.num_kv_heads,
                                                  kv_dtype=self.kv_dtype)
        else:
            self.attention = TorchPagedAttention(self.spec.num_heads)
        # The CPU path's torch attention: decode rounds attend over keys gathered once per step (see decode_rounds).
        # A decode round adds one token a session: the reservation formula at a chunk of 1, in keys.
        max_live = blocks_per_session(config.policy, 1, self.spec.max_position_embeddings) * self.block_size
        self.decode_window = None
        if isinstance(self.attention, TorchPagedAttention) and self.device.type == "cpu":
            kernel, line = kernel_for(config.cpu_attention, cpu_kernels, self.dtype, self.spec.head_dim, self.kv_dtype)
            log.info(line)
            self.attention.kernel = kernel     # prefills write their K/V through its row scatter too
            self.decode_window = DecodeWindow(self.kv_caches, self.spec.num_heads, max_live_keys=max_live,
                                              kernel=kernel)
        # Decode rounds on the CPU as direct calls to the C kernels, where the model's layers allow it.
        self.direct_rounds = (DirectDecodeRound.build(model, cpu_kernels)
                              if self.decode_window is not None and self.decode_window.kernel is not None else None)
        if self.direct_rounds is not None:
            log.info("decode rounds call the C kernels directly (%d layers)", len(self.direct_rounds.layers))
        self._in_rounds = False
        if self.device.type == "cuda":
            self._warm_up_kernels()

    def _warm_up_kernels(self) -> None:
        """Compile the Triton kernels a step may launch for the first time mid-run (a compile inside a tick
        blows its deadline): every attention variant, and the re-rotation of rebasing windows. They touch
        only the scratch block."""
        k, v = self.kv_caches[0][:2]
        if not isinstance(self.attention, TorchPagedAttention):
            self.attention.warm_up(k, v, block_size=self.block_size,
                                   sinks=self.retention.sinks, window=self.retention.window,
                                   sink_blocks=self.sink_blocks,
                                   block=self.num_blocks, dtype=self.dtype,
                                   kv_scale=None if self.kv_scales is None else self.kv_scales[0])
        if self.policy.bounded:  # any bounded session may ask for rebased positions at open_session
            from metronome.models.rope_triton import rerotate_keys_

            half = self.spec.head_dim // 2
            ones, zeros = (torch.full((1, half), x, dtype=torch.float32, device=self.device) for x in (1.0, 0.0))
            rerotate_keys_(k, torch.tensor([self.scratch_slot], device=self.device),  # a rotation by zero
                           torch.zeros(1, dtype=torch.int32, device=self.device), ones, zeros)

    # ------------------------------------------------------------------ forward
    def _metadata(self, segments: list[ForwardSegment]) -> tuple[PagedAttentionMetadata, torch.Tensor]:
        """The forward's attention metadata and positions, computed on the host (numpy) and sent in two
        pinned copies: built on the device from host lists, each list would be a pageable copy (waiting for
        the GPU's queued work) and ``repeat_interleave`` a device-to-host sync."""
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
        column = self.retention.column(token_index // bs, window_first[seq])
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
            sinks=self.retention.sinks,
            window=self.retention.window,
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
        """Every segment's rows, its token ids' embeddings then its ``embeds``, back to back: one lookup for
        all the ids and one gather that puts each row in its place (a lookup and a copy a segment cost the
        host more than the GPU's work for them, hundreds of sessions a tick)."""
        ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in segments), dtype=np.int64)
        given = [self.to_device(s.embeds).to(self.dtype) for s in segments if s.embeds is not None]
        if not given:
            return self.model.embed(self.to_device(ids))
        if not len(ids):
            return torch.cat(given, 0)
        source = torch.cat([self.model.embed(self.to_device(ids))] + given, 0)
        # Where each row of the forward is in ``source``: the ids' rows first, then every segment's embeds.
        n_ids = np.fromiter((len(s.token_ids) for s in segments), dtype=np.int64, count=len(segments))
        n_given = np.fromiter((0 if s.embeds is None else s.embeds.shape[0] for s in segments), dtype=np.int64,
                              count=len(segments))
        lengths = n_ids + n_given
        seg = np.repeat(np.arange(len(segments)), lengths)
        offset = np.arange(len(seg)) - (np.cumsum(lengths) - lengths)[seg]
        id_start, given_start = np.cumsum(n_ids) - n_ids, len(ids) + np.cumsum(n_given) - n_given
        order = np.where(offset < n_ids[seg], id_start[seg] + offset, given_start[seg] + offset - n_ids[seg])
        return source.index_select(0, self.to_device(order))

    def capture_decode_graphs(self, max_batch: int, table_width: int) -> None:
        """CUDA + Triton only: replay captured graphs for decode rounds of up to ``max_batch`` sessions."""
        from metronome.engine.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, max_batch, table_width)

    @torch.inference_mode()
    def forward(self, segments: list[ForwardSegment], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Write every segment's K/V and return final hidden states [T, hidden], segments back to back.

        Each session's block table must already cover its new tokens (the scheduler allocates first).
        ``input_ids`` (decode rounds: one token per segment): this round's tokens as a device tensor, used
        in place of the segments' token ids, so the tokens sampled last round never visit the host.
        """
        if self.graphs is not None and self.kv_calibrated and self.graphs.fits(segments):
            return self.graphs.run(segments, input_ids)
        if input_ids is not None:
            if len(input_ids) != len(segments) or any(len(s) != 1 or s.embeds is not None for s in segments):
                raise ValueError("device-side input ids are one token per segment (a decode round)")
            embeds = self.model.embed(input_ids)
        else:
            embeds = self._inputs_embeds(segments)
        meta, positions = self._metadata(segments)
        if self._in_rounds and self.kv_calibrated and all(q == 1 for q in meta.query_lens):
            plan = self.decode_window.plan_round(meta, [s.session.session_id for s in segments])
            forward = self.model if self.direct_rounds is None else self.direct_rounds
            return forward(embeds, positions, self.kv_caches, self.decode_window, plan)
        attention = self.attention if self.kv_calibrated else CalibratingAttention(self.attention)
        plan = attention.prepare(meta)
        hidden = self.model(embeds, positions, self.kv_caches, attention, plan)
        self.kv_calibrated = True
        return hidden

    @contextmanager
    def decode_rounds(self):
        """One step's decode rounds. With torch attention their keys are gathered from the paged cache once,
        in the first round, and each later round appends to that copy (``DecodeWindow``)."""
        if self.decode_window is None:
            yield
            return
        self.decode_window.begin()
        self._in_rounds = True
        try:
            yield
        finally:
            self._in_rounds = False
            self.decode_window.begin()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def execute(self, plan: ForwardPlan, input_ids: torch.Tensor | None = None) -> ForwardResult:
        """Apply the plan's rebase, run its segments and return their hidden states and each last row."""
        if plan.rebase is not None:
            self.rebase(plan.rebase)
            if self._in_rounds:
                self.decode_window.mark_moved(plan.rebase.sessions)
        if plan.empty:
            return ForwardResult(torch.empty(0), ())
        hidden = self.forward(list(plan.segments), input_ids)
        # One op for the whole batch (per-row indexing costs microseconds each, every round).
        if len(hidden) == len(plan.segments):
            rows = hidden.unbind(0)
        else:
            ends = torch.tensor([len(seg) for seg in plan.segments]).cumsum(0).sub_(1)
            rows = hidden.index_select(0, self.to_device(ends)).unbind(0)
        return ForwardResult(hidden, tuple(rows))

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the runner's device without a blocking copy (``device_copy.to_device``)."""
        return to_device(tensor, self.device)

    # ------------------------------------------------------------------ rebase
    @torch.inference_mode()
    def rebase(self, plan: RebasePlan) -> None:
        """Re-rotate the planned keys in place by ``R(delta)``, all sessions of a forward at once.

        One launch per layer for the lot: on CUDA one Triton kernel that rotates each key in place;
        elsewhere a gather, rotation and scatter.
        """
        slots_dev = self.to_device(torch.from_numpy(plan.slots))
        rows = self.to_device(torch.from_numpy(plan.rows))
        deltas_dev = self.to_device(torch.tensor(plan.deltas))
        cos, sin = self.model.rotary.shift_tables(deltas_dev)  # [sessions, D], one row per moving session
        if self.device.type == "cuda":
            from metronome.models.rope_triton import rerotate_keys_

            half = cos.shape[1] // 2
            cos, sin = cos[:, :half].contiguous(), sin[:, :half].contiguous()
            for k_cache, *_ in self.kv_caches:
                rerotate_keys_(k_cache, slots_dev, rows, cos, sin)
        else:
            cos, sin = cos[rows.long()], sin[rows.long()]
            for k_cache, *_ in self.kv_caches:
                flat = k_cache.view(-1, self.spec.num_kv_heads, self.spec.head_dim)
                keys = self.model.rotary.apply(flat.index_select(0, slots_dev).float(), cos, sin)
                if flat.dtype == E4M3:  # rotation is linear, so the per-head scale stays; bytes: no fp8 index_copy_
                    flat = flat.view(torch.uint8)
                    keys = keys.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).view(torch.uint8)
                flat.index_copy_(0, slots_dev, keys.to(flat.dtype))

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Drop the graphs, the KV tensors, the attention backend and the model (the caller empties the
        CUDA cache once nothing else holds them)."""
        self.graphs = None
        self.kv_caches = []
        self.attention = None
        if self.decode_window is not None:
            self.decode_window.release()
            self.decode_window = None
        self.direct_rounds = None
        self.model = None
