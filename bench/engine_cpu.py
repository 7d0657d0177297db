"""CPU benchmark: Metronome vs transformers' batched forward on SmolLM2-135M, float32 and bfloat16 side by side.

Run from the repository root::

    python bench/engine_cpu.py                       # every arm, the full sweep (minutes on 2 idle cores)
    python bench/engine_cpu.py --quick               # N = 1, 2 and one tick: a smoke run
    python bench/engine_cpu.py --random-weights      # SmolLM2's shapes with random weights (no packaged model)
    python bench/engine_cpu.py --arms metronome-bfloat16 --out a.json   # one arm (e.g. each on its own cores)
    python bench/engine_cpu.py --merge a.json b.json # one table and the targets from several runs' JSON
    python bench/engine_cpu.py --profile 8,24        # one Metronome tick at N = 8 and 24 under torch.profiler
    python bench/engine_cpu.py --attention 8,24      # one layer's decode-round attention: C kernel vs SDPA
    python bench/engine_cpu.py --products 1,8,24     # one decode round's linear products: bf16, E4M3, float32 weights

A tick gives every session ``--chunk-tokens`` (26) new tokens, after the token it sampled last tick, and
decodes ``--new-tokens`` (25) greedy tokens; each session starts from a ``--history`` (300) token prefix, so
every arm attends over the same keys. Token ids are drawn from a seeded generator (the time a tick takes
does not depend on them; nothing stops early).

Arms (``--arms``, any of these):

* ``metronome-float32``, ``metronome-bfloat16``: one ``engine.step`` per tick for all N sessions; KV policy
  S = 16 sinks + W = 1024 window, block size 16, rebased positions.
* ``transformers-float32``, ``transformers-bfloat16``: transformers' own model, one batched forward over all
  N sessions per token (one ``DynamicCache``; the sessions have equal lengths, so no padding is needed):
  the 27-token prefill, then 24 single-token forwards.

Each arm runs in a process of its own, the arms taking turns. N grows through ``--sessions``, every arm at
each N in turn (on a shared machine they see the same load), an arm leaving once its median tick passes
``--cap-factor`` x B; then each arm's largest N within B is found by bisection between the last N within B
and the first beyond it (``--no-refine`` skips).
The targets (capacity at B = 2 s of Metronome in the dtype ``dtype="auto"`` picks on this CPU: >= 24 sessions,
>= 3x transformers float32, >= 1.5x transformers bfloat16; its tick at N = 8 >= 2x faster than transformers
float32) are stated for CPUs with native bf16; elsewhere the table says how close float32 gets.

On a machine shared with other work, ``--threads 1 --clock cpu`` measures each tick in this process's CPU
time instead of the wall clock: what the tick would take on a core of its own (memory and caches are still
shared, so it is an estimate). torch's threads: ``--threads`` (default: every core this process may use), idle
OpenMP threads spinning briefly before they sleep (``metronome.cpu.THREAD_WAIT_ENV``, as ``metronome serve`` sets
it) unless the environment says otherwise. A busy machine distorts everything:
the load average is recorded and a warning printed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter, process_time

from metronome.cpu import auto_dtype, read_capability, thread_wait_env, usable_cores

thread_wait_env(os.environ)   # before torch loads, as the CLI does; a policy already set wins

import torch  # noqa: E402

MODEL = "smollm2-135m"
ARMS = ("metronome-float32", "metronome-bfloat16", "transformers-float32", "transformers-bfloat16")
DEFAULT_SESSIONS = "1,2,4,8,12,16,24,32,40,48"
QUICK = dict(sessions="1,2", ticks=1, history=40)
# SmolLM2-135M's shapes (the packaged checkpoint's config.json), for --random-weights.
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


# ---------------------------------------------------------------------------------------------- arms
@dataclass
class Tick:
    ms: float           # wall clock, or CPU time with --clock cpu
    prefill_ms: float
    decode_ms: float
    tokens: int
    wall_ms: float = 0.0
    cpu_ms: float = 0.0


def timed(tick_fn):
    """Run one tick, recording its wall time and this process's CPU time (all its threads)."""
    def run(self, *a):
        w0, c0 = perf_counter(), process_time()
        tick = tick_fn(self, *a)
        tick.wall_ms, tick.cpu_ms = (perf_counter() - w0) * 1e3, (process_time() - c0) * 1e3
        if self.args.clock == "cpu":   # scale the split to the CPU time
            scale = tick.cpu_ms / tick.ms if tick.ms else 1.0
            tick.ms, tick.prefill_ms, tick.decode_ms = tick.cpu_ms, tick.prefill_ms * scale, tick.decode_ms * scale
        return tick
    return run


