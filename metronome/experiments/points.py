"""Run a list of load points, each on a FRESH server process (worker + gateway) with the load generator.

The recycling and ablation experiments are plans of labelled points: ``Point(label, spec, load)``
where ``spec`` is ``server.py``'s JSON and ``load`` the ``LoadRun`` keywords. ``run_points`` runs them
in order, shows a tqdm bar with the live p50 and KV fill, and rewrites ``raw.json`` after every point
so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from metronome.experiments.loadgen import LoadRun
from metronome.experiments.sweep import Server, machine, prepare_model


@dataclass
class Point:
    label: str
    spec: dict               # server.py's spec, "model" prepared by run_points (sweep.prepare_model)
    load: dict               # LoadRun keywords (sessions, rate, duration_s, sample_s, seed, audio)
    meta: dict = field(default_factory=dict)   # copied into the raw point (arm, run, S, W, ...)


def run_points(experiment: str, preset: dict, points: list[Point], out_dir: Path, *, progress: bool = True,
               max_position_embeddings: int = 4096, extra: dict | None = None) -> dict:
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    raw = {"experiment": experiment, "preset": preset, "machine": machine(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv), "points": [],
           **(extra or {})}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"metronome-{experiment}-") as tmp:
        models: dict[str, dict] = {}   # preset model -> prepared (made once per sweep)
        bar = tqdm(points, desc=experiment, unit="point", disable=not progress, dynamic_ncols=True)
        for i, pt in enumerate(bar):
            spec = dict(pt.spec)
            if spec["model"] not in models:
                models[spec["model"]] = prepare_model(spec["model"], tmp, max_position_embeddings)
            spec.update(models[pt.spec["model"]])
            events = out_dir / "logs" / f"{i:02d}-{pt.label}.events.jsonl"
            if spec.get("recycle"):
                spec["recycle"] = {**spec["recycle"], "events_path": str(events)}
            bar.set_description(f"{experiment}: {pt.label}")
            t_point = time.monotonic()
            server = Server(spec, out_dir / "logs" / f"{i:02d}-{pt.label}.log")
            try:
                load = LoadRun(gateway=server.addresses["gateway"], worker=server.addresses["worker"],
                               on_progress=(lambda d: bar.set_postfix(d, refresh=True)) if progress else None,
                               **pt.load)
                result = asyncio.run(load.run())
            finally:
                server.stop()
            if events.is_file():      # what the server recorded (the recycling wrapper's recycles)
                result["events"] = [json.loads(line) for line in events.read_text().splitlines() if line]
            raw["points"].append({"label": pt.label, **pt.meta, "spec": spec, "load": pt.load,
                                  "wall_clock_s": round(time.monotonic() - t_point, 2), **result})
            raw["elapsed_s"] = round(time.monotonic() - t0, 1)
            (out_dir / "raw.json").write_text(json.dumps(raw))
    raw["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    (out_dir / "raw.json").write_text(json.dumps(raw))
    return raw
