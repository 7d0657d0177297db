"""The quality experiment's analysis and report: rolling perplexity per policy, probe accuracy by session age, plots and
markdown (pure functions of ``raw.json``; ``metronome bench quality --from raw.json`` re-runs them)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from metronome.experiments.quality import heard_ok, perplexity
from metronome.experiments.report import pyplot, write_outputs


def rolling_nll(logprobs, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(position, mean NLL over the ``width`` tokens ending there) — where a policy starts to hurt."""
    lp = np.array([np.nan if x is None else -x for x in logprobs], float)
    valid = np.isfinite(lp)
    lp[~valid] = 0.0
    c, n = np.cumsum(lp), np.cumsum(valid)
    pos = np.arange(width - 1, lp.size)
    s = c[pos] - np.concatenate([[0.0], c])[pos - width + 1]
    m = n[pos] - np.concatenate([[0], n])[pos - width + 1]
    return pos, s / np.maximum(m, 1)


def accuracy_by_age(scored: list[dict], edges) -> list[dict]:
    """Correct / asked per age bin ``[edges[i], edges[i+1])``.

    >>> accuracy_by_age([{"start_s": 5, "correct": True}, {"start_s": 25, "correct": False}], [0, 20, 40])
    [{'from_s': 0, 'to_s': 20, 'asked': 1, 'correct': 1}, {'from_s': 20, 'to_s': 40, 'asked': 1, 'correct': 0}]
    """
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = [p for p in scored if lo <= p["start_s"] < hi]
        out.append({"from_s": lo, "to_s": hi, "asked": len(sel), "correct": sum(bool(p["correct"]) for p in sel)})
    return out


def analyse(raw: dict) -> dict:
    p = raw["preset"]
    out = {"experiment": "quality"}
    if raw.get("perplexity"):
        ppl = raw["perplexity"]
        dense = next((c["ppl"] for c in ppl["configs"] if c["name"] == "dense"), None)
        out["perplexity"] = [{"name": c["name"], "sinks": c["sinks"], "window": c["window"],
                              "positions": c["positions"], "ppl": c["ppl"],
                              "ratio_to_dense": c["ppl"] / dense if dense else None,
                              # after the window first slides: where sinks matter
                              "ppl_after_window": perplexity(c["logprobs"][(p["window"] or 0) + p["chunk_tokens"]:]),
                              "seconds": c.get("seconds")} for c in ppl["configs"]]
        ref = ppl.get("hf_reference")
        out["hf_reference_ppl"] = ref["ppl"] if ref else None
        out["tokens"] = ppl["tokens"]
    if raw.get("probe"):
        pr = raw["probe"]
        edges = [0.0, pr["session_s"] / 4, pr["session_s"] / 2, 3 * pr["session_s"] / 4, pr["session_s"] + 1]
        window_fill = {}
        arms = {}
        for a, st in pr["arms"].items():
            sc = st["scored"]
            w = st["policy"]["window"]
            filled = next((tk["t_s"] for tk in st["ticks"] if w and tk["tokens"] and tk["tokens"] > w), None)
            window_fill[a] = filled
            # When the reply was decoded (the tick the question arrived in), not when it was asked.
            when = {id(x): st["ticks"][x["tick"]]["t_s"] if x["tick"] is not None else x["start_s"] for x in sc}
            before = [x for x in sc if filled is None or when[id(x)] < filled]
            after = [x for x in sc if filled is not None and when[id(x)] >= filled]
            arms[a] = {"policy": st["policy"], "ended": st["ended"], "asked": len(sc),
                       "correct": sum(bool(x["correct"]) for x in sc),
                       "heard_ok": sum(bool(x.get("heard_ok")) for x in sc),
                       "window_full_at_s": filled,
                       "before_window_full": [len(before), sum(bool(x["correct"]) for x in before)],
                       "after_window_full": [len(after), sum(bool(x["correct"]) for x in after)],
                       "by_age": accuracy_by_age(sc, edges),
                       "final_context_tokens": next((tk["tokens"] for tk in reversed(st["ticks"]) if tk["tokens"]), None)}
        out["probe"] = arms
    return out