class MetronomeArm:
    def __init__(self, dtype: str, checkpoint: str, args) -> None:
        from metronome import Engine, EngineConfig, KVPolicy
        from metronome.engine.blocks import blocks_per_session

        policy = KVPolicy(sinks=args.sinks, window=args.window, block_size=16, positions="rebased")
        blocks = blocks_per_session(policy, 256, SMOLLM2["max_position_embeddings"]) * max(args.session_list + (args.profile or [])) + 2
        self.engine = Engine(EngineConfig(model=checkpoint, policy=policy, device="cpu", dtype=dtype,
                                          num_blocks=blocks, max_chunk_tokens=256, cpu_linear=args.cpu_linear,
                                          cpu_attention=args.cpu_attention, cpu_elementwise=args.cpu_elementwise,
                                          kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization))
        self.args = args

    def open(self, histories: list[list[int]]):
        from metronome import StepInput

        sids = [self.engine.open_session() for _ in histories]
        for start in range(0, len(histories[0]), 256):
            self.engine.step([StepInput(s, token_ids=h[start:start + 256]) for s, h in zip(sids, histories)])
        return sids

    @timed
    def tick(self, sids, chunks: list[list[int]]) -> Tick:
        from metronome import StepInput

        t0 = perf_counter()
        outs = self.engine.step([StepInput(s, token_ids=c, max_new_tokens=self.args.new_tokens)
                                 for s, c in zip(sids, chunks)])
        ms = (perf_counter() - t0) * 1e3
        bad = [o for o in outs if o.error or len(o.token_ids) != self.args.new_tokens]
        if bad:
            raise RuntimeError(f"session {bad[0].session_id}: {bad[0].error or len(bad[0].token_ids)}")
        t = self.engine.last_timing
        return Tick(ms, t.prefill_ms, t.decode_ms, sum(len(o.token_ids) for o in outs))

    def close(self, sids) -> None:
        for s in sids:
            self.engine.close_session(s)


