"""The wall rule (pure functions over a run's frames; numpy only).

The paper's rule at B = 2 s: split the run into 10-s buckets, take each bucket's median frame latency,
and call the run *walled* if the median of the last three bucket medians exceeds 500 ms. Here the
bucket is ``5·B`` and the threshold ``0.25·B`` (the same ratios; see ``presets.Preset``).

The same construction over the fraction of *preempted* frames (frames that come back on time but
empty because the session's KV was taken away) detects the "quiet cliff": a run is *quietly walled*
if the median of the last three buckets' preempted fractions exceeds ``quiet_fraction`` (0.5).

>>> t = [0.5 * i for i in range(60)]              # 30 s of frames, 2 per second
>>> lat = [50.0] * 40 + [900.0] * 20               # the last 10 s are slow
>>> walled(t, lat, bucket_s=5.0, threshold=500.0, t_end=30.0)
True
>>> wall_onset(t, lat, bucket_s=5.0, threshold=500.0, t_end=30.0)
20.0
"""

from __future__ import annotations

import numpy as np


def bucket_stat(t, values, bucket_s: float, t_end: float | None = None, stat=np.median) -> tuple[np.ndarray, np.ndarray]:
    """(bucket start times, per-bucket ``stat``) for buckets ``[k·bucket_s, (k+1)·bucket_s)`` up to ``t_end``.

    Empty buckets get NaN. Only whole buckets count: a last partial bucket is dropped.
    """
    t, values = np.asarray(t, float), np.asarray(values, float)
    if t_end is None:
        t_end = float(t.max()) if t.size else 0.0
    k = int(np.floor(t_end / bucket_s + 1e-9))
    starts = np.arange(k) * bucket_s
    out = np.full(k, np.nan)
    idx = np.floor(t / bucket_s).astype(int) if t.size else np.zeros(0, int)
    for i in range(k):
        sel = values[idx == i]
        if sel.size:
            out[i] = stat(sel)
    return starts, out


def _rolling3(stats: np.ndarray) -> np.ndarray:
    """Median of each three consecutive buckets (NaN-aware); element j covers buckets j-2..j."""
    out = np.full(stats.size, np.nan)
    for j in range(2, stats.size):
        window = stats[j - 2:j + 1]
        if np.isfinite(window).any():
            out[j] = np.nanmedian(window)
    return out


def walled(t, values, bucket_s: float, threshold: float, t_end: float | None = None, stat=np.median) -> bool:
    """The rule: median of the last three bucket statistics > threshold."""
    _, stats = bucket_stat(t, values, bucket_s, t_end, stat)
    if stats.size < 3:
        return False
    rolled = _rolling3(stats)
    return bool(np.isfinite(rolled[-1]) and rolled[-1] > threshold)


def wall_onset(t, values, bucket_s: float, threshold: float, t_end: float | None = None, stat=np.median) -> float | None:
    """Start of the first bucket over the threshold after which the rule holds at every later bucket; None if no wall."""
    _, stats = bucket_stat(t, values, bucket_s, t_end, stat)
    if stats.size < 3 or not walled(t, values, bucket_s, threshold, t_end, stat):
        return None
    rolled = _rolling3(stats)
    ok = np.isfinite(rolled) & (rolled > threshold)
    for k in range(stats.size):      # the first slow bucket after which the rule never lets go
        if np.isfinite(stats[k]) and stats[k] > threshold and ok[max(k + 1, 2):].all():
            return float(k * bucket_s)
    return None


def first_time(t, flags) -> float | None:
    """Time of the first frame whose flag is set (e.g. the first preempted frame: the measured stall)."""
    t, flags = np.asarray(t, float), np.asarray(flags, bool)
    return float(t[flags].min()) if flags.any() else None


