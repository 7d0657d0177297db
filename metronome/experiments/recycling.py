"""The recycling experiment: application-level recycling vs the in-engine SinkWindow — latency against session age.

Without a bounded KV policy in the engine, an application keeps a long session alive by *recycling*:
every ``period_s`` (the paper: 30 s at B = 2 s; scaled by the preset) it ends the session's context and
starts a fresh one, re-prefilling the last frames so the model keeps some recent context. That is
implemented here where an application would do it — over the unmodified engine, between the worker
and ``Engine`` (``RecyclingEngine`` wraps the engine object the worker drives; nothing in the engine
knows): the wrapper keeps the last ``tail_tokens`` tokens each session consumed (its inputs and its
decoded tokens), and on the first step after the period it closes the engine session, opens a new one
(Unbounded policy, absolute positions restarting at 0) and prefills the tail in ``max_chunk_tokens``
pieces before the tick's own input. The re-prefill happens inside the tick, so its cost lands in the
tick latency the gateway measures, as it would for a real application.

Arms: ``recycling`` (Unbounded engine + wrapper) and ``sink_window`` (S, W in the engine, nothing
re-prefilled); same load (N free-running sessions, speech or noise through the real gateway).
Analysis (``analyse``): tick latency binned by *session age* (time since the session connected),
p50/p99 per bin per arm; latency of the ticks in which a recycle happened vs the others; KV in use.

    metronome bench recycling --preset cpu
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from metronome.experiments.cliff import frames
from metronome.experiments.report import pyplot, write_outputs


@dataclass(frozen=True)
class RecyclingPreset:
    name: str
    model: str
    device: str
    dtype: str
    budget_ms: float
    tokens_per_tick: int
    sessions: tuple[int, ...]
    runs: int
    duration_s: float
    arrival_rate: float
    num_blocks: int              # large enough that the recycled Unbounded contexts never run the pool dry
    block_size: int
    sinks: int
    window: int
    max_chunk_tokens: int
    max_position_embeddings: int
    recycle_s: float             # the paper's 30 s at B = 2 s, scaled
    tail_tokens: int             # re-prefilled on recycle (the preset: W, what SinkWindow keeps besides its sinks)
    age_bin_s: float
    sample_s: float = 0.5
    audio: str = "speech"

    def to_dict(self) -> dict:
        return asdict(self)


# B = 250 ms: the paper's 30 s at B = 2 s is 15 ticks, here 3.75 s; ~7 tokens per session per tick, so a
# context grows from the 64-token tail to ~170 tokens before it is recycled.
CPU = RecyclingPreset(name="cpu", model="tiny-random", device="cpu", dtype="float32", budget_ms=250.0,
                      tokens_per_tick=4, sessions=(16,), runs=2, duration_s=30.0, arrival_rate=8.0,
                      num_blocks=1024, block_size=16, sinks=4, window=64, max_chunk_tokens=32,
                      max_position_embeddings=8192, recycle_s=3.75, tail_tokens=64, age_bin_s=1.25)

# The paper's setting on one H200 with a Qwen2.5-7B-shaped random-weight decoder (shapes.py; about 80
# minutes of it): B = 2 s, recycle every 30 s, re-prefill W = 1024 tokens. A session adds ~50 tokens a tick
# (25 audio + 25 decoded), so a recycled context peaks at ~1024 + 15·50 + 64 ≈ 1840 tokens (115 blocks);
# 128 sessions need ~14.7k blocks: 32768 leave room.
GPU = RecyclingPreset(name="gpu", model="random:qwen2.5-7b", device="cuda", dtype="bfloat16", budget_ms=2000.0,
                      tokens_per_tick=25, sessions=(64, 128), runs=5, duration_s=240.0, arrival_rate=8.0,
                      num_blocks=32768, block_size=16, sinks=16, window=1024, max_chunk_tokens=64,
                      max_position_embeddings=32768, recycle_s=30.0, tail_tokens=1024, age_bin_s=10.0,
                      sample_s=1.0)
# About 4 minutes of an H200: N = 64, one 100-s run per arm (three recycles per session).
GPU_SHORT = replace(GPU, name="gpu-short", sessions=(64,), runs=1, duration_s=100.0)

PRESETS = {"cpu": CPU, "gpu": GPU, "gpu-short": GPU_SHORT}
ARMS = ("recycling", "sink_window")


def server_spec(preset: RecyclingPreset, arm: str, n: int, seed: int) -> dict:
    sinks, window = (0, None) if arm == "recycling" else (preset.sinks, preset.window)
    spec = dict(model=preset.model, device=preset.device, dtype=preset.dtype, sinks=sinks, window=window,
                block_size=preset.block_size, num_blocks=preset.num_blocks, max_chunk_tokens=preset.max_chunk_tokens,
                budget_ms=preset.budget_ms, tokens_per_tick=preset.tokens_per_tick, sessions=n, seed=seed)
    if arm == "recycling":
        spec["recycle"] = {"period_s": preset.recycle_s, "tail_tokens": preset.tail_tokens}
    return spec


def plan(preset: RecyclingPreset, *, sessions=None, runs=None, duration_s=None):
    from metronome.experiments.points import Point

    out = []
    for r in range(runs or preset.runs):
        for n in sessions or preset.sessions:
            for arm in ARMS:        # interleaved, so drift of a shared machine hits both arms alike
                load = dict(sessions=n, rate=preset.arrival_rate, duration_s=duration_s or preset.duration_s,
                            sample_s=preset.sample_s, seed=r, audio=preset.audio)
                out.append(Point(f"{arm}-N{n}-r{r}", server_spec(preset, arm, n, r), load,
                                 {"arm": arm, "run": r, "sessions_n": n}))
    return out


def run_recycling(preset: RecyclingPreset, out: Path, *, sessions=None, runs=None, duration_s=None,
                  progress=True) -> dict:
    from metronome.experiments.points import run_points

    return run_points("recycling", preset.to_dict(), plan(preset, sessions=sessions, runs=runs, duration_s=duration_s),
                      out, progress=progress, max_position_embeddings=preset.max_position_embeddings)


# ------------------------------------------------------------------------------------ analysis
def frame_ages(point: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(t, session age, latency_ms) of every frame of a point; age = t − the session's connect time."""
    t, age, lat = [], [], []
    for s in point["sessions"]:
        if s["connected_s"] is None:
            continue
        for row in s["ticks"]:
            t.append(row[0])
            age.append(row[0] - s["connected_s"])
            lat.append(row[2])
    return np.asarray(t, float), np.asarray(age, float), np.asarray(lat, float)