class TransformersArm:
    def __init__(self, dtype: str, checkpoint: str, args) -> None:
        import inspect

        from transformers import AutoModelForCausalLM, DynamicCache

        self.DynamicCache = DynamicCache
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
        self.args = args
        # Newer transformers name the cache argument ``cache`` (the old name warns, then goes away).
        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    @torch.inference_mode()
    def _forward(self, state: dict, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_kw: state["cache"]})
        return out.logits[:, -1].argmax(-1)

    def open(self, histories: list[list[int]]):
        state = {"cache": self.DynamicCache(config=self.model.config), "pending": None}
        self._forward(state, torch.tensor(histories))
        return state

    @timed
    def tick(self, state, chunks: list[list[int]]) -> Tick:
        t0 = perf_counter()
        ids = torch.tensor(chunks)
        if state["pending"] is not None:
            ids = torch.cat([state["pending"][:, None], ids], 1)
        token = self._forward(state, ids)
        t1 = perf_counter()
        for _ in range(self.args.new_tokens - 1):
            token = self._forward(state, token[:, None])
        state["pending"] = token
        t2 = perf_counter()
        return Tick((t2 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3, len(chunks) * self.args.new_tokens)

    def close(self, state) -> None:
        state["cache"] = None


def build_arm(name: str, checkpoints: dict, args):
    kind, dtype = name.split("-")
    return (MetronomeArm if kind == "metronome" else TransformersArm)(dtype, checkpoints[kind], args)


# ``--narrow``: SmolLM2's 30 layers, vocabulary and head dim at a width of one head, so a tick's arithmetic is
# small and what remains is its fixed cost per layer and round (calls, checks, allocations, scheduling).
NARROW = dict(hidden_size=64, intermediate_size=128, num_attention_heads=1, num_key_value_heads=1)


def random_checkpoint(directory: Path, narrow: bool = False) -> str:
    """SmolLM2-135M's architecture (or its narrow form) with random weights, saved once for both arms to load."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**SMOLLM2, **(NARROW if narrow else {})}),
                                             dtype=torch.float32)
    model.save_pretrained(directory)
    return str(directory)


# ---------------------------------------------------------------------------------------------- sweep
def run_point(arm, n: int, args) -> dict:
    gen = torch.Generator().manual_seed(n)
    ids = lambda k: torch.randint(0, SMOLLM2["vocab_size"], (n, k), generator=gen).tolist()  # noqa: E731
    state = arm.open(ids(args.history))
    try:
        ticks = [arm.tick(state, ids(args.chunk_tokens)) for _ in range(args.ticks + 1)][1:]  # first: warm-up
    finally:
        arm.close(state)
    median = statistics.median(t.ms for t in ticks)
    return {"sessions": n, "ticks_ms": [round(t.ms, 1) for t in ticks], "median_ms": round(median, 1),
            "wall_ms": [round(t.wall_ms, 1) for t in ticks], "cpu_ms": [round(t.cpu_ms, 1) for t in ticks],
            "prefill_ms": round(statistics.median(t.prefill_ms for t in ticks), 1),
            "decode_ms": round(statistics.median(t.decode_ms for t in ticks), 1),
            "tokens_per_s": round(n * args.new_tokens / (median / 1e3), 1),
            "within_budget": median <= args.budget_ms}


def serve_arm(name: str, checkpoints: dict, args, conn) -> None:
    """A child process's loop: build one arm, then run each N the parent sends until it sends None."""
    torch.set_num_threads(args.threads or usable_cores())
    arm = build_arm(name, checkpoints, args)
    conn.send("ready")
    while (n := conn.recv()) is not None:
        try:
            conn.send(run_point(arm, n, args))
        except Exception as exc:   # the parent raises it, with the arm's name
            conn.send(RuntimeError(f"{name} at N = {n}: {exc!r}"))


class ArmProcess:
    """One arm in a process of its own: with the other arms loaded in one process, Metronome's bf16 tick was up
    to a quarter slower than alone (docs/benchmarks/cpu.md); apart, every arm runs as it would alone."""

    def __init__(self, name: str, checkpoints: dict, args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve_arm, args=(name, checkpoints, args, child), daemon=True)
        self.process.start()
        child.close()   # so that a child's death reads as the end of the pipe here
        self._answer()   # "ready": the arms take turns from the first point on, none loading beside another

    def _answer(self):
        try:
            answer = self.conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"arm process exited with code {self.process.exitcode}") from None
        if isinstance(answer, Exception):
            raise answer
        return answer

    def point(self, n: int) -> dict:
        self.conn.send(n)
        return self._answer()

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):   # it may have died since: nothing to tell it
            self.conn.send(None)
        self.process.join(timeout=30)


class Sweep:
    """One arm's points, kept in ``saved`` (its entry in the results) and written out after each."""

    def __init__(self, name: str, arm: ArmProcess, args, saved: dict, save) -> None:
        self.name, self.arm, self.args, self.saved, self.save = name, arm, args, saved, save
        self.points: dict[int, dict] = {}
        self.done = False

    def probe(self, n: int) -> dict:
        p = self.points[n] = self.arm.point(n)
        self.saved.update(points=[self.points[k] for k in sorted(self.points)], capacity=None,
                          capacity_lower_bound=None)
        self.save()
        print(f"  {self.name:>22}  N={n:<3d} median {p['median_ms']:8.0f} ms  "
              f"(prefill {p['prefill_ms']:.0f} + decode {p['decode_ms']:.0f})", file=sys.stderr, flush=True)
        self.done = p["median_ms"] > self.args.cap_factor * self.args.budget_ms
        return p

    def finish(self) -> None:
        """Bisect between the largest N within B and the smallest beyond it, then record the capacity."""
        good = [n for n, p in self.points.items() if p["within_budget"]]
        bad = [n for n, p in self.points.items() if not p["within_budget"]]
        lo, hi = max(good, default=0), min(bad, default=None)
        while self.args.refine and hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.probe(mid)["within_budget"] else (lo, mid)
        self.saved.update(capacity=lo, capacity_lower_bound=hi is None)
        self.save()


