"""Why do ``bench/attention_gpu.py`` and ``bench/decode_pipeline_gpu.py`` time the same decode launch ~5-10 %
apart (session 7: 158.3 vs 144.6 µs, Qwen2.5-7B, N = 256)? One process, one set of inputs, alternating:

* ``rule``: the plan built the way ``attention_gpu.py`` builds it (the launch rule picks splits and stages);
* ``explicit``: the plan built the way ``decode_pipeline_gpu.py`` builds it (the same values passed in);
* ``run_shape``: ``attention_gpu.run_shape`` itself (no SDPA or Flex), on its own inputs.

    PYTHONPATH=$PWD python3 bench/harness_check_gpu.py --out results/harness_check.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.attention_gpu import MODELS, Shape, Timer, build_sets, parse_args as attention_args, run_shape  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/harness_check.json")
    p.add_argument("--sessions", default="64,256,512")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--run-shape-first", action="store_true", help="time run_shape before the own plans")
    args = p.parse_args()
    import torch

    from metronome.attention.triton_paged import paged_attention_triton, plan_triton

    device = torch.device("cuda")
    timer = Timer(device, graphs=True, warmup=3, repeats=20)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    a_args = attention_args(["--no-flex"])
    plan_kw = {"num_sms": num_sms, "block_n": 64, "force_splits": None, "target_programs": None,
               "prefill_block_m": 64, "num_warps": None, "num_stages": None}
    rows = []
    for n in [int(x) for x in args.sessions.split(",")]:
        shape = Shape("qwen2.5-7b", *MODELS["qwen2.5-7b"], "decode", 1, n)

        def own_plans():
            per_session_kv = (a_args.sinks + a_args.window + 1) * shape.kv_heads * shape.head_dim * 4
            n_sets = max(1, min(a_args.max_sets, math.ceil(a_args.rotate_mb * 2**20 / (per_session_kv * n))))
            sets = build_sets(shape, n_sets, a_args, device, torch.bfloat16, plan_kw)
            ln = sets.plans[0].launches[0]
            explicit = [plan_triton(m, shape.heads, shape.kv_heads, num_sms=num_sms, block_n=64, num_warps=4,
                                    num_stages=ln.num_stages, force_splits=ln.num_splits) for m in sets.metas]
            scale = 1.0 / math.sqrt(shape.head_dim)

            def calls(plans):
                return [lambda s=s: paged_attention_triton(sets.queries[s], sets.k_cache, sets.v_cache, sets.metas[s],
                                                           scale, plans[s], out=sets.outs[s]) for s in range(n_sets)]
            for r in range(args.rounds):
                for name, plans in (("rule", sets.plans), ("explicit", explicit)):
                    t = timer.graph(calls(plans))
                    rows.append({"n": n, "round": r, "how": name, "us": t * 1e6, "stages": ln.num_stages,
                                 "splits": ln.num_splits})
                    print(f"N={n} round {r} {name:<9} {t * 1e6:7.1f} µs", flush=True)
            del sets, explicit
            torch.cuda.empty_cache()

        def with_run_shape():
            for r in range(args.rounds):
                row = run_shape(shape, a_args, device, torch.bfloat16, timer, plan_kw, None, False)
                t = row["triton_graph_s"]
                rows.append({"n": n, "round": r, "how": "run_shape", "us": t * 1e6})
                print(f"N={n} round {r} run_shape {t * 1e6:7.1f} µs", flush=True)

        for step in ((with_run_shape, own_plans) if args.run_shape_first else (own_plans, with_run_shape)):
            step()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