def age_profile(age, latency, bin_s: float, max_age: float | None = None) -> dict:
    """Per age bin ``[k·bin_s, (k+1)·bin_s)``: frame count, p50 and p99 latency (NaN when empty).

    >>> p = age_profile([0.1, 0.2, 1.1, 1.2], [10, 20, 30, 50], 1.0)
    >>> p["start_s"], p["p50_ms"], p["frames"]
    ([0.0, 1.0], [15.0, 40.0], [2, 2])
    """
    age, latency = np.asarray(age, float), np.asarray(latency, float)
    top = float(age.max()) if max_age is None and age.size else (max_age or 0.0)
    k = int(np.floor(top / bin_s)) + 1 if age.size else 0
    idx = np.floor(age / bin_s).astype(int)
    out = {"start_s": [], "frames": [], "p50_ms": [], "p99_ms": []}
    for i in range(k):
        sel = latency[idx == i]
        out["start_s"].append(round(i * bin_s, 6))
        out["frames"].append(int(sel.size))
        out["p50_ms"].append(float(np.median(sel)) if sel.size else float("nan"))
        out["p99_ms"].append(float(np.percentile(sel, 99)) if sel.size else float("nan"))
    return out


def recycle_frames(t, event_times, budget_s: float) -> np.ndarray:
    """Which frames came from a tick that re-prefilled: a frame arriving within one budget after a recycle.

    >>> recycle_frames([1.0, 1.1, 1.3, 2.0], [1.05], 0.25).tolist()
    [False, True, True, False]
    """
    t = np.asarray(t, float)
    hit = np.zeros(t.size, bool)
    for e in event_times:
        hit |= (t >= e) & (t <= e + budget_s)
    return hit