def sweep(sweeps: list[Sweep], session_list: list[int]) -> None:
    """Every arm at each N in turn, so that on a shared machine the arms see the same load side by side."""
    for n in session_list:
        for s in sweeps:
            if not s.done:
                s.probe(n)
    for s in sweeps:
        s.finish()


# ---------------------------------------------------------------------------------------------- report
def machine() -> dict:
    cap = read_capability()
    import transformers

    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "cpu": cap.describe(),
            "cpu_model": cap.model, "native_bf16": cap.native_bf16, "auto_dtype": auto_dtype("cpu", cap),
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "cores_usable": usable_cores(),
            "torch_threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def targets(runs: dict, auto: str, native_bf16: bool) -> list[dict]:
    """The CPU targets for Metronome in the dtype ``auto`` picks, each with its measured value."""
    ours = runs.get(f"metronome-{auto}")
    if ours is None or ours.get("capacity") is None:
        return []
    cap = lambda arm: runs[arm].get("capacity") if arm in runs else None  # noqa: E731
    rows = [{"target": f"metronome-{auto} sessions within B >= 24", "value": ours["capacity"],
             "met": ours["capacity"] >= 24}]
    for arm, factor in (("transformers-float32", 3.0), ("transformers-bfloat16", 1.5)):
        if cap(arm):
            ratio = ours["capacity"] / cap(arm)
            rows.append({"target": f"sessions >= {factor:g}x {arm}", "value": f"{ratio:.2f}x "
                         f"({ours['capacity']} vs {cap(arm)})", "met": ratio >= factor})
    at8 = {arm: next((p["median_ms"] for p in runs[arm]["points"] if p["sessions"] == 8), None)
           for arm in runs}
    if at8.get(f"metronome-{auto}") and at8.get("transformers-float32"):
        speedup = at8["transformers-float32"] / at8[f"metronome-{auto}"]
        rows.append({"target": "tick at N = 8 >= 2x faster than transformers-float32",
                     "value": f"{speedup:.2f}x ({at8[f'metronome-{auto}']:.0f} vs {at8['transformers-float32']:.0f} ms)",
                     "met": speedup >= 2.0})
    for row in rows:
        row["applies"] = native_bf16   # the targets assume native bf16
    return rows


def report(results: dict) -> None:
    runs, m = results["runs"], results["machine"]
    names = [a for a in ARMS if a in runs]
    sessions = sorted({p["sessions"] for r in runs.values() for p in r["points"]})
    by = {a: {p["sessions"]: p for p in runs[a]["points"]} for a in names}
    clock = "CPU time of one thread" if results["args"].get("clock") == "cpu" else "wall clock"
    print(f"\n== Median tick (ms, {clock}) vs sessions N: {results['args']['chunk_tokens']} + {results['args']['new_tokens']} "
          f"tokens per session per tick after a {results['args']['history']}-token history; B = "
          f"{results['args']['budget_ms']:.0f} ms (* over B)")
    rows = [[n] + [(f"{by[a][n]['median_ms']:.0f}{'' if by[a][n]['within_budget'] else ' *'}" if n in by[a] else "-")
                   for a in names] for n in sessions]
    print(table(["N"] + names, rows))
    print("\n== Sessions within B")
    print(table(["arm", "sessions"], [[a, "incomplete run" if runs[a].get("capacity") is None else
                                       f"{'>= ' if runs[a]['capacity_lower_bound'] else ''}{runs[a]['capacity']}"]
                                      for a in names]))
    rows = targets(runs, m["auto_dtype"], m["native_bf16"])
    if rows:
        note = "" if m["native_bf16"] else " (they assume native bf16, which this CPU lacks: shown for how close it gets)"
        print(f"\n== Targets for metronome-{m['auto_dtype']} (dtype='auto' here){note}")
        print(table(["target", "measured", "met"], [[r["target"], r["value"], "yes" if r["met"] else "no"]
                                                   for r in rows]))
    print(f"\nmachine: {m['cpu']}; torch {m['torch']} ({m['torch_threads']} threads, OMP_WAIT_POLICY="
          f"{m['omp_wait_policy']}, GOMP_SPINCOUNT={m.get('gomp_spincount')}), transformers {m['transformers']}; "
          f"load {m['loadavg_start']}")


