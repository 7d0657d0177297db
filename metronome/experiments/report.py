"""Analyse a sweep (``raw.json``) and write ``analysis.json``, PNG plots (if matplotlib is installed) and ``summary.md``."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from metronome.experiments.cliff import analyse_run, bucket_stat, frames
from metronome.monitor.fill import fit_fill, plateau


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def _fmt(x, spec=".1f", none="–"):
    return none if x is None else format(x, spec)


def analyse(raw: dict) -> dict:
    p = raw["preset"]
    bucket_s, wall_ms, quiet = p["bucket_s"], p["wall_ms"], p["quiet_fraction"]
    t_end = raw["duration_s"]
    runs, fills, plateaus = [], [], []
    for point in raw["points"]:
        a = analyse_run(point, bucket_s, wall_ms, quiet, t_end)
        runs.append(a)
        kv = point["kv"]
        if not kv:
            continue
        t = [s["t_s"] for s in kv]
        total = kv[0]["total"]
        rho = [s["used"] / max(1, s["total"]) for s in kv]
        if point["arm"] == "unbounded":
            fit = fit_fill(t, rho, point["spec"]["sessions"])
            measured = a["first_preempted_s"]
            fills.append({"sessions": point["spec"]["sessions"], "run": point["run"], "fit": fit,
                          "measured_stall_s": measured, "latency_wall_onset_s": a["latency_wall_onset_s"],
                          "error_s": (fit["t_wall_s"] - measured) if fit and measured is not None else None})
        else:
            pl = plateau(t, [s["used"] for s in kv], total, point["spec"]["sessions"])
            pl.update(sessions=point["spec"]["sessions"], run=point["run"], max_rho=float(max(rho)))
            plateaus.append(pl)
    groups = defaultdict(list)
    for a in runs:
        groups[(a["arm"], a["sessions"])].append(a)
    table = []
    for (arm, n), rs in sorted(groups.items()):
        table.append({
            "arm": arm, "sessions": n, "runs": len(rs),
            "latency_walls": sum(r["latency_wall"] for r in rs), "quiet_walls": sum(r["quiet_wall"] for r in rs),
            "walls": sum(r["walled"] for r in rs),
            "walls_ci95": wilson_interval(sum(r["walled"] for r in rs), len(rs)),
            "latency_wall_onset_s": _mean([r["latency_wall_onset_s"] for r in rs]),
            "quiet_wall_onset_s": _mean([r["quiet_wall_onset_s"] for r in rs]),
            "first_preempted_s": _mean([r["first_preempted_s"] for r in rs]),
            "preempted_fraction": _mean([r["preempted_fraction"] for r in rs]),
            "empty_fraction": _mean([r["empty_fraction"] for r in rs]),
            "deadline_miss_fraction": _mean([r["deadline_miss_fraction"] for r in rs]),
            "latency_p50_ms": _mean([r["latency_p50_ms"] for r in rs]),
            "latency_p99_ms": _mean([r["latency_p99_ms"] for r in rs]),
            "latency_max_ms": max((r["latency_max_ms"] or 0) for r in rs),
            "engine_p50_ms": _mean([r.get("engine_p50_ms") for r in rs]),
            "refused": sum(r["refused"] for r in rs), "chunks_skipped": sum(r["chunks_skipped"] for r in rs),
        })
    reservation = None
    try:
        from metronome.config import KVPolicy
        from metronome.engine.blocks import blocks_per_session

        pol = KVPolicy(sinks=p["sinks"], window=p["window"], block_size=p["block_size"])
        per = blocks_per_session(pol, p["max_chunk_tokens"], p["max_position_embeddings"])
        reservation = {"blocks_per_session": per, "capacity_sessions": (p["num_blocks"] - 1) // per}
    except Exception:                            # noqa: BLE001 - informational only
        pass
    return {"runs": runs, "table": table, "fills": fills, "plateaus": plateaus, "reservation": reservation}


# ---------------------------------------------------------------------------------------------- plots
def pyplot():
    """matplotlib's pyplot on a file backend, or None without matplotlib (the `experiments` extra): no plots."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(raw: dict, analysis: dict, out: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    p = raw["preset"]
    arms = sorted({pt["arm"] for pt in raw["points"]}, reverse=True)
    ns = sorted({pt["spec"]["sessions"] for pt in raw["points"]})
    written = []
    colours = {"unbounded": "tab:red", "sink_window": "tab:blue"}

    for name, key, ylabel, stat, thr in (
            ("latency_traces.png", "latency_ms", "tick latency (ms)", np.median, p["wall_ms"]),
            ("preempted_traces.png", "preempted", "preempted (empty) frames, fraction", np.mean, p["quiet_fraction"])):
        fig, axes = plt.subplots(len(ns), len(arms), figsize=(5.5 * len(arms), 3.2 * len(ns)), squeeze=False,
                                 sharex=True, sharey=True)
        for i, n in enumerate(ns):
            for j, arm in enumerate(arms):
                ax = axes[i][j]
                for pt in raw["points"]:
                    if pt["arm"] != arm or pt["spec"]["sessions"] != n:
                        continue
                    f = frames(pt)
                    vals = f[key].astype(float)
                    if key == "latency_ms":
                        ax.scatter(f["t"], vals, s=1, alpha=0.15, color=colours.get(arm, "k"))
                    starts, med = bucket_stat(f["t"], vals, p["bucket_s"], raw["duration_s"], stat)
                    ax.step(starts + p["bucket_s"], med, where="pre", lw=1.2, label=f"run {pt['run']}")
                ax.axhline(thr, color="k", ls="--", lw=0.8)
                ax.set_title(f"{arm}, N={n}", fontsize=9)
                if key == "latency_ms":
                    ax.set_yscale("log")
                if i == len(ns) - 1:
                    ax.set_xlabel("time since first arrival (s)")
                if j == 0:
                    ax.set_ylabel(ylabel, fontsize=8)
                ax.legend(fontsize=6, loc="upper left")
        fig.suptitle(f"{name[:-4].replace('_', ' ')} — bucket {p['bucket_s']:g} s, rule threshold dashed "
                     f"(preset {p['name']}, B={p['budget_ms']:g} ms)", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    fig, axes = plt.subplots(1, len(ns), figsize=(5.5 * len(ns), 3.6), squeeze=False)
    fills = {(f["sessions"], f["run"]): f for f in analysis["fills"]}
    for i, n in enumerate(ns):
        ax = axes[0][i]
        for pt in raw["points"]:
            if pt["spec"]["sessions"] != n or not pt["kv"]:
                continue
            t = np.array([s["t_s"] for s in pt["kv"]])
            rho = np.array([s["used"] / max(1, s["total"]) for s in pt["kv"]])
            c = colours.get(pt["arm"], "k")
            ax.plot(t, rho, color=c, lw=1, alpha=0.8, label=f"{pt['arm']} r{pt['run']}")
            f = fills.get((n, pt["run"])) if pt["arm"] == "unbounded" else None
            if f and f["fit"]:
                fit = f["fit"]
                tt = np.linspace(0, fit["t_wall_s"], 20)
                ax.plot(tt, fit["rho0"] + fit["slope"] * tt, color="k", ls=":", lw=0.8)
                ax.axvline(fit["t_wall_s"], color="tab:orange", ls="--", lw=0.8)
                if f["measured_stall_s"] is not None:
                    ax.axvline(f["measured_stall_s"], color="tab:red", ls="-", lw=0.6, alpha=0.6)
        ax.axhspan(0.1, 0.8, color="0.9", zorder=0)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"KV pool in use, N={n} (fit band shaded; orange: predicted stall, red: first preemption)",
                     fontsize=7)
        ax.set_xlabel("time since first arrival (s)")
        ax.set_ylabel("ρ = blocks used / pool")
        ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "kv_fill.png", dpi=110)
    plt.close(fig)
    written.append("kv_fill.png")
    return written