def analyse_point(point: dict, budget_ms: float, bin_s: float) -> dict:
    t, age, lat = frame_ages(point)
    f = frames(point)
    t0 = point.get("t0_monotonic")
    events = point.get("events") or []
    ev_t = [e["t"] - t0 for e in events] if t0 is not None else []
    hit = recycle_frames(t, sorted(set(ev_t)), budget_ms / 1000.0)
    kv = point.get("kv") or []
    used = np.array([k["used"] for k in kv], float)
    n = point.get("sessions_n") or point["spec"]["sessions"]
    steady = used[len(used) // 3:] if used.size else used
    return {
        "arm": point["arm"], "run": point.get("run", 0), "sessions": n, "frames": int(t.size),
        "p50_ms": float(np.median(lat)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "max_ms": float(lat.max()) if lat.size else None,
        "deadline_miss_fraction": float((~f["deadline_met"]).mean()) if f["t"].size else None,
        "preempted_fraction": float(f["preempted"].mean()) if f["t"].size else None,
        "recycles": len(events),
        "recycle_ms_mean": float(np.mean([e["ms"] for e in events])) if events else None,
        "recycle_ms_max": float(max(e["ms"] for e in events)) if events else None,
        "ended_tokens_mean": float(np.mean([e["ended_tokens"] for e in events])) if events else None,
        "tail_tokens_mean": float(np.mean([e["tail_tokens"] for e in events])) if events else None,
        "recycle_tick_frames": int(hit.sum()),
        "recycle_tick_p50_ms": float(np.median(lat[hit])) if hit.any() else None,
        "other_tick_p50_ms": float(np.median(lat[~hit])) if (~hit).any() else None,
        "kv_blocks_max": float(used.max()) if used.size else None,
        "kv_blocks_per_session_steady": float(np.median(steady) / n) if steady.size else None,
        "kv_blocks_per_session_max": float(used.max() / n) if used.size else None,
        "profile": age_profile(age, lat, bin_s),
        "refused": sum(1 for s in point["sessions"] if s["refused"]),
    }


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def analyse(raw: dict) -> dict:
    p = raw["preset"]
    rows = [analyse_point(pt, p["budget_ms"], p["age_bin_s"]) for pt in raw["points"]]
    table = []
    for arm in ARMS:
        for n in sorted({r["sessions"] for r in rows if r["arm"] == arm}):
            rs = [r for r in rows if r["arm"] == arm and r["sessions"] == n]
            keys = ("p50_ms", "p99_ms", "deadline_miss_fraction", "recycle_ms_mean", "recycle_tick_p50_ms",
                    "other_tick_p50_ms", "kv_blocks_per_session_steady", "kv_blocks_per_session_max",
                    "ended_tokens_mean", "tail_tokens_mean")
            row = {"arm": arm, "sessions": n, "runs": len(rs), **{k: _mean([r[k] for r in rs]) for k in keys},
                   "max_ms": max((r["max_ms"] or 0.0) for r in rs), "recycles": sum(r["recycles"] for r in rs),
                   "recycle_ms_max": max((r["recycle_ms_max"] or 0.0) for r in rs),
                   "refused": sum(r["refused"] for r in rs)}
            # pooled age profile over runs
            age_lat = [frame_ages(pt)[1:] for pt in raw["points"]
                       if pt["arm"] == arm and (pt.get("sessions_n") or pt["spec"]["sessions"]) == n]
            ages = np.concatenate([a for a, _ in age_lat]) if age_lat else np.zeros(0)
            lats = np.concatenate([b for _, b in age_lat]) if age_lat else np.zeros(0)
            row["profile"] = age_profile(ages, lats, p["age_bin_s"])
            table.append(row)
    return {"experiment": "recycling", "runs": rows, "table": table}


# ------------------------------------------------------------------------------------ report
def _fmt(x, spec=".1f"):
    return "–" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def plot(raw: dict, analysis: dict, out: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    p = raw["preset"]
    colours = {"recycling": "tab:red", "sink_window": "tab:blue"}
    written = []
    ns = sorted({r["sessions"] for r in analysis["table"]})
    fig, axes = plt.subplots(1, len(ns), figsize=(6.5 * len(ns), 3.8), squeeze=False)
    for i, n in enumerate(ns):
        ax = axes[0][i]
        for row in analysis["table"]:
            if row["sessions"] != n:
                continue
            prof = row["profile"]
            x = np.asarray(prof["start_s"]) + p["age_bin_s"] / 2
            c = colours.get(row["arm"], "k")
            ax.plot(x, prof["p50_ms"], color=c, lw=1.5, label=f"{row['arm']} p50")
            ax.plot(x, prof["p99_ms"], color=c, lw=1, ls="--", label=f"{row['arm']} p99")
        for pt in raw["points"]:
            if (pt.get("sessions_n") or pt["spec"]["sessions"]) == n:
                _, age, lat = frame_ages(pt)
                ax.scatter(age, lat, s=1, alpha=0.08, color=colours.get(pt["arm"], "k"))
        k = 1
        while k * p["recycle_s"] < raw["points"][0]["load"]["duration_s"]:
            ax.axvline(k * p["recycle_s"], color="0.6", lw=0.6, ls=":")
            k += 1
        ax.set_yscale("log")
        ax.set_xlabel("session age (s); dotted: recycle period")
        ax.set_ylabel("tick latency (ms)")
        ax.set_title(f"N={n}: latency vs session age (B={p['budget_ms']:g} ms)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_vs_age.png", dpi=110)
    plt.close(fig)
    written.append("latency_vs_age.png")

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for pt in raw["points"]:
        if not pt.get("kv"):
            continue
        n = pt.get("sessions_n") or pt["spec"]["sessions"]
        ax.plot([k["t_s"] for k in pt["kv"]], [k["used"] / n for k in pt["kv"]], color=colours.get(pt["arm"], "k"),
                lw=1, alpha=0.8, label=f"{pt['arm']} N={n} r{pt.get('run', 0)}")
    ax.set_xlabel("time since first arrival (s)")
    ax.set_ylabel("KV blocks in use per session")
    ax.set_title("KV memory: recycled contexts saw-tooth, SinkWindow holds a plateau", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "kv_per_session.png", dpi=110)
    plt.close(fig)
    written.append("kv_per_session.png")
    return written


def markdown(raw: dict, analysis: dict, plots: list[str]) -> str:
    p, m = raw["preset"], raw.get("machine", {})
    L = ["# recycling — preset `" + p["name"] + "`", "",
         f"- command: `{raw.get('command', '')}`",
         f"- machine: {m.get('platform')}, {m.get('cpus')} CPUs, torch {m.get('torch')}"
         + (f", GPU {m['cuda']}" if m.get("cuda") else "") + f", load average at start {m.get('load_avg')}",
         f"- started {raw.get('started')}, finished {raw.get('finished', '?')}, took {raw.get('elapsed_s', '?')} s",
         f"- model `{p['model']}` on {p['device']} ({p['dtype']}), energy adapter, B = {p['budget_ms']:g} ms, "
         f"τ = {p['tokens_per_tick']}, free-running sessions streaming {p['audio']}, arrivals {p['arrival_rate']:g}/s, "
         f"{raw['points'][0]['load']['duration_s'] if raw['points'] else '?'} s per run, fresh server per run",
         f"- **recycling**: Unbounded engine; the application layer (`RecyclingEngine`, between worker and engine) ends "
         f"each session's context every {p['recycle_s']:g} s of session age and re-prefills its last "
         f"{p['tail_tokens']} tokens into a fresh one, inside the tick",
         f"- **sink_window**: S = {p['sinks']}, W = {p['window']} in the engine; KV pool {p['num_blocks']} blocks × "
         f"{p['block_size']}", ""]
    L += ["| arm | N | runs | p50 ms | p99 ms | max ms | deadline misses | recycles | re-prefill ms (mean / max) "
          "| tokens ended / re-prefilled | p50 of recycle ticks | p50 of other ticks | KV blocks/session (steady / max) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in analysis["table"]:
        L.append(f"| {r['arm']} | {r['sessions']} | {r['runs']} | {_fmt(r['p50_ms'])} | {_fmt(r['p99_ms'])} | "
                 f"{_fmt(r['max_ms'])} | {_fmt(100 * r['deadline_miss_fraction'] if r['deadline_miss_fraction'] is not None else None, '.2f')} % | "
                 f"{r['recycles']} | {_fmt(r['recycle_ms_mean'])} / {_fmt(r['recycle_ms_max'] or None)} | "
                 f"{_fmt(r['ended_tokens_mean'], '.0f')} / {_fmt(r['tail_tokens_mean'], '.0f')} | "
                 f"{_fmt(r['recycle_tick_p50_ms'])} | {_fmt(r['other_tick_p50_ms'])} | "
                 f"{_fmt(r['kv_blocks_per_session_steady'], '.2f')} / {_fmt(r['kv_blocks_per_session_max'], '.2f')} |")
    L += ["", "## Latency by session age (p50 / p99 ms, runs pooled)", ""]
    for r in analysis["table"]:
        prof = r["profile"]
        cells = [f"{s:g}s: {_fmt(a, '.0f')}/{_fmt(b, '.0f')}" for s, a, b in
                 zip(prof["start_s"], prof["p50_ms"], prof["p99_ms"])]
        L.append(f"- {r['arm']}, N={r['sessions']}: " + ", ".join(cells))
    L += ["", "A frame counts as a *recycle tick* when it arrived within one B after a recycle (the wrapper's "
              "monotonic clock, shared with the load generator's on one machine)."]
    if plots:
        L += ["", "## Plots", ""] + [f"![{x}]({x})" for x in plots]
    return "\n".join(L) + "\n"


def write_report(raw: dict, out: Path) -> str:
    return write_outputs(raw, out, analyse, plot, markdown)