def profile_tick(checkpoint: str, n: int, args) -> dict:
    """One Metronome tick at N sessions (dtype auto) under torch.profiler: time per kind of op."""
    from torch.profiler import ProfilerActivity, profile

    arm = MetronomeArm("auto", checkpoint, args)
    if args.per_round_gather:   # the reference's path: every round gathers the keys again
        arm.engine.runner.decode_window = None
    gen = torch.Generator().manual_seed(n)
    ids = lambda k: torch.randint(0, SMOLLM2["vocab_size"], (n, k), generator=gen).tolist()  # noqa: E731
    state = arm.open(ids(args.history))
    for _ in range(2):   # warm-up: the decode window's buffers grow (zeroed anew) in the first two ticks
        arm.tick(state, ids(args.chunk_tokens))
    native = time_native_calls(arm.engine)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        native.clear()
        tick = arm.tick(state, ids(args.chunk_tokens))
    kinds = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"),
             "attention (SDPA)": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
             "gather / KV copies": ("aten::index_select", "aten::index_copy_", "aten::index", "aten::index_put_",
                                    "aten::copy_", "aten::cat"),
             "sampling (argmax)": ("aten::argmax",)}
    split = {k: 0.0 for k in kinds}
    split["elementwise and other ops"] = 0.0
    for e in prof.key_averages():
        kind = next((k for k, names in kinds.items() if e.key in names), "elementwise and other ops")
        split[kind] += e.self_cpu_time_total / 1e3
    for kind, ms in native.items():   # the C kernels run outside torch's profiler: timed around each call
        split[kind] = split.get(kind, 0.0) + ms
    ops = sum(split.values())
    split["outside torch ops (Python, scheduling)"] = max(0.0, tick.ms - ops)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return {"sessions": n, "dtype": arm.engine.config.dtype, "per_round_gather": args.per_round_gather,
            "tick_ms": round(tick.ms, 1),
            "prefill_ms": round(tick.prefill_ms, 1), "decode_ms": round(tick.decode_ms, 1),
            "split_ms": {k: round(v, 1) for k, v in split.items()},
            "top_ops": [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 1), "calls": e.count} for e in top]}


NATIVE_KINDS = {"metronome_decode_attention": "C kernels: attention",
                "metronome_skinny_linear": "C kernels: products",
                "metronome_e4m3_linear": "C kernels: products", "metronome_e4m3_linear_pairs": "C kernels: products",
                "metronome_scatter_rows": "gather / KV copies",
                "metronome_copy_rows": "gather / KV copies", "metronome_e4m3_dequantize": "gather / KV copies",
                "metronome_e4m3_quantize": "gather / KV copies",
                "metronome_rms_norm": "C kernels: norms, RoPE, SiLU", "metronome_rope": "C kernels: norms, RoPE, SiLU",
                "metronome_silu_mul": "C kernels: norms, RoPE, SiLU"}


def time_native_calls(engine) -> dict[str, float]:
    """Wrap the engine's C kernels (the one ctypes library its modules and decode window call) so that each call
    adds its wall time, in ms, to the returned dict under its kind."""
    import time

    spent: dict[str, float] = {}
    if engine.cpu_kernels is None:
        return spent
    cdll = engine.cpu_kernels.cdll
    for name, kind in NATIVE_KINDS.items():
        def timed(*args, _call=getattr(cdll, name), _kind=kind):
            start = time.perf_counter()
            try:
                return _call(*args)
            finally:
                spent[_kind] = spent.get(_kind, 0.0) + (time.perf_counter() - start) * 1e3
        setattr(cdll, name, timed)
    return spent