def frames(point: dict) -> dict[str, np.ndarray]:
    """Every session's ``metronome.tick`` rows of one run, flattened: t, latency_ms, deadline_met, batch, preempted, empty."""
    rows = [row for s in point["sessions"] for row in s["ticks"]]
    if not rows:
        z = np.zeros(0)
        return {"t": z, "latency_ms": z, "deadline_met": z.astype(bool), "batch": z, "preempted": z.astype(bool),
                "empty": z.astype(bool)}
    a = np.array([[r[0], r[2], r[3], r[4], r[5], r[6]] for r in rows], float)
    return {"t": a[:, 0], "latency_ms": a[:, 1], "deadline_met": a[:, 2] > 0, "batch": a[:, 3],
            "preempted": a[:, 4] > 0, "empty": a[:, 5] == 0}


def engine_p50_ms(point: dict) -> float | None:
    """Median of the worker's engine time per tick (the tick rows' 8th column; None in raw files from before
    the tick event carried it)."""
    values = [row[7] for s in point["sessions"] for row in s["ticks"] if len(row) > 7 and row[7] is not None]
    return float(np.median(values)) if values else None


def tick_breakdown(point: dict, from_s: float = 0.0) -> dict[str, float | None]:
    """Where a tick's latency went, as medians over the worker's ticks from ``from_s`` (each tick once, not once
    per session): the whole latency, the worker's Step, its engine and front end, and what lies outside the
    worker (transport and gateway: the median of latency − worker per tick). None where raw files predate a
    column (engine and front end: 8th and 9th; worker: 10th).

    >>> p = {"sessions": [{"ticks": [[1.0, 1, 600, True, 2, False, 3, 500, 50, 560]]},
    ...                   {"ticks": [[1.0, 1, 600, True, 2, False, 1, 500, 50, 560]]}]}
    >>> tick_breakdown(p)["outside_worker_ms"]
    40.0
    """
    ticks = {}
    for s in point["sessions"]:
        for row in s["ticks"]:
            if row[0] >= from_s:
                ticks.setdefault(row[1], row)
    rows = list(ticks.values())

    def median(column: int) -> float | None:
        values = [r[column] for r in rows if len(r) > column and r[column] is not None]
        return float(np.median(values)) if values else None

    outside = [r[2] - r[9] for r in rows if len(r) > 9 and r[9] is not None]
    return {"ticks": len(rows), "latency_ms": median(2), "worker_ms": median(9), "engine_ms": median(7),
            "frontend_ms": median(8), "outside_worker_ms": float(np.median(outside)) if outside else None}


def analyse_run(point: dict, bucket_s: float, wall_ms: float, quiet_fraction: float, t_end: float) -> dict:
    f = frames(point)
    t = f["t"]
    lat_wall = walled(t, f["latency_ms"], bucket_s, wall_ms, t_end)
    quiet = walled(t, f["preempted"].astype(float), bucket_s, quiet_fraction, t_end, stat=np.mean)
    n = max(1, t.size)
    return {
        "arm": point["arm"], "sessions": point["spec"]["sessions"], "run": point["run"],
        "frames": int(t.size),
        "latency_wall": lat_wall,
        "latency_wall_onset_s": wall_onset(t, f["latency_ms"], bucket_s, wall_ms, t_end),
        "quiet_wall": quiet,
        "quiet_wall_onset_s": wall_onset(t, f["preempted"].astype(float), bucket_s, quiet_fraction, t_end, stat=np.mean),
        "walled": bool(lat_wall or quiet),
        "first_preempted_s": first_time(t, f["preempted"]),
        "preempted_frames": int(f["preempted"].sum()), "preempted_fraction": float(f["preempted"].sum() / n),
        "empty_frames": int(f["empty"].sum()), "empty_fraction": float(f["empty"].sum() / n),
        "deadline_miss_fraction": float((~f["deadline_met"]).sum() / n),
        "latency_p50_ms": float(np.median(f["latency_ms"])) if t.size else None,
        "latency_p99_ms": float(np.percentile(f["latency_ms"], 99)) if t.size else None,
        "latency_max_ms": float(f["latency_ms"].max()) if t.size else None,
        "engine_p50_ms": engine_p50_ms(point),
        "refused": sum(1 for s in point["sessions"] if s["refused"]),
        "chunks_skipped": sum(s["chunks_skipped"] for s in point["sessions"]),
        "chunks_sent": sum(s["chunks_sent"] for s in point["sessions"]),
    }
