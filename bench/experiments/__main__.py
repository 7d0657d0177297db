"""``python -m bench.experiments <cliff|fill-model> --preset cpu|gpu`` (also ``metronome bench ...``).

The admission ramp has its own entry point: ``python -m bench.experiments.admission`` or
``metronome bench admission``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EXPERIMENTS = ("cliff", "fill-model")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", choices=EXPERIMENTS,
                   help="cliff: Unbounded vs SinkWindow walls; fill-model: ρ(t) fit and predicted stall "
                        "(both run the same sweep and write both analyses)")
    p.add_argument("--preset", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default results/experiments/<experiment>-<preset>-<timestamp>/)")
    p.add_argument("--from", dest="from_raw", type=Path, default=None,
                   help="re-analyse an existing raw.json (or raw.json.gz) instead of running")
    p.add_argument("--sessions", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="override the preset's N values, e.g. 8,16")
    p.add_argument("--runs", type=int, default=None, help="override R")
    p.add_argument("--duration-s", type=float, default=None, help="override the run length")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from bench.experiments.presets import PRESETS

    preset = PRESETS[args.preset]
    if args.from_raw:
        from bench.experiments.report import load_raw

        raw = load_raw(args.from_raw)
        out = args.out or Path(args.from_raw).parent
    else:
        from bench.experiments.sweep import run_sweep

        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = args.out or Path("results/experiments") / f"{args.experiment}-{preset.name}-{stamp}"
        raw = run_sweep(preset, out, sessions=args.sessions, runs=args.runs, duration_s=args.duration_s,
                        progress=not args.no_progress)
    from bench.experiments.report import write_report

    summary = write_report(raw, out, focus=args.experiment)
    print(summary)
    print(f"\nresults in {out}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