def round_products(n: int, passes: int = 5) -> dict:
    """One decode round's linear products in SmolLM2's 30 layers (q/k/v, o, gate/up and down; the logits' head
    is the same in all) for N rows: of bf16, the weights in bf16 packed for oneDNN (``cpu_linear="packed"``, what
    ``auto`` picks where the CPU has bf16) and in E4M3 through the C kernel (``quantization="fp8"``); of float32
    (what ``auto`` picks elsewhere), the weights through the C kernel (``cpu_linear="kernel"``) and through aten's
    ``F.linear`` (``"aten"``). Random weights, each layer's in turn, so they come from memory as in a round; the
    forms alternate, best of ``passes``."""
    from torch import nn

    from metronome.models.cpu_linear import KernelLinear, PackedLinear, packable
    from metronome.models.fp8 import Fp8Linear, quantize, use_cpu_kernel_
    from metronome.native import load_library

    hidden, inter = SMOLLM2["hidden_size"], SMOLLM2["intermediate_size"]
    qkv = (SMOLLM2["num_attention_heads"] + 2 * SMOLLM2["num_key_value_heads"]) * SMOLLM2["head_dim"]
    shapes = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    gen = torch.Generator().manual_seed(n)
    weights = [[torch.randn(out, inp, generator=gen).to(torch.bfloat16) for out, inp in shapes]
               for _ in range(SMOLLM2["num_hidden_layers"])]
    rows = {inp: torch.randn(n, inp, generator=gen).to(torch.bfloat16) for _, inp in shapes}
    library = load_library()
    fp8 = nn.ModuleList(nn.ModuleList(Fp8Linear(*quantize(w.float()), w.shape[1], None) for w in layer)
                        for layer in weights)
    use_cpu_kernel_(fp8, library, torch.bfloat16)
    forms = {"e4m3": fp8}
    if packable(torch.bfloat16):
        forms = {"bf16_packed": [[PackedLinear(w) for w in layer] for layer in weights], **forms}
    float32 = [[nn.Linear(w.shape[1], w.shape[0], bias=False) for w in layer] for layer in weights]
    for layer, source in zip(float32, weights):
        for linear, w in zip(layer, source):
            linear.weight.data = w.float()
    forms.update(f32_kernel=[[KernelLinear(linear, library) for linear in layer] for layer in float32],
                 f32_aten=float32)
    rows32 = {inp: x.float() for inp, x in rows.items()}
    best = {name: float("inf") for name in forms}
    with torch.inference_mode():      # as the engine runs them
        for _ in range(passes):
            for name, layers in forms.items():
                inputs = rows32 if name.startswith("f32") else rows
                t0 = perf_counter()
                for layer in layers:
                    for product, (_, inp) in zip(layer, shapes):
                        product(inputs[inp])
                best[name] = min(best[name], (perf_counter() - t0) * 1e3)
    params = sum(w.numel() for w in weights[0]) * len(weights)
    return {"sessions": n, "weights_mb_bf16": round(2 * params / 1e6, 1), "weights_mb_e4m3": round(params / 1e6, 1),
            "pair_layout": fp8[0][0].cpu_product.pairs, **{f"{name}_ms": round(ms, 2) for name, ms in best.items()}}


