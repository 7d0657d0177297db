"""Timing of host-only code paths (no GPU) for the ``*_host.py`` benchmarks."""

from __future__ import annotations

import time


def mean_ms(fn, repeats: int) -> float:
    """Mean wall time of ``fn()`` in ms over ``repeats`` calls, after one warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3
