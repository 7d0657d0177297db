"""CUDA graphs for decode rounds: one captured forward per batch-size bucket, replayed every round.

A decode round feeds exactly one token per session, so its shapes depend only on the batch size.
Each bucket's graph reads static device buffers (input embeddings, positions, KV slots, compact block
tables, window offsets, the Triton kernel's work items) that the host refills before every replay;
Python and kernel-launch overhead leave the round. Rows past the live batch are padding: their
K/V go to a scratch block outside the pool and their attention work items are empty.

Buckets are captured from the largest down so they share one memory pool (as vLLM does).

The graphs start from input *embeddings*: token ids are embedded just before the replay (one small
gather), so a forward of one embedding row per session — Moshi's frame per tick — replays them too.

Example (on CUDA): ``graphs = DecodeGraphs(runner, max_batch=256)`` then, for a round of 37 sessions,
``hidden = graphs.run(segments)`` replays the 48-row graph and returns the first 37 rows.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from metronome.attention.metadata import PagedAttentionMetadata
from metronome.engine.request import ForwardSegment
from metronome.graph_capture import collector_held_off

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


@dataclass
class _Graph:
    batch: int
    graph: torch.cuda.CUDAGraph
    plan: object
    hidden: torch.Tensor  # [batch, hidden] output of the captured forward


def staging_rows(segments: list[ForwardSegment], block_size: int) -> np.ndarray:
    """One decode round's host inputs, a row per segment: ``[token, position, slot, window_first, item row,
    item row, 1, context length, *block table]``, tables padded with -1 to the longest live row only.

    Built in numpy with the table cut to the batch's live blocks: an Unbounded session's graph table is
    as wide as the model's position limit, too wide to pad row by row in Python every round.
    """
    tables = [seg.session.table_row() for seg in segments]
    out = np.full((len(segments), 8 + max(1, max(map(len, tables), default=1))), -1, dtype=np.int64)
    for i, (seg, table) in enumerate(zip(segments, tables)):
        s, t = seg.session, seg.session.num_tokens
        token = seg.token_ids[0] if seg.token_ids else 0   # an embeddings row: its id is unused
        out[i, :8] = (token, t - s.position_base, s.physical(t // block_size) * block_size + t % block_size,
                      s.window_first, i, i, 1, t)
        out[i, 8:8 + len(table)] = table
    return out


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, table_width: int) -> None:
        from metronome.attention.triton_paged import (PROGRAMS_PER_SM, TritonLaunch, TritonPlan, choose_splits,
                                                      choose_stages, crowded, live_tiles)

        # A proxy: the runner holds these graphs, and a cycle would keep the KV cache alive past the engine.
        self.runner = weakref.proxy(runner)
        dev = runner.device
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        if self.buckets[-1] < max_batch:
            self.buckets.append(max_batch)
        n = self.buckets[-1]
        self.width = table_width
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.embeds = torch.zeros((n, runner.spec.hidden_size), dtype=runner.dtype, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.full((n, table_width), -1, dtype=torch.int32, device=dev)
        self.window_first = torch.zeros(n, dtype=torch.long, device=dev)
        self.items = torch.zeros((n, 4), dtype=torch.int32, device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.long, device=dev)
        # Pinned host staging areas, one transfer per replay. A ring, because the host may run a few
        # rounds ahead of the GPU: a slot is rewritten only after its previous copy has executed.
        self.staging = [torch.zeros((n, 8 + table_width), dtype=torch.long).pin_memory() for _ in range(4)]
        self.staging_done: list[torch.cuda.Event | None] = [None] * len(self.staging)
        self.round = 0
        spec, retention = runner.spec, runner.retention
        attention = runner.attention
        self.graphs: dict[int, _Graph] = {}
        pool = torch.cuda.graph_pool_handle()
        full_tiles = live_tiles(max(1, spec.max_position_embeddings - 1), 1, retention.sinks, retention.window,
                                attention.decode_block_n)
        g = spec.num_heads // spec.num_kv_heads
        block_m = max(attention.options["decode_block_m"], 1 << (g - 1).bit_length())
        with torch.inference_mode(), collector_held_off(collect_first=True):
            for batch in reversed(self.buckets):
                meta = PagedAttentionMetadata(
                    block_size=runner.block_size, sinks=retention.sinks, window=retention.window,
                    sink_blocks=runner.sink_blocks, query_lens=[1] * batch, context_lens=[1] * batch,
                    query_start=self.query_start[:batch + 1], context_lens_t=self.context_lens[:batch],
                    block_tables=self.block_tables[:batch], window_first=self.window_first[:batch],
                    slot_mapping=self.slot_mapping[:batch])
                num_sms = attention.options["num_sms"]
                splits = choose_splits(batch * spec.num_kv_heads, full_tiles, target_programs=PROGRAMS_PER_SM * num_sms)
                programs = batch * spec.num_kv_heads * splits
                stages = choose_stages(programs, num_sms, decode=True,
                                       crowded_stages=attention.options["crowded_stages"])
                launch = TritonLaunch(block_m, self.items[:batch], batch, splits, full_tiles, num_stages=stages,
                                      decode=True, block_n=attention.decode_block_n,
                                      crowded=crowded(programs, num_sms, decode=True))
                plan = TritonPlan(meta, spec.num_heads, spec.num_kv_heads, [launch],
                                  attention.options["num_warps"], attention.options["num_stages"],
                                  attention.options["max_registers"], attention.options["widen_v_max_group"])
                self._pad(0, batch)
                self.embeds[:batch] = runner.model.embed(self.input_ids[:batch])
                forward = self._forward_fn(batch, plan)
                forward()  # compile and warm up outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = forward()
                self.graphs[batch] = _Graph(batch, graph, plan, hidden)
        torch.cuda.synchronize()
        log.info("captured decode graphs for batch sizes %s", self.buckets)

    def _forward_fn(self, batch: int, plan):
        model, runner = self.runner.model, self.runner

        def forward() -> torch.Tensor:
            return model(self.embeds[:batch], self.positions[:batch], runner.kv_caches, runner.attention, plan)

        return forward

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) do nothing: scratch KV slot, empty attention work items."""
        if end <= start:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.runner.scratch_slot
        self.block_tables[start:end] = -1
        self.window_first[start:end] = 0
        rows = torch.arange(start, end, dtype=torch.int32, device=self.items.device)
        self.items[start:end, 0] = rows
        self.items[start:end, 1] = rows
        self.items[start:end, 2:] = 0

    def fits(self, segments: list[ForwardSegment]) -> bool:
        return (len(segments) <= self.buckets[-1]
                and all(len(s) == 1 for s in segments)
                and all(s.session.live_blocks <= self.width for s in segments))

    def run(self, segments: list[ForwardSegment], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [len(segments), hidden] of one decode round (a fresh tensor, not the graph's).

        ``input_ids`` (on the device) replaces the segments' token ids, so the tokens sampled last
        round never have to visit the host.
        """
        b = len(segments)
        bucket = next(x for x in self.buckets if x >= b)
        host = staging_rows(segments, self.runner.block_size)
        slot = self.round % len(self.staging)
        self.round += 1
        if self.staging_done[slot] is not None:
            self.staging_done[slot].synchronize()
        # A contiguous [b, 8 + m] view of the pinned buffer: only the live table columns travel.
        stage = self.staging[slot].view(-1)[:host.size].view(host.shape)
        stage.copy_(torch.from_numpy(host))
        gpu = stage.to(self.runner.device, non_blocking=True)
        self.staging_done[slot] = torch.cuda.Event()
        self.staging_done[slot].record()
        self.input_ids[:b] = gpu[:, 0] if input_ids is None else input_ids
        self.positions[:b] = gpu[:, 1]
        self.slot_mapping[:b] = gpu[:, 2]
        self.window_first[:b] = gpu[:, 3]
        self.items[:b] = gpu[:, 4:8].to(torch.int32)
        m = host.shape[1] - 8
        self.block_tables[:b, :m] = gpu[:, 8:].to(torch.int32)
        self.block_tables[:b, m:] = -1
        self._pad(b, bucket)
        self.embeds[:b] = self.runner.model.embed(self.input_ids[:b])
        given = [(i, seg.embeds) for i, seg in enumerate(segments) if seg.embeds is not None and len(seg.embeds)]
        if given:
            rows_at = self.runner.to_device(torch.tensor([i for i, _ in given]))
            self.embeds[rows_at] = self.runner.to_device(torch.cat([e for _, e in given])).to(self.runner.dtype)
        g = self.graphs[bucket]
        g.graph.replay()
        return g.hidden[:b].clone()