# ---------------------------------------------------------------------------------------------- markdown
def markdown(raw: dict, analysis: dict, plots: list[str], focus: str) -> str:
    p, m = raw["preset"], raw["machine"]
    L = [f"# {focus} — preset `{p['name']}`", "",
         f"- command: `{raw.get('command', '')}`",
         f"- machine: {m.get('platform')}, {m.get('cpus')} CPUs, torch {m.get('torch')}"
         + (f", GPU {m['cuda']}" if m.get("cuda") else "") + f", load average at start {m.get('load_avg')}",
         f"- started {raw.get('started')}, finished {raw.get('finished', '?')}, sweep took {raw.get('elapsed_s', '?')} s",
         f"- model `{p['model']}` on {p['device']} ({p['dtype']}), energy adapter, B = {p['budget_ms']:g} ms, "
         f"τ = {p['tokens_per_tick']} tokens/tick, free-running sessions",
         f"- N ∈ {list(sorted({pt['spec']['sessions'] for pt in raw['points']}))}, R = {raw['runs_per_point']} runs each, "
         f"{raw['duration_s']:g} s per run, open-loop arrivals at {p['arrival_rate']:g}/s, fresh worker process per run",
         f"- KV pool {p['num_blocks']} blocks × {p['block_size']} tokens; arms: Unbounded (`window=None`, "
         f"vLLM-like admission, preemption by recompute) vs SinkWindow (S = {p['sinks']}, W = {p['window']})",
         f"- wall rule: median of the last three {p['bucket_s']:g}-s bucket medians of tick latency > "
         f"{p['wall_ms']:g} ms = {p['wall_ms'] / p['budget_ms']:g}·B (the paper: 10 s / 500 ms at B = 2 s, i.e. 5·B / 0.25·B); quiet wall: the "
         f"same over the preempted-frame fraction > {p['quiet_fraction']:g}", ""]
    L += ["## Cliff", "",
          "| arm | N | walls (either) | walled, 95 % CI | latency walls | quiet walls | latency-wall onset s | quiet-wall onset s "
          "| first preemption s | preempted frames | empty frames (1 − delivery) | deadline misses | p50 ms | p99 ms "
          "| max ms | engine p50 ms |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in analysis["table"]:
        lo, hi = r["walls_ci95"]
        L.append(f"| {r['arm']} | {r['sessions']} | {r['walls']}/{r['runs']} | {lo:.0%}–{hi:.0%} | "
                 f"{r['latency_walls']}/{r['runs']} | "
                 f"{r['quiet_walls']}/{r['runs']} | {_fmt(r['latency_wall_onset_s'])} | {_fmt(r['quiet_wall_onset_s'])} | "
                 f"{_fmt(r['first_preempted_s'])} | "
                 f"{r['preempted_fraction']:.1%} | {r['empty_fraction']:.1%} | {r['deadline_miss_fraction']:.1%} | "
                 f"{_fmt(r['latency_p50_ms'], '.0f')} | {_fmt(r['latency_p99_ms'], '.0f')} | {_fmt(r['latency_max_ms'], '.0f')} | "
                 f"{_fmt(r['engine_p50_ms'], '.0f')} |")
    refused = sum(r["refused"] for r in analysis["table"])
    skipped = sum(r["chunks_skipped"] for r in analysis["table"])
    L += ["", f"Sessions refused: {refused}. Audio chunks the load generator skipped (>100 ms late): {skipped}.", ""]
    L += ["## Fill model (Unbounded)", "",
          "ρ(t) = ρ0 + N·r·t fitted on the growth-phase samples with 0.1 < ρ < 0.8 (before ρ first reaches 0.8); "
          "predicted stall = (1 − ρ0)/(N·r); measured stall = first preempted frame (the pool ran dry).", "",
          "| N | run | ρ0 | N·r (%/s) | r (%/s/session) | samples | predicted stall s | measured stall s | error s "
          "| latency-wall onset s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for f in sorted(analysis["fills"], key=lambda f: (f["sessions"], f["run"])):
        fit = f["fit"]
        if not fit:
            L.append(f"| {f['sessions']} | {f['run']} | – | – | – | – | – | {_fmt(f['measured_stall_s'])} | – | – |")
            continue
        L.append(f"| {f['sessions']} | {f['run']} | {fit['rho0']:.3f} | {100 * fit['slope']:.2f} | "
                 f"{100 * fit['r_per_session']:.3f} | {fit['samples']} | {fit['t_wall_s']:.1f} | "
                 f"{_fmt(f['measured_stall_s'])} | {_fmt(f['error_s'], '+.1f')} | {_fmt(f['latency_wall_onset_s'])} |")
    errs = [abs(f["error_s"]) for f in analysis["fills"] if f["error_s"] is not None]
    if errs:
        L += ["", f"Mean |predicted − measured| = {np.mean(errs):.2f} s over {len(errs)} runs (max {max(errs):.2f} s)."]
    L += ["", "## SinkWindow plateau", "",
          "| N | run | steady blocks | blocks/session | pool per session | ceiling implied (sessions) | max ρ |",
          "|---|---|---|---|---|---|---|"]
    for pl in sorted(analysis["plateaus"], key=lambda x: (x["sessions"], x["run"])):
        L.append(f"| {pl['sessions']} | {pl['run']} | {pl['steady_blocks']:.0f} | {pl['blocks_per_session']:.2f} | "
                 f"{pl['pool_fraction_per_session']:.2%} | {pl['ceiling_sessions']:.0f} | {pl['max_rho']:.2f} |")
    res = analysis.get("reservation")
    if res:
        L += ["", f"Reserved at admission (the one formula, worst case): {res['blocks_per_session']} blocks/session, "
                  f"i.e. {res['capacity_sessions']} sessions in this pool; the measured plateau is the typical footprint."]
    if plots:
        L += ["", "## Plots", ""] + [f"![{x}]({x})" for x in plots]
    else:
        L += ["", "(matplotlib is not installed: no plots)"]
    return "\n".join(L) + "\n"


def write_outputs(raw: dict, out: Path, analyse, plot, markdown) -> str:
    """What every experiment writes under ``out``: ``analysis.json``, its plots, ``summary.md`` (returned)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    analysis = analyse(raw)
    (out / "analysis.json").write_text(json.dumps(analysis, indent=1))
    plots = plot(raw, analysis, out)
    text = markdown(raw, analysis, plots)
    (out / "summary.md").write_text(text)
    return text


def write_report(raw: dict, out: Path, focus: str = "cliff") -> str:
    return write_outputs(raw, out, analyse, plot, lambda r, a, p: markdown(r, a, p, focus))


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95 % by default) for k successes in n trials: it stays inside [0, 1] and
    is honest at k = 0 or k = n, where the normal approximation collapses to a point."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, float(centre - half)), min(1.0, float(centre + half))


def merge_raws(raws: list[dict]) -> dict:
    """Parts of one sweep run in separate processes (``--first-run``) as one raw result.

    The parts must share the preset and run length, and no (arm, N, run) may appear twice."""
    first = raws[0]
    for other in raws[1:]:
        if other["preset"] != first["preset"] or other["duration_s"] != first["duration_s"]:
            raise ValueError("the parts were run with different settings; only parts of one sweep can be joined")
    points = [pt for raw in raws for pt in raw["points"]]
    keys = [(pt["arm"], pt["spec"]["sessions"], pt["run"]) for pt in points]
    if len(set(keys)) != len(keys):
        raise ValueError("two parts hold the same (arm, N, run): give each part its own --first-run")
    runs = {(pt["arm"], pt["spec"]["sessions"]): set() for pt in points}
    for arm, n, r in keys:
        runs[(arm, n)].add(r)
    return {**first, "points": points, "runs_per_point": min(len(v) for v in runs.values()),
            "command": " + ".join(raw["command"] for raw in raws),
            "started": min(raw["started"] for raw in raws), "finished": max(raw.get("finished", "") for raw in raws),
            "elapsed_s": sum(raw.get("elapsed_s", 0.0) for raw in raws),
            "parts": [{"machine": raw["machine"], "started": raw["started"], "command": raw["command"]}
                      for raw in raws]}


def load_raw(path) -> dict:
    """A saved run's raw results (``raw.json`` or ``raw.json.gz``), for ``--from`` re-analysis."""
    import gzip
    import json
    from pathlib import Path

    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if str(path).endswith(".gz") else data)
