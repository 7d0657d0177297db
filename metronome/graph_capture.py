"""Python's collector held off while a CUDA graph captures.

Destroying a CUDA graph is not permitted while a stream captures: a collection that frees one mid-capture
(an earlier engine left in a reference cycle, say) invalidates the capture, and the failed capture leaves
the CUDA random generator in capture mode for every later caller ("Offset increment outside graph capture").
Seen on the H200 in the GPU tests, one engine after another in one process. torch no longer collects before
a capture unless ``torch.compiler.config.force_cudagraph_gc`` is set. Holding the collector off is what
makes a capture safe; collecting first as well frees earlier graphs' memory before a new pool fills
(at start-up), and costs a full collection, which a capture in the middle of a tick should not pay::

    with collector_held_off(collect_first=True), torch.cuda.graph(graph):
        out = forward()
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_held_off(collect_first: bool) -> Iterator[None]:
    """No automatic collection until the block ends (the collector's state is restored); ``collect_first``:
    a full collection on entry."""
    if collect_first:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
