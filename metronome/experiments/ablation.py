"""The ablation experiment: window and sink ablation — tick latency and KV memory for several W and S.

Every (S, W) of the preset's grid runs N free-running sessions on a fresh server through the real
gateway (``points.run_points``). Latency is measured in the steady state, once every session's window
has filled (frames after ``steady_from_s``); memory three ways: the reservation the engine makes at
admission (``blocks_per_session``, the one formula, worst case), the blocks a session actually holds
once steady (median of the KV samples over the steady part / N), and those blocks in bytes
(``kv_bytes_per_token`` of the model and dtype × block size).

    metronome bench ablation --preset cpu
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from metronome.experiments.cliff import frames
from metronome.experiments.report import pyplot, write_outputs


@dataclass(frozen=True)
class AblationPreset:
    name: str
    model: str
    device: str
    dtype: str
    budget_ms: float
    tokens_per_tick: int
    sessions: int
    runs: int
    duration_s: float
    steady_from_s: float          # frames and KV samples after this count as steady (all windows full)
    arrival_rate: float
    windows: tuple[int, ...]
    sinks: tuple[int, ...]
    num_blocks: int
    block_size: int
    max_chunk_tokens: int
    max_position_embeddings: int
    sample_s: float = 0.5
    audio: str = "speech"

    def to_dict(self) -> dict:
        return asdict(self)


# ~7 tokens per session per 250-ms tick (28/s): W = 256 fills ~9 s after a session arrives; all 16 sessions
# have arrived by 2 s, so frames after 12 s are steady. 1024 blocks hold 16 sessions of W = 256 + S = 16.
CPU = AblationPreset(name="cpu", model="tiny-random", device="cpu", dtype="float32", budget_ms=250.0,
                     tokens_per_tick=4, sessions=16, runs=1, duration_s=24.0, steady_from_s=12.0, arrival_rate=8.0,
                     windows=(32, 96, 256), sinks=(0, 4, 16), num_blocks=1024, block_size=16, max_chunk_tokens=32,
                     max_position_embeddings=8192)

# A Qwen2.5-7B-shaped random-weight decoder (shapes.py) on one H200 (about 4 hours of it): 128 sessions
# at B = 2 s, ~50 tokens a tick (25/s): W = 4096 fills ~165 s after a session arrives (the last at 16 s), so
# the run lasts 300 s and the steady part starts at 240 s.
GPU = AblationPreset(name="gpu", model="random:qwen2.5-7b", device="cuda", dtype="bfloat16", budget_ms=2000.0,
                     tokens_per_tick=25, sessions=128, runs=3, duration_s=300.0, steady_from_s=240.0, arrival_rate=8.0,
                     windows=(256, 1024, 4096), sinks=(0, 4, 16, 64), num_blocks=40000, block_size=16,
                     max_chunk_tokens=64, max_position_embeddings=32768, sample_s=1.0)
# About 7 minutes of an H200: W ∈ {256, 1024} × S ∈ {0, 16}, one 90-s run each; W = 1024 is full
# ~42 s after a session arrives, so every window is full from ~58 s and frames from 70 s count as steady.
GPU_SHORT = replace(GPU, name="gpu-short", runs=1, duration_s=90.0, steady_from_s=70.0, windows=(256, 1024),
                    sinks=(0, 16))

PRESETS = {"cpu": CPU, "gpu": GPU, "gpu-short": GPU_SHORT}


def kv_bytes_per_token(model: str, dtype: str) -> int | None:
    """K and V bytes per token for the model (the tiny random model of the CPU presets, or a checkpoint)."""
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    if model == "tiny-random":              # sweep.make_tiny_checkpoint: 2 layers, 2 KV heads of 64 / 4 = 16
        return 2 * 2 * 2 * 16 * size
    try:
        from metronome.models.loader import read_config, resolve_checkpoint

        from metronome.experiments.shapes import RANDOM_PREFIX, SHAPES, is_random

        c = SHAPES[model[len(RANDOM_PREFIX):]] if is_random(model) else read_config(resolve_checkpoint(model))
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * size
    except Exception:                       # noqa: BLE001 - informational
        return None


def reservation(sinks: int, window: int, block_size: int, max_chunk_tokens: int, max_pos: int) -> int:
    """Blocks the engine reserves per session at admission (the one formula)."""
    from metronome.config import KVPolicy
    from metronome.engine.blocks import blocks_per_session

    return blocks_per_session(KVPolicy(sinks=sinks, window=window, block_size=block_size), max_chunk_tokens, max_pos)


def plan(preset: AblationPreset, *, runs=None, duration_s=None):
    from metronome.experiments.points import Point

    out = []
    for r in range(runs or preset.runs):
        for w in preset.windows:
            for s in preset.sinks:
                spec = dict(model=preset.model, device=preset.device, dtype=preset.dtype, sinks=s, window=w,
                            block_size=preset.block_size, num_blocks=preset.num_blocks,
                            max_chunk_tokens=preset.max_chunk_tokens, budget_ms=preset.budget_ms,
                            tokens_per_tick=preset.tokens_per_tick, sessions=preset.sessions, seed=r)
                load = dict(sessions=preset.sessions, rate=preset.arrival_rate,
                            duration_s=duration_s or preset.duration_s, sample_s=preset.sample_s, seed=r,
                            audio=preset.audio)
                out.append(Point(f"S{s}-W{w}-r{r}", spec, load, {"sinks": s, "window": w, "run": r}))
    return out


def run_ablation(preset: AblationPreset, out: Path, *, runs=None, duration_s=None, progress=True) -> dict:
    from metronome.experiments.points import run_points

    return run_points("ablation", preset.to_dict(), plan(preset, runs=runs, duration_s=duration_s), out,
                      progress=progress, max_position_embeddings=preset.max_position_embeddings,
                      extra={"kv_bytes_per_token": kv_bytes_per_token(preset.model, preset.dtype)})


# ------------------------------------------------------------------------------------ analysis
def steady_stats(point: dict, steady_from_s: float) -> dict:
    """Latency over frames after ``steady_from_s``; blocks held per session over KV samples after it."""
    f = frames(point)
    sel = f["t"] >= steady_from_s
    lat = f["latency_ms"][sel]
    n = point["spec"]["sessions"]
    kv = [k for k in point.get("kv") or [] if k["t_s"] >= steady_from_s]
    used = np.array([k["used"] for k in kv], float)
    live = np.array([k["sessions"] for k in kv], float)
    per = used / np.maximum(live, 1) if used.size else used
    return {"frames": int(sel.sum()),
            "p50_ms": float(np.median(lat)) if lat.size else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
            "mean_ms": float(lat.mean()) if lat.size else None,
            "deadline_miss_fraction": float((~f["deadline_met"][sel]).mean()) if lat.size else None,
            "blocks_per_session": float(np.median(per)) if per.size else None,
            "blocks_per_session_max": float(per.max()) if per.size else None,
            "sessions_live": float(np.median(live)) if live.size else None,
            "refused": sum(1 for s in point["sessions"] if s["refused"]), "sessions": n}


def analyse(raw: dict) -> dict:
    p = raw["preset"]
    bpt = raw.get("kv_bytes_per_token")
    rows = []
    for pt in raw["points"]:
        st = steady_stats(pt, p["steady_from_s"])
        res = reservation(pt["sinks"], pt["window"], p["block_size"], p["max_chunk_tokens"], p["max_position_embeddings"])
        rows.append({"sinks": pt["sinks"], "window": pt["window"], "run": pt.get("run", 0), **st,
                     "reserved_blocks": res,
                     "reserved_bytes": res * p["block_size"] * bpt if bpt else None,
                     "steady_bytes": st["blocks_per_session"] * p["block_size"] * bpt
                     if bpt and st["blocks_per_session"] is not None else None,
                     "capacity_sessions": (p["num_blocks"] - 1) // res})
    table = []
    for key in sorted({(r["sinks"], r["window"]) for r in rows}, key=lambda k: (k[1], k[0])):
        rs = [r for r in rows if (r["sinks"], r["window"]) == key]
        agg = {k: (float(np.mean([r[k] for r in rs if r[k] is not None])) if any(r[k] is not None for r in rs) else None)
               for k in ("p50_ms", "p99_ms", "mean_ms", "deadline_miss_fraction", "blocks_per_session",
                         "blocks_per_session_max", "steady_bytes")}
        table.append({"sinks": key[0], "window": key[1], "runs": len(rs), **agg,
                      "reserved_blocks": rs[0]["reserved_blocks"], "reserved_bytes": rs[0]["reserved_bytes"],
                      "capacity_sessions": rs[0]["capacity_sessions"], "refused": sum(r["refused"] for r in rs)})
    return {"experiment": "ablation", "runs": rows, "table": table}


def _fmt(x, spec=".1f"):
    return "–" if x is None else format(x, spec)


def plot(raw: dict, analysis: dict, out: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    table = analysis["table"]
    sinks = sorted({r["sinks"] for r in table})
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, s in enumerate(sinks):
        rs = sorted([r for r in table if r["sinks"] == s], key=lambda r: r["window"])
        w = [r["window"] for r in rs]
        c = f"C{i}"
        axes[0].plot(w, [r["p50_ms"] for r in rs], color=c, marker="o", label=f"S={s} p50")
        axes[0].plot(w, [r["p99_ms"] for r in rs], color=c, marker="x", ls="--", label=f"S={s} p99")
        axes[1].plot(w, [r["blocks_per_session"] for r in rs], color=c, marker="o", label=f"S={s} held (steady)")
        axes[1].plot(w, [r["reserved_blocks"] for r in rs], color=c, marker="s", ls=":", label=f"S={s} reserved")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("window W (tokens)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("steady tick latency (ms)")
    axes[1].set_ylabel("KV blocks per session")
    p = raw["preset"]
    fig.suptitle(f"window/sink ablation: N={p['sessions']}, B={p['budget_ms']:g} ms, model {p['model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=110)
    plt.close(fig)
    return ["ablation.png"]


def markdown(raw: dict, analysis: dict, plots: list[str]) -> str:
    p, m = raw["preset"], raw.get("machine", {})
    bpt = raw.get("kv_bytes_per_token")
    L = [f"# ablation — preset `{p['name']}`", "",
         f"- command: `{raw.get('command', '')}`",
         f"- machine: {m.get('platform')}, {m.get('cpus')} CPUs, torch {m.get('torch')}"
         + (f", GPU {m['cuda']}" if m.get("cuda") else "") + f", load average at start {m.get('load_avg')}",
         f"- started {raw.get('started')}, finished {raw.get('finished', '?')}, took {raw.get('elapsed_s', '?')} s",
         f"- model `{p['model']}` on {p['device']} ({p['dtype']}, {bpt} KV bytes per token), energy adapter, "
         f"B = {p['budget_ms']:g} ms, τ = {p['tokens_per_tick']}, N = {p['sessions']} free-running sessions streaming "
         f"{p['audio']}, {p['duration_s']:g} s per point, steady from {p['steady_from_s']:g} s, fresh server per point",
         f"- grid: W ∈ {list(p['windows'])} × S ∈ {list(p['sinks'])}, R = {p['runs']}", "",
         "| W | S | runs | steady p50 ms | p99 ms | mean ms | deadline misses | blocks held / session (median, max) "
         "| reserved blocks / session | held bytes / session | reserved bytes / session | sessions the pool holds |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in analysis["table"]:
        miss = r["deadline_miss_fraction"]
        L.append(f"| {r['window']} | {r['sinks']} | {r['runs']} | {_fmt(r['p50_ms'])} | {_fmt(r['p99_ms'])} | "
                 f"{_fmt(r['mean_ms'])} | {_fmt(100 * miss if miss is not None else None, '.2f')} % | "
                 f"{_fmt(r['blocks_per_session'], '.2f')}, {_fmt(r['blocks_per_session_max'], '.2f')} | "
                 f"{r['reserved_blocks']} | {_fmt(r['steady_bytes'] / 1024 if r['steady_bytes'] else None, '.1f')} KiB | "
                 f"{_fmt(r['reserved_bytes'] / 1024 if r['reserved_bytes'] else None, '.1f')} KiB | "
                 f"{r['capacity_sessions']} |")
    L += ["", "Held blocks include the block being filled and the ones behind the window that wait for a whole "
              "block to pass before they are freed; the reservation adds the largest chunk a tick can bring."]
    if plots:
        L += ["", "## Plots", ""] + [f"![{x}]({x})" for x in plots]
    return "\n".join(L) + "\n"


def write_report(raw: dict, out: Path) -> str:
    return write_outputs(raw, out, analyse, plot, markdown)
