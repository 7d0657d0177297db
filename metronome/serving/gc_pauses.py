"""Keep Python's cyclic garbage collector out of the tick.

A serving process imports torch, triton, grpc and transformers and builds an engine before its first
tick: hundreds of thousands of objects the collector tracks, and a full collection walks all of them.
The interpreter runs one on its own whenever the objects that survive ticks have grown the old
generation by a quarter, and the tick waits for it (hundreds of ms; docs/benchmarks/gpu.md).
Start-up objects live as long as the process, so they are moved to the collector's permanent generation,
which it never walks; collections then see only what ticks make.

In a serving process's entry point, once the server is up (``run_worker``, ``run_gateway``)::

    handle = await serve_worker(config)
    freeze_startup_heap()
"""

from __future__ import annotations

import gc
from time import perf_counter


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then exempt every live object from later collections.

    Call once in a serving process's entry point, after the engine (or the gateway) is built and listening:
    a request that arrives meanwhile waits for this one collection, once. Frozen objects are still freed by
    reference counting; only cycles among them would stay, and start-up state lives until exit anyway. Not
    for library code: freezing is process-wide.
    """
    gc.collect()
    gc.freeze()


class CollectorPauses:
    """Records each collection's generation and pause while installed (``gc.callbacks``), to attribute a
    slow tick to the collector or clear it.

    >>> pauses = CollectorPauses()
    >>> with pauses:
    ...     _ = gc.collect()
    >>> [generation for generation, _ in pauses.take()]
    [2]
    """

    def __init__(self) -> None:
        self._pauses: list[tuple[int, float]] = []
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = perf_counter()
        elif self._started is not None:   # a stop without its start: installed mid-collection
            self._pauses.append((info["generation"], (perf_counter() - self._started) * 1e3))
            self._started = None

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def take(self) -> list[tuple[int, float]]:
        """The (generation, pause ms) of every collection since the last ``take``."""
        pauses, self._pauses = self._pauses, []
        return pauses
