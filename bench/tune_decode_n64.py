"""Decode-kernel sweep at N = 64 (Qwen2.5-7B shape, S=16, W=1024): tile, warps, stages, splits.

    PYTHONPATH=$PWD python3 bench/tune_decode_n64.py --out results/tune_decode_n64.json

Each configuration is one ``bench/attention_gpu.py`` run (Triton only, CUDA-graph timing), in one
process; prints the configurations sorted by time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import time

from bench.attention_gpu import main as attention_main


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results/tune_decode_n64.json")
    p.add_argument("--sessions", default="64")
    p.add_argument("--budget-s", type=float, default=200.0)
    args = p.parse_args()
    grid = [(bn, w, s, sp) for bn, w, s, sp in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (1, 2))
            if not (bn == 128 and w == 2) and not (bn == 32 and w == 8)]
    results, t0 = [], time.perf_counter()
    for bn, w, s, sp in grid:
        if time.perf_counter() - t0 > args.budget_s:
            break
        path = f"/tmp/tune_{bn}_{w}_{s}_{sp}.json"
        argv = ["--models", "qwen2.5-7b", "--modes", "decode", "--sessions", args.sessions, "--no-flex", "--no-sdpa",
                "--repeats", "30", "--block-n", str(bn), "--num-warps", str(w), "--num-stages", str(s),
                "--force-splits", str(sp), "--out", path]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                attention_main(argv)
            rows = json.load(open(path))["rows"]
        except Exception as exc:  # noqa: BLE001  (a config the compiler rejects is skipped, not fatal)
            results.append({"block_n": bn, "warps": w, "stages": s, "splits": sp, "error": str(exc)[:120]})
            continue
        for row in rows:
            if "skipped" in row:
                continue
            results.append({"block_n": bn, "warps": w, "stages": s, "splits": sp, "N": row["n"],
                            "us": (row.get("triton_graph_s") or row["triton_eager_s"]) * 1e6,
                            "pct_copy": row.get("triton_pct_copy")})
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    for r in ok[:15]:
        print(f"N={r['N']} block_n={r['block_n']:<4} warps={r['warps']} stages={r['stages']} splits={r['splits']}: "
              f"{r['us']:.1f} µs")
    print(f"{len(ok)} configs timed, {len(results) - len(ok)} failed")
    json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
