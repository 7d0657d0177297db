"""Host cost of one decode round's staging rows for the CUDA graphs, before and after ``staging_rows``.

Before: every row padded to the graph's table width in Python lists, then ``torch.tensor``. After:
``metronome.engine.cuda_graphs.staging_rows`` (numpy, cut to the batch's live blocks). Host-only (no GPU):

    PYTHONPATH=. python bench/staging_rows_host.py --rows 128 --width 2048 --live 44 --out results/staging_rows_host.json

Defaults: an Unbounded session's graph table at a 32k position limit (2,048 blocks of 16) and ~700-token
contexts (44 live blocks), as in the H200 cliff run (docs/experiments/cliff-gpu-short).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from types import SimpleNamespace

import torch

from bench.host_timing import mean_ms
from metronome.engine.cuda_graphs import staging_rows


class _Session(SimpleNamespace):
    def table_row(self):
        return self.table

    def physical(self, logical):
        return self.table[logical]


def padded_lists(segments, block_size: int, width: int) -> torch.Tensor:
    """The construction ``staging_rows`` replaced."""
    rows = []
    for i, seg in enumerate(segments):
        s, t = seg.session, seg.session.num_tokens
        row = s.table_row()
        rows.append([seg.token_ids[0], t - s.position_base, s.physical(t // block_size) * block_size + t % block_size,
                     s.window_first, i, i, 1, t, *row] + [-1] * (width - len(row)))
    return torch.tensor(rows, dtype=torch.long)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--live", type=int, default=44)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="results/staging_rows_host.json")
    args = p.parse_args()
    bs = 16
    segments = [SimpleNamespace(token_ids=[7], session=_Session(
        table=list(range(i * args.live, (i + 1) * args.live)), num_tokens=args.live * bs - 1, position_base=0,
        window_first=0)) for i in range(args.rows)]
    before = mean_ms(lambda: padded_lists(segments, bs, args.width), args.repeats)
    after = mean_ms(lambda: torch.from_numpy(staging_rows(segments, bs)), args.repeats)
    print("| rows | table width | live blocks | padded lists ms/round | staging_rows ms/round |")
    print("|---|---|---|---|---|")
    print(f"| {args.rows} | {args.width} | {args.live} | {before:.2f} | {after:.2f} |")
    with open(args.out, "w") as f:
        json.dump({**vars(args), "padded_lists_ms": before, "staging_rows_ms": after,
                   "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)


if __name__ == "__main__":
    main()
