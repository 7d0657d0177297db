"""A Metronome tick beside a busy neighbour process: the thread plan against torch's defaults.

Run from the repository root, on the cores to test (a 2-core box, or two cores of a larger one)::

    taskset -c 0,1 python bench/cpu_neighbour.py                 # N = 8, the packaged SmolLM2
    taskset -c 0,1 python bench/cpu_neighbour.py --random-weights --out results/cpu_neighbour.json

Each configuration runs in its own process (the OpenMP wait policy is read when torch loads), first on
the idle cores, then with a neighbour: a process doing single-threaded float32 matrix products
non-stop (a stand-in for the ASR or any other program sharing the box). Configurations:

* ``default``: torch's defaults, one intra-op thread per core, OpenMP's default wait policy (it spins for
  milliseconds).
* ``passive``: the same threads with ``OMP_WAIT_POLICY=PASSIVE`` (idle threads sleep at once).
* ``brief``: the same threads spinning briefly before they sleep (``metronome.cpu.THREAD_WAIT_ENV``, what
  ``metronome serve`` sets): the engine alone on the box's cores, as without the speech front end.
* ``plan``: ``ThreadPlan.for_box(cores, speech=True)``, what ``metronome serve`` gives the engine on this
  box (1 thread on 2 cores; the other core is the speech front end's), ``THREAD_WAIT_ENV``.
* ``plan-nice``: the plan with its neighbours at the plan's ``speech_nice``, as ``serve`` runs the speech
  threads (VAD, ASR, speech out). ``--neighbours 2`` stands for the ASR and speech out busy at once: then
  speech outnumbers its core and meets the tick on the engine's.

A tick: N sessions (``--sessions``, 8) with a 300-token history each get 26 tokens and decode 25,
``dtype="auto"``. Target: with the plan, a tick beside the neighbour within 1.5x of the same tick on the
idle cores. A configuration stops early once a tick passes ``--cap-s``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEIGHBOUR = ("import torch, time\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\n"
             "while True:\n    a = torch.tanh(a @ a)\n")


def child(args) -> None:
    """Load the engine under the environment the parent chose, tick, print one JSON line."""
    import torch

    from metronome import Engine, EngineConfig, KVPolicy, StepInput
    from metronome.engine.blocks import blocks_per_session

    torch.set_num_threads(args.threads)
    policy = KVPolicy(sinks=16, window=1024, block_size=16)
    engine = Engine(EngineConfig(model=args.checkpoint, policy=policy, max_chunk_tokens=256,
                                 num_blocks=blocks_per_session(policy, 256, 8192) * args.sessions + 2))
    gen = torch.Generator().manual_seed(0)
    ids = lambda k: torch.randint(0, 49152, (args.sessions, k), generator=gen).tolist()  # noqa: E731
    sids = [engine.open_session() for _ in range(args.sessions)]
    for start in range(0, 300, 150):
        engine.step([StepInput(s, token_ids=h) for s, h in zip(sids, ids(150))])
    ticks = []
    for _ in range(args.ticks + 1):
        t0 = time.perf_counter()
        engine.step([StepInput(s, token_ids=c, max_new_tokens=25) for s, c in zip(sids, ids(26))])
        ticks.append((time.perf_counter() - t0) * 1e3)
        if ticks[-1] > args.cap_s * 1e3:
            break
    print(json.dumps({"ticks_ms": ticks[1:] or ticks, "capped": ticks[-1] > args.cap_s * 1e3,
                      "dtype": engine.config.dtype, "threads": torch.get_num_threads(),
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                      "gomp_spincount": os.environ.get("GOMP_SPINCOUNT")}))


def measure(config: str, neighbour: bool, checkpoint: str, args) -> dict:
    from metronome.cpu import THREAD_WAIT_ENV, ThreadPlan, usable_cores

    cores = usable_cores()
    env = {k: v for k, v in os.environ.items() if k not in (*THREAD_WAIT_ENV, "OMP_WAIT_POLICY")}
    plan = ThreadPlan.for_box(cores, speech=True)
    threads = plan.worker if config in ("plan", "plan-nice") else cores
    if config in ("brief", "plan", "plan-nice"):
        env.update(THREAD_WAIT_ENV)
    if config == "passive":
        env.update(OMP_WAIT_POLICY="PASSIVE", KMP_BLOCKTIME="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    nice = plan.speech_nice if config == "plan-nice" else 0
    others = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR], preexec_fn=(lambda: os.nice(nice)) if nice else None)
              for _ in range(args.neighbours if neighbour else 0)]
    try:
        out = subprocess.run([sys.executable, __file__, "--child", "--checkpoint", checkpoint, "--threads", str(threads),
                              "--sessions", str(args.sessions), "--ticks", str(args.ticks), "--cap-s", str(args.cap_s)],
                             env=env, capture_output=True, text=True, timeout=args.timeout_s, cwd=ROOT)
    finally:
        for other in others:
            other.terminate()
            other.wait()
    if out.returncode:
        raise RuntimeError(f"{config}: child failed\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(config=config, neighbour=neighbour, neighbours=len(others), neighbour_nice=nice,
                  median_ms=statistics.median(result["ticks_ms"]))
    print(f"  {config:>9} {'with neighbours' if neighbour else 'idle':>15}: median {result['median_ms']:8.0f} ms "
          f"({result['threads']} threads{', capped' if result['capped'] else ''})", file=sys.stderr, flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--ticks", type=int, default=3, help="measured ticks after 1 warm-up")
    p.add_argument("--cap-s", type=float, default=30.0, help="stop a configuration after a tick this long")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--configs", default="plan,brief,passive,default",
                   help="of plan, plan-nice, brief, passive, default")
    p.add_argument("--neighbours", type=int, default=1, help="busy neighbour processes beside the tick")
    p.add_argument("--random-weights", action="store_true", help="SmolLM2's shapes with random weights")
    p.add_argument("--out", default="results/cpu_neighbour.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", default="smollm2-135m", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    from metronome.cpu import ThreadPlan, read_capability, usable_cores

    results = {"benchmark": "cpu_neighbour", "cpu": read_capability().describe(), "cores": usable_cores(),
               "plan": ThreadPlan.for_box(usable_cores(), speech=True).to_env(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg_start": os.getloadavg(),
               "sessions": args.sessions, "neighbours": args.neighbours, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = "smollm2-135m"
        if args.random_weights:
            sys.path.insert(0, str(ROOT))
            from bench.engine_cpu import random_checkpoint

            checkpoint = random_checkpoint(Path(tmp))
        for config in args.configs.split(","):
            for neighbour in (False, True):
                results["runs"].append(measure(config, neighbour, checkpoint, args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{results['cpu']}; N = {args.sessions}; median tick (ms)")
    print(f"{'config':>9}  {'idle':>8}  {'neighbours':>10}  ratio   ({args.neighbours} neighbour processes)")
    idle = {r["config"]: r for r in results["runs"] if not r["neighbour"]}
    for r in (r for r in results["runs"] if r["neighbour"]):
        base = idle[r["config"]]["median_ms"]
        print(f"{r['config']:>9}  {base:8.0f}  {('>' if r['capped'] else '') + format(r['median_ms'], '.0f'):>10}  "
              f"{r['median_ms'] / base:.2f}x")
    served = "plan-nice" if "plan-nice" in idle else "plan"   # what ``serve`` runs: the plan, speech at its nice
    plan = [r for r in results["runs"] if r["config"] == served]
    if len(plan) == 2:
        ratio = plan[1]["median_ms"] / plan[0]["median_ms"]
        print(f"target: {served} with neighbours <= 1.5x idle: {ratio:.2f}x, {'met' if ratio <= 1.5 else 'NOT met'}")
    print(f"raw results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