def attention_layer(n: int, args, passes: int = 4) -> list[dict]:
    """One decode round's attention in one layer at SmolLM2's shapes (9 query heads on 3 KV heads of 64) over
    N sessions' S + W live keys, per dtype: the C kernel (``attention/cpu_kernel.py``), SDPA over the decode
    window's grouped query rows (each KV head read once) and SDPA's ``enable_gqa``. Each call reads the K/V of
    one of 30 layers in turn, as a decode round does, so they come from memory, not from a warm cache; the
    forms alternate, best of ``passes`` passes over the layers."""
    import torch.nn.functional as F

    from metronome.attention.cpu_kernel import load_kernel
    from metronome.native import KernelBuildError

    try:
        kernel = load_kernel()
    except KernelBuildError as e:
        print(f"the C kernel is not timed: {e}", file=sys.stderr)
        kernel = None
    heads, kv_heads, dim = SMOLLM2["num_attention_heads"], SMOLLM2["num_key_value_heads"], SMOLLM2["head_dim"]
    group, keys, layers = heads // kv_heads, args.sinks + args.window, SMOLLM2["num_hidden_layers"]
    gen = torch.Generator().manual_seed(n)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(n, heads, dim, generator=gen).to(dtype)
        # Rows with spare columns, as the decode window's buffers have: the attended width is a strided view.
        kv = [tuple(torch.randn(n, kv_heads, keys + 64, dim, generator=gen).to(dtype)[:, :, :keys] for _ in range(2))
              for _ in range(layers)]
        mask = torch.rand(n, 1, 1, keys, generator=gen) > 0.05
        forms = {"grouped": lambda k, v: F.scaled_dot_product_attention(q.view(n, kv_heads, group, dim), k, v,
                                                                        attn_mask=mask),
                 "enable_gqa": lambda k, v: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask,
                                                                           enable_gqa=True)}
        if kernel is not None and kernel.supports(dtype, dim):
            flat = mask.view(n, keys)
            forms = {"kernel": lambda k, v: kernel(q.view(n, kv_heads, group, dim), k, v, flat, dim ** -0.5),
                     **forms}
        best = {name: float("inf") for name in forms}
        for _ in range(passes):
            for name, run in forms.items():
                t0 = perf_counter()
                for k, v in kv:
                    run(k, v)
                best[name] = min(best[name], (perf_counter() - t0) / layers * 1e3)
        k = kv[0][0]
        rows.append({"sessions": n, "dtype": str(dtype).removeprefix("torch."), "keys": keys,
                     "kv_mb": round(2 * k.numel() * k.element_size() / 1e6, 1),
                     **{f"{name}_ms": round(ms, 3) for name, ms in best.items()}})
    return rows


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
    p.add_argument("--sessions", default=None, help=f"N values to sweep [default {DEFAULT_SESSIONS}]")
    p.add_argument("--ticks", type=int, default=None, help="measured ticks per point after 1 warm-up [default 2]")
    p.add_argument("--history", type=int, default=None, help="tokens per session before the first tick [default 300]")
    p.add_argument("--chunk-tokens", type=int, default=26)
    p.add_argument("--new-tokens", type=int, default=25)
    p.add_argument("--budget-ms", type=float, default=2000.0)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="what a tick's time is: wall clock, or this process's CPU time (on a shared machine with "
                        "--threads 1, the time the tick would take on a core of its own)")
    p.add_argument("--cap-factor", type=float, default=1.5, help="stop an arm once its median tick passes this x B")
    p.add_argument("--no-refine", dest="refine", action="store_false", help="skip the bisection for the capacity")
    p.add_argument("--sinks", type=int, default=16)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="torch threads [default: usable cores]")
    p.add_argument("--random-weights", action="store_true", help="SmolLM2's shapes with random weights")
    p.add_argument("--narrow", action="store_true",
                   help="random weights, SmolLM2's 30 layers at width 64: a tick's fixed cost, little arithmetic")
    p.add_argument("--cpu-linear", choices=["auto", "packed", "kernel", "aten"], default="auto",
                   help="Metronome's linear layers: bf16 weights packed for oneDNN, float32 through the C kernel, "
                        "or aten's F.linear (EngineConfig)")
    p.add_argument("--cpu-attention", choices=["auto", "kernel", "sdpa"], default="auto",
                   help="Metronome's decode-round attention: the C kernel or SDPA (EngineConfig)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="Metronome's KV pages: the compute dtype or E4M3 with a scale per head (EngineConfig)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="Metronome's decoder weights: E4M3 with a scale per output channel (EngineConfig)")
    p.add_argument("--cpu-elementwise", choices=["auto", "kernel", "torch"], default="auto",
                   help="Metronome's norms, rotary embedding and activation: one C call each or torch's "
                        "operators (EngineConfig)")
    p.add_argument("--profile", default=None, metavar="N[,N]", help="profile one tick at each N instead")
    p.add_argument("--attention", default=None, metavar="N[,N]",
                   help="time one layer's decode-round attention at each N instead (the C kernel and SDPA's forms)")
    p.add_argument("--products", default=None, metavar="N[,N]",
                   help="time one decode round's linear products at each N instead (bf16, E4M3 and float32 weights)")
    p.add_argument("--per-round-gather", action="store_true",
                   help="--profile: decode rounds gather the keys every round (the reference) instead of once a step")
    p.add_argument("--merge", nargs="+", default=None, help="print one report from these result files")
    p.add_argument("--out", default="results/engine_cpu.json")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else dict(sessions=DEFAULT_SESSIONS, ticks=2, history=300)).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.session_list = sorted({int(x) for x in str(args.sessions).split(",") if x.strip()})
    args.profile = [int(x) for x in args.profile.split(",")] if args.profile else None
    args.attention = [int(x) for x in args.attention.split(",")] if args.attention else None
    args.products = [int(x) for x in args.products.split(",")] if args.products else None
    args.arm_list = [a.strip() for a in args.arms.split(",") if a.strip()]
    if set(args.arm_list) - set(ARMS):
        p.error(f"--arms takes {', '.join(ARMS)}")
    if args.history < 1 or args.chunk_tokens + 1 > 256:
        p.error("--history must be >= 1 and --chunk-tokens + 1 <= 256 (the engine's chunk)")
    return args


