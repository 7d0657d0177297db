"""The serving processes' collector settings (``metronome.serving.gc_pauses``)."""

from __future__ import annotations

import gc
import subprocess
import sys

from metronome.serving.gc_pauses import CollectorPauses

FREEZE_IN_A_FRESH_PROCESS = """
import gc
import metronome.serving.worker  # torch, grpc, the engine: what a worker imports before its first tick
from metronome.serving.gc_pauses import freeze_startup_heap

before = len(gc.get_objects())
freeze_startup_heap()
print(before, len(gc.get_objects()), gc.get_freeze_count())
"""


def test_freezing_takes_the_start_up_heap_out_of_every_collection():
    # In its own interpreter: freezing is process-wide, and this test process must keep collecting.
    out = subprocess.run([sys.executable, "-c", FREEZE_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                         check=True).stdout
    before, walked_after, frozen = map(int, out.split())
    assert before > 50_000          # the imports alone: what made full collections slow
    assert walked_after < 1_000     # a full collection now walks only what ticks make
    assert frozen >= 0.9 * before


def test_collector_pauses_records_each_collection_while_installed():
    pauses = CollectorPauses()
    with pauses:
        gc.collect(0)
        gc.collect(2)
    gc.collect()   # after removal: not recorded
    taken = pauses.take()
    assert [generation for generation, _ in taken] == [0, 2]
    assert all(ms >= 0 for _, ms in taken)
    assert pauses.take() == []
    assert pauses._callback not in gc.callbacks
    pauses._callback("stop", {"generation": 1})   # installed mid-collection: a stop without its start
    assert pauses.take() == []
