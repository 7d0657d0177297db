"""Host cost of a rebase's slot list, before and after ``runner.window_slots``.

A rebase re-rotates every key of each moving session's window, so the host must list their flat cache
slots. Before: one small torch construction per session (``arange``, a Python list of its blocks, index
arithmetic). After: ``metronome.engine.runner.window_slots``, one numpy pass over every token. Host-only
(no GPU); checks that both give the same slots:

    PYTHONPATH=. python bench/rebase_slots_host.py --sessions 320 --window 1024 --out results/rebase_slots_host.json

Defaults: the served shape at capacity on the H200 (docs/benchmarks/gpu.md §2f): 320 sessions, S = 16,
W = 1024, blocks of 16, all rebasing in one forward.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from bench.host_timing import mean_ms
from metronome.engine.runner import window_slots
from metronome.engine.session import Session


def per_session_slots(session: Session, lo: int, hi: int, block_size: int) -> torch.Tensor:
    """The construction ``window_slots`` replaced (``ModelRunner._token_slots``)."""
    tokens = torch.arange(lo, hi)
    logical = tokens // block_size
    physical = torch.tensor([session.physical(b) for b in range(lo // block_size, (hi - 1) // block_size + 1)])
    return physical[logical - lo // block_size] * block_size + tokens % block_size


def make_sessions(n: int, sinks: int, window: int, block_size: int) -> list[tuple[Session, int, int]]:
    spans, next_block = [], 0
    sink_count = -(-sinks // block_size)
    for i in range(n):
        s = Session(session_id=i, reservation=0, sink_count=sink_count, block_size=block_size, opened_seq=i)
        s.num_tokens = sinks + window + 2 * block_size + i % block_size   # windows end mid-block, varied
        for _ in range(-(-s.num_tokens // block_size)):
            s.append_block(next_block)
            next_block += 1
        lo = max(sinks, s.num_tokens - window)
        s.release_window_blocks_below(lo // block_size)
        spans.append((s, lo, s.num_tokens))
    return spans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=320)
    p.add_argument("--sinks", type=int, default=16)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spans = make_sessions(args.sessions, args.sinks, args.window, args.block_size)

    def before():
        return torch.cat([per_session_slots(s, lo, hi, args.block_size) for s, lo, hi in spans])

    def after():
        return window_slots(spans, args.block_size)[0]

    if not torch.equal(before(), torch.from_numpy(after())):
        raise SystemExit("window_slots disagrees with the per-session construction")
    result = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "python": platform.python_version(), "torch": torch.__version__},
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args),
              "keys": int(sum(hi - lo for _, lo, hi in spans)),
              "before_ms": round(mean_ms(before, args.repeats), 3), "after_ms": round(mean_ms(after, args.repeats), 3)}
    print(f"| sessions | keys | per-session tensors | window_slots | ratio |\n|---|---|---|---|---|\n"
          f"| {args.sessions} | {result['keys']:,} | {result['before_ms']:.2f} ms | {result['after_ms']:.2f} ms | "
          f"{result['before_ms'] / result['after_ms']:.1f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