def merge(paths: list[str]) -> dict:
    merged = None
    for path in paths:
        result = json.loads(Path(path).read_text())
        if merged is None:
            merged = result
        else:
            merged["runs"].update(result["runs"])
            merged.setdefault("merged_machines", []).append(result["machine"])
    return merged


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        report(merge(args.merge))
        return 0
    torch.set_num_threads(args.threads or usable_cores())
    results = {"benchmark": "engine_cpu", "machine": machine(), "args": {k: v for k, v in vars(args).items()},
               "runs": {}}
    if results["machine"]["loadavg_start"][0] > 0.5 * usable_cores():
        print(f"warning: load average {results['machine']['loadavg_start']} on {usable_cores()} cores: another "
              "process is busy, timings will be slow and noisy", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.products:
        results["products"] = [round_products(n) for n in args.products]
        out.write_text(json.dumps(results, indent=1))
        ms = lambda r, form: f"{r[form + '_ms']:.1f} ms" if form + "_ms" in r else "-"  # noqa: E731
        print(table(["N", "weights bf16 / E4M3", "bf16, packed for oneDNN", "E4M3, C kernel", "E4M3 layout",
                     "float32, C kernel", "float32, aten"],
                    [[r["sessions"], f"{r['weights_mb_bf16']} / {r['weights_mb_e4m3']} MB", ms(r, "bf16_packed"),
                      ms(r, "e4m3"), "pairs" if r["pair_layout"] else "rows", ms(r, "f32_kernel"),
                      ms(r, "f32_aten")] for r in results["products"]]))
        print(f"\nmachine: {results['machine']['cpu']}; torch {results['machine']['torch']} "
              f"({torch.get_num_threads()} threads)\nraw results: {out}")
        return 0
    if args.attention:
        results["attention"] = [row for n in args.attention for row in attention_layer(n, args)]
        out.write_text(json.dumps(results, indent=1))
        ms = lambda r, form: f"{r[form + '_ms']:.2f} ms" if form + "_ms" in r else "-"  # noqa: E731
        print(table(["N", "dtype", "K/V read", "C kernel", "SDPA grouped rows", "SDPA enable_gqa"],
                    [[r["sessions"], r["dtype"], f"{r['kv_mb']} MB", ms(r, "kernel"), ms(r, "grouped"),
                      ms(r, "enable_gqa")] for r in results["attention"]]))
        print(f"\nmachine: {results['machine']['cpu']}; torch {results['machine']['torch']} "
              f"({torch.get_num_threads()} threads)\nraw results: {out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_weights or args.narrow:
            checkpoints = dict.fromkeys(("metronome", "transformers"), random_checkpoint(Path(tmp), args.narrow))
        else:
            from metronome.models.embedded import embedded_checkpoint

            checkpoints = {"metronome": MODEL, "transformers": str(embedded_checkpoint(MODEL))}
        results["weights"] = ("random, SmolLM2-135M's layers at width 64 (--narrow)" if args.narrow else
                              "random (SmolLM2-135M shapes)" if args.random_weights else "packaged SmolLM2-135M")
        save = lambda: out.write_text(json.dumps(results, indent=1))  # noqa: E731
        if args.profile:
            results["profiles"] = []
            for n in args.profile:
                results["profiles"].append(profile_tick(checkpoints["metronome"], n, args))
                save()
            print(json.dumps(results["profiles"], indent=1))
            return 0
        arms = {}
        try:
            for name in args.arm_list:
                arms[name] = ArmProcess(name, checkpoints, args)
            sweep([Sweep(name, arm, args, results["runs"].setdefault(name, {}), save)
                   for name, arm in arms.items()], args.session_list)
        finally:
            for arm in arms.values():
                arm.close()
        results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        save()
    report(results)
    print(f"\nraw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
