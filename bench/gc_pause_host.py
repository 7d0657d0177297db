"""How long Python's full garbage collection stalls a serving process, before and after freezing its
start-up heap (``metronome.serving.gc_pauses.freeze_startup_heap``).

Builds what a worker holds before its first tick (the serving imports, an engine with the packaged
SmolLM2 on the CPU, N open sessions stepped a few ticks), then times ``gc.collect()``: the pause a tick
takes whenever the interpreter runs a full collection on its own. Host-only:

    PYTHONPATH=. python bench/gc_pause_host.py --sessions 64 --out results/gc_pause_host.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.serving.gc_pauses import freeze_startup_heap

import metronome.serving.gateway  # noqa: F401  (the worker and gateway imports: what a serving process holds)
import metronome.serving.worker  # noqa: F401


def full_collection_ms(repeats: int) -> float:
    """Median wall time of a full collection (the median: the first may also free start-up garbage)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def tick(engine: Engine, sids: list[int], rng: random.Random) -> None:
    engine.step([StepInput(s, token_ids=[rng.randrange(1000) for _ in range(26)], max_new_tokens=4) for s in sids])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--ticks", type=int, default=3, help="ticks before and after the freeze")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = random.Random(0)
    engine = Engine(EngineConfig(policy=KVPolicy(sinks=4, window=256)))
    sids = [engine.open_session() for _ in range(args.sessions)]
    for _ in range(args.ticks):
        tick(engine, sids, rng)
    rows = [{"state": "start-up heap", "tracked_objects": len(gc.get_objects()),
             "full_collection_ms": full_collection_ms(args.repeats)}]
    freeze_startup_heap()
    for _ in range(args.ticks):
        tick(engine, sids, rng)
    rows.append({"state": "after freeze_startup_heap + ticks", "tracked_objects": len(gc.get_objects()),
                 "frozen_objects": gc.get_freeze_count(), "full_collection_ms": full_collection_ms(args.repeats)})
    print(f"| state | objects the collector walks | full collection (median of {args.repeats}) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['state']} | {r['tracked_objects']:,} | {r['full_collection_ms']:.2f} ms |")
    result = {"args": vars(args), "python": sys.version.split()[0], "machine": platform.platform(),
              "processor": platform.processor(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
