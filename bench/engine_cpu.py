"""CPU benchmark: Metronome (sink + sliding-window paged KV) vs Hugging Face transformers on SmolLM2-135M.

Run from the repository root::

    .venv/bin/python bench/engine_cpu.py            # full run (about 5-10 minutes on 2 idle cores)
    .venv/bin/python bench/engine_cpu.py --quick    # smoke run (about a minute)
    .venv/bin/python bench/engine_cpu.py --help     # every knob (sessions, ticks, budget, window, ...)

(``make bench-cpu`` runs the full benchmark.) Figures: docs/benchmarks/cpu.md.

What it measures, in one run, for both arms on the same model weights, the same text and greedy decoding:

* **Tick latency and tokens/s vs number of concurrent sessions N.** A *tick* gives every session a new
  chunk of ``--chunk-tokens`` (26) input tokens and then decodes ``--new-tokens`` (25) greedy tokens
  for it; generated tokens stay in the session's context. Each sweep point opens N fresh sessions,
  runs one warm-up tick and ``--ticks`` measured ticks, and records the wall time of each tick.

  - *Metronome*: one ``engine.step`` per tick for all N sessions (prefill batched, then shared
    batched decode rounds); KV policy = ``--sinks`` pinned tokens + ``--window`` sliding window.
  - *transformers*: what a per-session server built on transformers does: each session owns a
    growing ``DynamicCache``; per tick the sessions run one after another (feed the 26 new tokens
    plus the token sampled last tick, then 25 greedy single-token steps), so a tick's time is the
    sum over sessions. The sweep of an arm stops once a tick exceeds ``--cap-factor`` x the budget.

* **Capacity at the latency budget B** (``--budget-ms``, default 2000 ms): the largest N whose median
  tick <= B, per arm, and their ratio (the target is Metronome >= 10x transformers).

* **KV bytes per session vs session age.** One session per arm (the two arms alternate tick by tick,
  so they always have the same age) is advanced tick by tick up to ``--max-age`` tokens. Metronome:
  ``live_blocks * kv_bytes_per_block``; transformers: the ``nbytes`` of every key/value tensor in the
  ``DynamicCache``. The greedy tokens of the two arms are compared tick by tick as a sanity check.
  ``--age-time-limit`` (default 300 s) stops this part early on a slow machine, saying so.

Tables go to stdout, progress bars to stderr, and everything raw (every tick of every point, every
age sample, machine info) to ``--out`` (default ``results/engine_cpu.json``).

Timings are only meaningful on an otherwise idle machine: another busy process on a 2-core box makes
PyTorch's worker threads fight for the cores and can slow both arms by several times. The load
average at start and end is recorded in the JSON and a warning is printed when the box is busy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter

import torch
from tqdm import tqdm

# Public-domain English text (Dickens, "A Tale of Two Cities", 1859; Austen, "Pride and Prejudice",
# 1813; Melville, "Moby-Dick", 1851), repeated until it is long enough and tokenised once.
TEXT = """\
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of \
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, \
it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had \
everything before us, we had nothing before us, we were all going direct to Heaven, we were all going \
direct the other way - in short, the period was so far like the present period, that some of its \
noisiest authorities insisted on its being received, for good or for evil, in the superlative degree \
of comparison only. There were a king with a large jaw and a queen with a plain face, on the throne of \
England; there were a king with a large jaw and a queen with a fair face, on the throne of France. In \
both countries it was clearer than crystal to the lords of the State preserves of loaves and fishes, \
that things in general were settled for ever.
It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in \
want of a wife. However little known the feelings or views of such a man may be on his first entering \
a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is \
considered the rightful property of some one or other of their daughters. "My dear Mr. Bennet," said \
his lady to him one day, "have you heard that Netherfield Park is let at last?" Mr. Bennet replied \
that he had not. "But it is," returned she; "for Mrs. Long has just been here, and she told me all \
about it." Mr. Bennet made no answer. "Do you not want to know who has taken it?" cried his wife \
impatiently. "You want to tell me, and I have no objection to hearing it." This was invitation enough.
Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in my \
purse, and nothing particular to interest me on shore, I thought I would sail about a little and see \
the watery part of the world. It is a way I have of driving off the spleen and regulating the \
circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly \
November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and \
bringing up the rear of every funeral I meet; and especially whenever my hypos get such an upper hand \
of me, that it requires a strong moral principle to prevent me from deliberately stepping into the \
street, and methodically knocking people's hats off - then, I account it high time to get to sea as \
soon as I can. This is my substitute for pistol and ball. With a philosophical flourish Cato throws \
himself upon his sword; I quietly take to the ship. There is nothing surprising in this. If they but \
knew it, almost all men in their degree, some time or other, cherish very nearly the same feelings \
towards the ocean with me.
"""

MODEL = "smollm2-135m"
DEFAULT_SESSIONS = "1,2,4,8,12,16,24,32"
QUICK = dict(sessions="1,2,4", ticks=1, max_age=200)
MiB = 1024 * 1024


# ---------------------------------------------------------------------------------------------- input
class TokenStream:
    """The text tokenised once; session ``i`` reads consecutive chunks from its own offset (wrapping)."""

    def __init__(self, tokenizer, min_tokens: int = 8192) -> None:
        ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
        if not ids:
            raise RuntimeError("the benchmark text tokenised to nothing")
        reps = -(-min_tokens // len(ids))
        self.ids: list[int] = ids * reps
        self.paragraph_tokens = len(ids)

    def offset(self, session_index: int) -> int:
        return (session_index * 997) % len(self.ids)  # a prime stride: sessions read different text

    def chunk(self, session_index: int, tick: int, size: int) -> list[int]:
        start = self.offset(session_index) + tick * size
        n = len(self.ids)
        return [self.ids[(start + j) % n] for j in range(size)]


@dataclass
class TickResult:
    ms: float
    prefill_ms: float
    decode_ms: float
    tokens: list[list[int]]           # generated tokens per session (in order)
    aborted: bool = False             # stopped part-way because it passed the cap (lower bound)
    sessions_done: int = 0
    errors: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- arms
class MetronomeArm:
    name = "metronome"

    def __init__(self, args) -> None:
        from metronome import Engine, EngineConfig, KVPolicy

        self.policy = KVPolicy(sinks=args.sinks, window=args.window, block_size=args.block_size,
                               positions="rebased")
        self.config = EngineConfig(model=MODEL, policy=self.policy, device="cpu", dtype="float32",
                                   num_blocks=args.num_blocks, max_chunk_tokens=args.max_chunk_tokens,
                                   seed=args.seed)
        t0 = perf_counter()
        self.engine = Engine(self.config)
        self.load_s = perf_counter() - t0
        self.new_tokens = args.new_tokens

    def info(self) -> dict:
        s = self.engine.stats()
        return {
            "load_s": self.load_s,
            "policy": {"sinks": self.policy.sinks, "window": self.policy.window,
                       "block_size": self.policy.block_size, "positions": self.policy.positions,
                       "rebase_interval": self.policy.rebase_interval},
            "max_chunk_tokens": self.config.max_chunk_tokens,
            "kv_blocks_total": s.kv_blocks_total,
            "kv_bytes_per_block": s.kv_bytes_per_block,
            "blocks_per_session": s.blocks_per_session,
            "reserved_bytes_per_session": s.blocks_per_session * s.kv_bytes_per_block,
            "memory_capacity_sessions": s.capacity,
            "checkpoint": str(self.engine.checkpoint),
        }

    def open(self):
        return self.engine.open_session()

    def close(self, sid) -> None:
        self.engine.close_session(sid)

    def tick(self, handles, chunks, cap_s: float | None = None) -> TickResult:
        from metronome import StepInput

        inputs = [StepInput(session_id=sid, token_ids=ids, max_new_tokens=self.new_tokens)
                  for sid, ids in zip(handles, chunks)]
        t0 = perf_counter()
        outs = self.engine.step(inputs)
        ms = (perf_counter() - t0) * 1e3
        timing = self.engine.last_timing
        errors = []
        for out in outs:
            if out.error or out.preempted:
                errors.append(f"session {out.session_id}: {out.error or 'preempted'}")
            elif len(out.token_ids) != self.new_tokens:
                errors.append(f"session {out.session_id}: {len(out.token_ids)} tokens, expected {self.new_tokens}")
        return TickResult(ms, timing.prefill_ms, timing.decode_ms, [list(o.token_ids) for o in outs],
                          sessions_done=len(handles), errors=errors)

    def kv(self, sid) -> dict:
        session = self.engine.scheduler.sessions[sid]
        return {"kv_bytes": session.live_blocks * self.engine.kv_bytes_per_block,
                "kv_tokens_written": session.num_tokens, "live_blocks": session.live_blocks}


@dataclass
class HFSession:
    cache: object
    pending: int | None = None  # sampled last tick, not yet fed (mirrors Metronome's pending token)


class TransformersArm:
    name = "transformers"

    def __init__(self, args) -> None:
        import transformers
        from transformers import AutoModelForCausalLM, DynamicCache

        from metronome.models.embedded import embedded_checkpoint

        self.DynamicCache = DynamicCache
        self.path = embedded_checkpoint(MODEL)
        t0 = perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        self.load_s = perf_counter() - t0
        self.new_tokens = args.new_tokens
        self.version = transformers.__version__
        params = inspect.signature(self.model.forward).parameters
        # transformers >= 5.x renames past_key_values to cache (the old name warns, then goes away).
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def info(self) -> dict:
        return {"load_s": self.load_s, "checkpoint": str(self.path), "transformers": self.version,
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                "cache": "DynamicCache (grows without bound)"}

    def open(self):
        return HFSession(self.DynamicCache(config=self.model.config))

    def close(self, handle) -> None:
        handle.cache = None

    def _next(self, handle: HFSession, ids: list[int]) -> int:
        out = self.model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True,
                         **{self.cache_kw: handle.cache}, **self.keep_kw)
        return int(out.logits[0, -1].argmax())

    @torch.inference_mode()
    def tick(self, handles, chunks, cap_s: float | None = None) -> TickResult:
        t0 = perf_counter()
        prefill = decode = 0.0
        tokens: list[list[int]] = []
        aborted = False
        for handle, ids in zip(handles, chunks):
            a = perf_counter()
            feed = ([handle.pending] if handle.pending is not None else []) + list(ids)
            tok = self._next(handle, feed)
            b = perf_counter()
            gen = [tok]
            for _ in range(self.new_tokens - 1):
                tok = self._next(handle, [tok])
                gen.append(tok)
            c = perf_counter()
            handle.pending = tok
            prefill += b - a
            decode += c - b
            tokens.append(gen)
            if cap_s is not None and c - t0 > cap_s and len(tokens) < len(handles):
                aborted = True  # sessions run one after another: the rest can only add time
                break
        ms = (perf_counter() - t0) * 1e3
        return TickResult(ms, prefill * 1e3, decode * 1e3, tokens, aborted=aborted, sessions_done=len(tokens))

    def kv(self, handle) -> dict:
        cache = handle.cache
        nbytes = 0
        for layer in getattr(cache, "layers", []):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    nbytes += t.nbytes
        return {"kv_bytes": nbytes, "kv_tokens_written": int(cache.get_seq_length())}


# ---------------------------------------------------------------------------------------------- runs
def warm_up(arm, stream: TokenStream, args) -> float:
    """One throwaway tick, so one-time costs (allocator, kernels, lazy init) stay out of the sweep."""
    h = arm.open()
    t0 = perf_counter()
    arm.tick([h], [stream.chunk(0, 0, args.chunk_tokens)])
    arm.close(h)
    return (perf_counter() - t0) * 1e3


def sweep(arm, stream: TokenStream, args) -> dict:
    budget_ms, cap_ms = args.budget_ms, args.budget_ms * args.cap_factor
    points, stopped = [], None
    bar = tqdm(args.session_list, desc=f"{arm.name:>12} sweep", unit="pt", file=sys.stderr, leave=True)
    for n in bar:
        bar.set_postfix_str(f"N={n}")
        handles = [arm.open() for _ in range(n)]
        ticks, over_cap = [], False
        try:
            for k in range(args.ticks + 1):
                chunks = [stream.chunk(i, k, args.chunk_tokens) for i in range(n)]
                r = arm.tick(handles, chunks, cap_s=cap_ms / 1e3)
                ticks.append({"tick": k, "warmup": k == 0, "ms": r.ms, "prefill_ms": r.prefill_ms,
                              "decode_ms": r.decode_ms, "aborted": r.aborted, "sessions_done": r.sessions_done,
                              "generated": sum(len(t) for t in r.tokens), "errors": r.errors})
                if r.errors:
                    tqdm.write(f"[{arm.name}] N={n} tick {k}: {len(r.errors)} session errors, e.g. {r.errors[0]}")
                if r.aborted or r.ms > cap_ms:
                    over_cap = True
                    break
        finally:
            for h in handles:
                arm.close(h)
        used = [t for t in ticks if not t["warmup"]]
        lower_bound = not used  # only the warm-up ran (it passed the cap): its time stands in
        used = used or [ticks[-1]]
        sample = [t["ms"] for t in used]
        median = statistics.median(sample)
        point = {
            "sessions": n, "ticks": ticks, "median_ms": median, "max_ms": max(sample),
            "min_ms": min(sample), "measured_ticks": 0 if lower_bound else len(used),
            "tokens_per_s": n * args.new_tokens / (median / 1e3),
            "median_prefill_ms": statistics.median([t["prefill_ms"] for t in used]),
            "median_decode_ms": statistics.median([t["decode_ms"] for t in used]),
            "over_cap": over_cap, "aborted": any(t["aborted"] for t in ticks), "lower_bound": lower_bound,
            "within_budget": (not over_cap) and median <= budget_ms,
            "errors": sum(len(t["errors"]) for t in ticks),
        }
        points.append(point)
        bar.set_postfix_str(f"N={n} median {median:.0f} ms")
        if over_cap:
            stopped = (f"stopped after N={n}: a tick took {ticks[-1]['ms']:.0f} ms"
                       f"{' (aborted part-way)' if ticks[-1]['aborted'] else ''} > cap {cap_ms:.0f} ms")
            tqdm.write(f"[{arm.name}] {stopped}")
            break
    bar.close()
    return {"points": points, "stopped": stopped}


def capacity(result: dict, args) -> dict:
    """Largest N whose median tick <= budget; a lower bound when the largest swept N still passed."""
    points = result["points"]
    ok = [p["sessions"] for p in points if p["within_budget"]]
    best = max(ok, default=0)
    largest = args.session_list[-1]
    lower_bound = bool(points) and best == largest
    return {"sessions": best, "lower_bound": lower_bound,
            "note": (f"the largest N swept ({largest}) is within budget: capacity >= {best}" if lower_bound
                     else "no N sustains the budget, not even 1" if best == 0 else "")}


def age_run(arms: list, stream: TokenStream, args) -> dict:
    """One session per arm, advanced tick by tick (the arms alternate) up to ``max_age`` tokens."""
    handles = {arm.name: arm.open() for arm in arms}
    per_tick = args.chunk_tokens + args.new_tokens
    n_ticks = max(1, -(-args.max_age // per_tick))
    samples = {arm.name: [] for arm in arms}
    first_divergence = truncated = None
    t0 = perf_counter()
    try:
        for k in tqdm(range(n_ticks), desc="    KV vs age", unit="tick", file=sys.stderr):
            if args.age_time_limit and perf_counter() - t0 > args.age_time_limit and k:
                truncated = (f"stopped at age {k * per_tick} of {args.max_age} tokens: --age-time-limit "
                             f"{args.age_time_limit:.0f} s reached")
                tqdm.write(f"[KV vs age] {truncated}")
                break
            chunk = stream.chunk(0, k, args.chunk_tokens)
            generated = {}
            for arm in arms:
                r = arm.tick([handles[arm.name]], [chunk])
                generated[arm.name] = r.tokens[0] if r.tokens else []
                row = {"tick": k, "age_tokens": (k + 1) * per_tick, "tick_ms": r.ms,
                       "prefill_ms": r.prefill_ms, "decode_ms": r.decode_ms, "errors": r.errors,
                       "generated": generated[arm.name]}
                row.update(arm.kv(handles[arm.name]))
                samples[arm.name].append(row)
            if len(arms) == 2 and first_divergence is None:
                a, b = (generated[arm.name] for arm in arms)
                if a != b:
                    first_divergence = {"tick": k, "age_tokens": (k + 1) * per_tick,
                                        "same_prefix_tokens": next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                                                   min(len(a), len(b)))}
    finally:
        for arm in arms:
            arm.close(handles[arm.name])
    return {"ticks": len(next(iter(samples.values()))), "ticks_planned": n_ticks, "tokens_per_tick": per_tick,
            "samples": samples, "greedy_first_divergence": first_divergence, "truncated": truncated,
            "wall_s": perf_counter() - t0}


# ---------------------------------------------------------------------------------------------- output
def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def fmt_ms(p: dict | None) -> tuple:
    if p is None:
        return ("-", "-", "-")
    flag = ">" if p["aborted"] else ""  # an aborted tick stopped part-way: its time is a lower bound
    mark = ("" if p["within_budget"] else " *") + (" w" if p["lower_bound"] else "")
    return (f"{flag}{p['median_ms']:.0f}{mark}", f"{flag}{p['max_ms']:.0f}",
            f"{'<' if flag else ''}{p['tokens_per_s']:.1f}")


def report(results: dict, args) -> None:
    sweeps, caps = results["sweeps"], results["capacity"]
    arms = list(sweeps)
    print()
    print(f"== Tick latency vs concurrent sessions  (tick = {args.chunk_tokens} input + {args.new_tokens} "
          f"decoded tokens per session; {args.ticks} measured tick(s) after 1 warm-up; budget B = "
          f"{args.budget_ms:.0f} ms; * = over B, w = only the warm-up tick ran (it passed the cap), > = lower bound "
          "(tick aborted part-way), - = not run)")
    by_n = {a: {p["sessions"]: p for p in sweeps[a]["points"]} for a in arms}
    headers = ["N"]
    for a in arms:
        headers += [f"{a} median ms", "max ms", "tok/s"]
    rows = []
    for n in args.session_list:
        row = [n]
        for a in arms:
            row += list(fmt_ms(by_n[a].get(n)))
        rows.append(row)
    print(table(headers, rows))
    for a in arms:
        if sweeps[a]["stopped"]:
            print(f"  {a}: {sweeps[a]['stopped']}")
    split = [[n] + [f"{by_n[a][n]['median_prefill_ms']:.0f} / {by_n[a][n]['median_decode_ms']:.0f}"
                    if n in by_n[a] else "-" for a in arms] for n in args.session_list]
    print()
    print("   prefill / decode ms within the median tick")
    print(table(["N"] + arms, split))

    print()
    print(f"== Capacity at B = {args.budget_ms:.0f} ms")
    for a in arms:
        c = caps[a]
        print(f"  {a:>12}: {'>= ' if c['lower_bound'] else ''}{c['sessions']} sessions"
              f"{'  (' + c['note'] + ')' if c['note'] else ''}")
    ratio = results.get("capacity_ratio")
    if ratio is not None:
        print(f"  ratio metronome / transformers: {ratio['text']}")

    age = results.get("kv_vs_age")
    if age and age["ticks"]:
        print()
        print(f"== KV bytes per session vs session age (one session per arm, {age['tokens_per_tick']} tokens "
              f"per tick)")
        names = list(age["samples"])
        n = age["ticks"]
        show = sorted(set([0, n - 1] + [round(i * (n - 1) / 11) for i in range(12)]))
        headers = ["age (tokens)"] + [f"{a} KV MiB" for a in names] + [f"{a} tick ms" for a in names]
        if len(names) == 2:
            headers.append(f"{names[1]}/{names[0]} KV")
        rows = []
        for i in show:
            s = [age["samples"][a][i] for a in names]
            row = [s[0]["age_tokens"]] + [f"{x['kv_bytes'] / MiB:.1f}" for x in s] + [f"{x['tick_ms']:.0f}" for x in s]
            if len(names) == 2:
                row.append(f"{s[1]['kv_bytes'] / s[0]['kv_bytes']:.2f}x" if s[0]["kv_bytes"] else "-")
            rows.append(row)
        print(table(headers, rows))
        info = results["arms"].get("metronome")
        if info:
            print(f"  metronome reserves {info['blocks_per_session']} blocks = "
                  f"{info['reserved_bytes_per_session'] / MiB:.1f} MiB per session at admission "
                  f"(the bound, whatever the age); KV pool holds {info['memory_capacity_sessions']} sessions")
        d = age.get("greedy_first_divergence")
        if len(names) == 2:
            if d is None:
                print("  greedy tokens: identical in both arms for every tick")
            else:
                print(f"  greedy tokens first differ at tick {d['tick']} (age {d['age_tokens']}, after "
                      f"{d['same_prefix_tokens']} equal tokens of that tick); window+sinks = "
                      f"{args.window + args.sinks} tokens")
        if age["truncated"]:
            print(f"  {age['truncated']} (raise or disable it with --age-time-limit 0)")
    m = results["machine"]
    print()
    print(f"machine: {m['platform']}, {m['cpus']} CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
          f"load avg {m['loadavg_start']} -> {m.get('loadavg_end')}; wall {results.get('wall_s', 0):.0f} s")


# ---------------------------------------------------------------------------------------------- main
def machine_info(threads: int) -> dict:
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__, "torch_threads": threads, "transformers": transformers.__version__,
        "git_commit": commit, "git_dirty": dirty,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=type(
        "Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: sessions {QUICK['sessions']}, {QUICK['ticks']} tick, max age {QUICK['max_age']} "
                        "(explicit flags still win)")
    p.add_argument("--sessions", default=argparse.SUPPRESS,
                   help=f"comma-separated N values to sweep; default {DEFAULT_SESSIONS}, quick {QUICK['sessions']}")
    p.add_argument("--ticks", type=int, default=argparse.SUPPRESS,
                   help=f"measured ticks per point, after 1 warm-up; default 3, quick {QUICK['ticks']}")
    p.add_argument("--budget-ms", type=float, default=2000.0, help="tick latency budget B")
    p.add_argument("--cap-factor", type=float, default=3.0,
                   help="an arm's sweep stops once a tick exceeds cap-factor x budget")
    p.add_argument("--chunk-tokens", type=int, default=26, help="new input tokens per session per tick")
    p.add_argument("--new-tokens", type=int, default=25, help="greedy decode tokens per session per tick")
    p.add_argument("--max-age", type=int, default=argparse.SUPPRESS,
                   help=f"KV-vs-age run: advance one session per arm to this many tokens (0 skips it); default 3000, "
                        f"quick {QUICK['max_age']}")
    p.add_argument("--age-time-limit", type=float, default=300.0,
                   help="KV-vs-age run: stop early after this many seconds (keeps a busy machine's run bounded); "
                        "0 = no limit")
    p.add_argument("--arms", default="metronome,transformers", help="which arms to run (comma-separated)")
    p.add_argument("--sinks", type=int, default=16, help="Metronome: pinned sink tokens")
    p.add_argument("--window", type=int, default=1024, help="Metronome: sliding window tokens")
    p.add_argument("--block-size", type=int, default=16, help="Metronome: tokens per KV block")
    p.add_argument("--max-chunk-tokens", type=int, default=256, help="Metronome: max new input per session per step")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="Metronome: KV pool blocks (default: sized from free memory by the engine)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (None: the usable CPU cores)")
    p.add_argument("--seed", type=int, default=0, help="torch seed")
    p.add_argument("--out", default="results/engine_cpu.json", help="raw results (JSON)")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else dict(sessions=DEFAULT_SESSIONS, ticks=3, max_age=3000)
    for key, value in defaults.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    try:
        args.session_list = sorted({int(x) for x in str(args.sessions).split(",") if x.strip()})
    except ValueError:
        p.error(f"--sessions must be comma-separated integers, got {args.sessions!r}")
    if not args.session_list or args.session_list[0] < 1:
        p.error("--sessions needs at least one N >= 1")
    args.arm_list = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(args.arm_list) - {"metronome", "transformers"}
    if unknown or not args.arm_list:
        p.error(f"--arms takes metronome and/or transformers, got {args.arms!r}")
    if args.ticks < 1 or args.chunk_tokens < 1 or args.new_tokens < 1 or args.max_age < 0:
        p.error("--ticks, --chunk-tokens and --new-tokens must be >= 1 and --max-age >= 0")
    if args.chunk_tokens + 1 > args.max_chunk_tokens:
        p.error("--chunk-tokens + 1 (the pending token) must fit in --max-chunk-tokens")
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` and timeouts still leave the partial JSON
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    started = perf_counter()
    machine = machine_info(threads)
    if machine["loadavg_start"][0] > 0.5 * machine["cpus_usable"]:
        print(f"warning: load average {machine['loadavg_start']} on {machine['cpus_usable']} CPUs: another "
              "process is busy, timings will be slow and noisy", file=sys.stderr)

    results: dict = {"benchmark": "engine_cpu", "model": MODEL, "machine": machine,
                     "args": {k: v for k, v in vars(args).items()}, "arms": {}, "sweeps": {}, "capacity": {}}
    out = Path(args.out)
    try:
        arms = []
        for name in args.arm_list:
            print(f"loading {name} ...", file=sys.stderr)
            arm = MetronomeArm(args) if name == "metronome" else TransformersArm(args)
            arms.append(arm)
            results["arms"][name] = arm.info()
        stream = TokenStream(arms[0].engine.tokenizer if arms[0].name == "metronome"
                             else _hf_tokenizer(arms[0].path))
        results["text_tokens"] = {"paragraph": stream.paragraph_tokens, "stream": len(stream.ids)}
        for arm in arms:
            results["arms"][arm.name]["warmup_ms"] = warm_up(arm, stream, args)
        for arm in arms:
            results["sweeps"][arm.name] = sweep(arm, stream, args)
            results["capacity"][arm.name] = capacity(results["sweeps"][arm.name], args)
        if {"metronome", "transformers"} <= set(results["capacity"]):
            m, t = results["capacity"]["metronome"], results["capacity"]["transformers"]
            ms = f"{'>= ' if m['lower_bound'] else ''}{m['sessions']}"
            ts = f"{'>= ' if t['lower_bound'] else ''}{t['sessions']}"
            value = None
            if t["sessions"] == 0:
                text = f"undefined: transformers sustains 0 sessions within B (not even N=1); metronome {ms}"
                met = m["sessions"] > 0
            elif t["lower_bound"]:
                text = (f"unknown: transformers is still within B at the largest N swept ({ms} vs {ts}); "
                        "sweep larger --sessions")
                met = False
            else:
                value = m["sessions"] / t["sessions"]
                text = f"{'>= ' if m['lower_bound'] else ''}{value:.1f}x ({ms} vs {ts})"
                met = m["sessions"] >= 10 * t["sessions"]
            text += f"; target >= 10x: {'met' if met else 'NOT met'}"
            results["capacity_ratio"] = {"value": value, "text": text, "target": 10, "target_met": met}
        if args.max_age > 0:
            results["kv_vs_age"] = age_run(arms, stream, args)
    except KeyboardInterrupt:
        results["interrupted"] = True
        print("interrupted: writing what was measured so far", file=sys.stderr)
    finally:
        results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        results["wall_s"] = perf_counter() - started
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    if not results.get("interrupted"):
        report(results, args)
    print(f"\nraw results: {out}")
    return 1 if results.get("interrupted") else 0


def _hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


if __name__ == "__main__":
    sys.exit(main())