def _fmt(x, spec=".2f"):
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def plot(raw: dict, analysis: dict, out: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    written = []
    p = raw["preset"]
    if raw.get("perplexity"):
        fig, ax = plt.subplots(figsize=(8, 4))
        width = max(64, p["window"] // 2)
        sink_values = sorted({c["sinks"] for c in raw["perplexity"]["configs"] if c["window"] is not None})
        for c in raw["perplexity"]["configs"]:
            pos, nll = rolling_nll(c["logprobs"], width)
            dense = c["window"] is None
            ax.plot(pos, nll, ls="--" if c["positions"] == "absolute" and not dense else "-", lw=1.4 if dense else 0.9,
                    color="k" if dense else f"C{sink_values.index(c['sinks'])}", label=f"{c['name']} ({c['ppl']:.1f})")
        ax.axvline(p["window"], color="0.5", ls=":", lw=0.8)
        ax.set_xlabel("token position (dotted: W; dashed: absolute positions, solid: rebased)")
        ax.set_ylabel(f"NLL, mean over {width} tokens")
        ax.set_title(f"SmolLM2-135M over {raw['perplexity']['tokens']} tokens, chunks of {p['chunk_tokens']}, "
                     f"W = {p['window']} (legend: perplexity)", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(out / "perplexity.png", dpi=110)
        plt.close(fig)
        written.append("perplexity.png")
    if raw.get("probe"):
        fig, ax = plt.subplots(figsize=(8, 3.4))
        for j, (a, st) in enumerate(raw["probe"]["arms"].items()):
            sc = st["scored"]
            ax.scatter([x["start_s"] for x in sc], [j + 0.8 * bool(x["correct"]) - 0.4 for x in sc], s=25,
                       marker="o", label=f"{a} ({sum(bool(x['correct']) for x in sc)}/{len(sc)})")
            fill = analysis["probe"][a]["window_full_at_s"]
            if fill:
                ax.axvline(fill, color=f"C{j}", ls=":", lw=0.8)
        ax.set_yticks(range(len(raw["probe"]["arms"])))
        ax.set_yticklabels(list(raw["probe"]["arms"]))
        ax.set_xlabel("session age at the question (s); up: correct, down: wrong; dotted: window full")
        ax.set_title("spoken-question probe (free-running session, cascade adapter)", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        fig.savefig(out / "probe.png", dpi=110)
        plt.close(fig)
        written.append("probe.png")
    return written


def markdown(raw: dict, analysis: dict, plots: list[str]) -> str:
    p, m = raw["preset"], raw.get("machine", {})
    L = [f"# quality — preset `{p['name']}`", "",
         f"- command: `{raw.get('command', '')}`",
         f"- machine: {m.get('platform')}, {m.get('cpus')} CPUs, torch {m.get('torch')}"
         + (f", GPU {m['cuda']}" if m.get("cuda") else "") + f", load average at start {m.get('load_avg')}",
         f"- started {raw.get('started')}, finished {raw.get('finished', '?')}, took {raw.get('elapsed_s', '?')} s",
         f"- model `{p['model']}` ({raw.get('checkpoint', '')}) on {p['device']} ({p['dtype']})",
         f"- text: {raw.get('text_source')}", ""]
    if analysis.get("perplexity"):
        L += ["## (a) Perplexity", "",
              f"{analysis['tokens']} tokens ({raw['perplexity']['chars']} characters) fed in chunks of "
              f"{p['chunk_tokens']} with `prompt_logprobs`; W = {p['window']}. 'after W' = perplexity of the tokens "
              f"after the first W + chunk (where only the window and the sinks are visible).", "",
              "| policy | positions | perplexity | × dense | perplexity after W |", "|---|---|---|---|---|"]
        for r in analysis["perplexity"]:
            name = ("dense (Unbounded)" if r["window"] is None else
                    "window only, S=0" if r["sinks"] == 0 else f"S={r['sinks']}, W={r['window']}")
            L.append(f"| {name} | {r['positions']} | {_fmt(r['ppl'])} | {_fmt(r['ratio_to_dense'], '.3f')} | {_fmt(r['ppl_after_window'])} |")
        if analysis.get("hf_reference_ppl") is not None:
            L += ["", f"Check: transformers' own model on the same tokens (dense, one forward, float32): "
                      f"perplexity {analysis['hf_reference_ppl']:.3f}."]
    if analysis.get("probe"):
        pr = raw["probe"]
        L += ["", "## (b) Spoken-question probe", "",
              f"One free-running session per arm, {pr['session_s']:g} s of audio (read-aloud sentences of the manual "
              f"with a question every {p['probe_every_s']:g} s from {p['probe_first_s']:g} s), B = "
              f"{p['probe_budget_ms']:g} ms, {p['probe_tokens_per_tick']} tokens decoded per tick, W = {p['probe_window']}; "
              f"reply = text of the tick the question arrives in and up to {p['answer_ticks'] - 1} more. "
              f"Simulated time (ticks back to back): the result does not depend on machine load.", "",
              "| arm | policy | correct | answered before the window was full | after | by age quarter | question heard (ASR) "
              "| context at end | ended early |", "|---|---|---|---|---|---|---|---|---|"]
        for a, r in analysis["probe"].items():
            pol = r["policy"]
            pol_s = "dense (Unbounded)" if pol["window"] is None else f"S={pol['sinks']}, W={pol['window']}, {pol['positions']}"
            quarters = ", ".join(f"{b['correct']}/{b['asked']}" for b in r["by_age"])
            L.append(f"| {a} | {pol_s} | {r['correct']}/{r['asked']} | {r['before_window_full'][1]}/{r['before_window_full'][0]} "
                     f"| {r['after_window_full'][1]}/{r['after_window_full'][0]} | {quarters} | {r['heard_ok']}/{r['asked']} "
                     f"| {r['final_context_tokens']} tokens | {r['ended'] or 'no'} |")
        L += ["", "<details><summary>every probe</summary>", "",
              "| arm | age s | question | heard | reply | correct |", "|---|---|---|---|---|---|"]
        for a, st in pr["arms"].items():
            for x in st["scored"]:
                reply = (x["reply"] or "").replace("|", "/").replace("\n", " ")[:120]
                L.append(f"| {a} | {x['start_s']:.0f} | {x['question']} | {x['heard'] or '–'} | {reply} | "
                         f"{'yes' if x['correct'] else 'no'} |")
        L += ["", "</details>"]
    if plots:
        L += ["", "## Plots", ""] + [f"![{x}]({x})" for x in plots]
    return "\n".join(L) + "\n"


def write_report(raw: dict, out: Path) -> str:
    return write_outputs(raw, out, analyse, plot, markdown)
