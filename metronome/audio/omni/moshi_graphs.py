"""CUDA graphs per batch-size bucket for Moshi's per-frame work (depth transformer, Mimi encode/decode).

At 80 ms frames the per-frame work is hundreds of small kernels (the depth transformer alone: 8 codebook
steps × 6 layers); launched one by one from Python they would take most of the 24 ms budget whatever the
batch. ``BucketedGraphs`` captures ``fn`` once per bucket (the next size up from the batch: 1, 2, 4, 8,
16, 24, 32, 48, 64, ... ) over static input buffers and replays it: the batch's inputs are copied into the
first rows, the other rows get a padding value, and the first rows of the static outputs come back.

Requirements on ``fn``: rows are independent (a padding row never changes a real row's result), no host
synchronisation, and outputs are consumed (copied) before the next call, since they are the graph's
static buffers. On the CPU, ``BucketedGraphs`` simply calls ``fn``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from metronome.graph_capture import collector_held_off


def bucket(n: int) -> int:
    """The graph batch size for ``n`` rows: powers of two up to 16, then multiples of 16 (at most 2x padding)."""
    if n <= 16:
        return 1 << max(0, (n - 1).bit_length())
    return ((n + 15) // 16) * 16


class BucketedGraphs:
    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], pads: Sequence[float | int | bool],
                 enabled: bool = True) -> None:
        self.fn = fn
        self.pads = tuple(pads)   # one padding value per input
        self.enabled = enabled
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], list[torch.Tensor]]] = {}

    def reset(self) -> None:
        """Forget every graph (call when something ``fn`` closes over is reallocated)."""
        self._graphs.clear()

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        if not (self.enabled and inputs[0].is_cuda):
            return list(self.fn(*inputs))
        n = inputs[0].shape[0]
        size = bucket(n)
        if size not in self._graphs:
            self._graphs[size] = self._capture(size, inputs)
        graph, static_in, static_out = self._graphs[size]
        for buf, x, pad in zip(static_in, inputs, self.pads):
            buf[:n].copy_(x)
            if n < size:
                buf[n:].fill_(pad)
        graph.replay()
        return [o[:n] for o in static_out]

    def _capture(self, size: int, inputs: Sequence[torch.Tensor]):
        static_in = [torch.full((size, *x.shape[1:]), pad, dtype=x.dtype, device=x.device)
                     for x, pad in zip(inputs, self.pads)]
        stream = torch.cuda.Stream(device=inputs[0].device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):   # warm-up: lazy initialisations happen outside the graph
                self.fn(*static_in)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with collector_held_off(collect_first=False), torch.cuda.graph(graph):  # mid-tick: no full collection
            static_out = list(self.fn(*static_in))
        return graph, static_in, static_out
