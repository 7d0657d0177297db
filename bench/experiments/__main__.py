"""``python -m bench.experiments <experiment> --preset cpu|gpu`` (also ``metronome bench ...``).

Experiments: ``cliff`` and ``fill-model`` (1, 2: one sweep, two analyses), ``admission`` (3),
``recycling`` (4: application-level recycling vs SinkWindow), ``ablation`` (5: W and S),
``quality`` (6: perplexity and the spoken-question probe with SmolLM2). ``--from raw.json`` re-analyses.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EXPERIMENTS = ("cliff", "fill-model", "admission", "recycling", "ablation", "quality")
PRESET_NAMES = ("cpu", "gpu", "gpu-short")
NEW = {"recycling": "bench.experiments.recycling", "ablation": "bench.experiments.ablation",
       "quality": "bench.experiments.quality"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", choices=EXPERIMENTS,
                   help="cliff: Unbounded vs SinkWindow walls; fill-model: ρ(t) fit and predicted stall "
                        "(both run the same sweep and write both analyses); admission: the AIMD ramp; recycling: "
                        "application-level recycling vs SinkWindow; ablation: W and S; quality: perplexity and "
                        "the spoken-question probe")
    p.add_argument("--preset", choices=PRESET_NAMES, default="cpu",
                   help="cpu: minutes on this machine; gpu: the paper's scale on an H200; gpu-short: what one "
                        "30-minute device session holds (all but quality)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default results/experiments/<experiment>-<preset>-<timestamp>/)")
    p.add_argument("--from", dest="from_raw", type=Path, default=None,
                   help="re-analyse an existing raw.json (or raw.json.gz) instead of running")
    p.add_argument("--sessions", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="override the preset's N values, e.g. 8,16")
    p.add_argument("--runs", type=int, default=None, help="override R")
    p.add_argument("--duration-s", type=float, default=None, help="override the run length")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--parts", type=lambda s: tuple(s.split(",")), default=("perplexity", "probe"),
                   help="quality: which parts to run (perplexity,probe)")
    p.add_argument("--text-tokens", type=int, default=None, help="quality: override the perplexity text length")
    p.add_argument("--probe-s", type=float, default=None, help="quality: override the probe session length")
    p.add_argument("--window", type=int, default=None, help="quality: override the perplexity window W")
    p.add_argument("--device", default=None,
                   help="quality: run the preset on another device (e.g. the gpu preset's scale on the CPU: "
                        "--preset gpu --device cpu --dtype float32; its results do not depend on timing)")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"), help="quality: with --device")
    from bench.experiments import admission

    admission.add_arguments(p)      # --arms, --profiles, --offered


def preset_of(presets: dict, args: argparse.Namespace):
    if args.preset not in presets:
        raise SystemExit(f"{args.experiment} has no preset {args.preset!r}; its presets: {', '.join(presets)}")
    return presets[args.preset]


def run_new(args: argparse.Namespace) -> int:
    """Experiments 4-6: each module has PRESETS, a run function and write_report."""
    import importlib

    module = importlib.import_module(NEW[args.experiment])
    preset = preset_of(module.PRESETS, args)
    if args.from_raw:
        from bench.experiments.report import load_raw

        raw = load_raw(args.from_raw)
        out = args.out or Path(args.from_raw).parent
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = args.out or Path("results/experiments") / f"{args.experiment}-{preset.name}-{stamp}"
        progress = not args.no_progress
        if args.experiment == "recycling":
            raw = module.run_recycling(preset, out, sessions=args.sessions, runs=args.runs,
                                       duration_s=args.duration_s, progress=progress)
        elif args.experiment == "ablation":
            raw = module.run_ablation(preset, out, runs=args.runs, duration_s=args.duration_s, progress=progress)
        else:
            from dataclasses import replace

            if args.window:
                preset = replace(preset, window=args.window)
            if args.device or args.dtype:
                preset = replace(preset, device=args.device or preset.device, dtype=args.dtype or preset.dtype)
            raw = module.run_quality(preset, out, parts=args.parts, progress=progress,
                                     text_tokens_override=args.text_tokens, session_s=args.probe_s)
    print(module.write_report(raw, out))
    print(f"\nresults in {out}/")
    return 0


def run(args: argparse.Namespace) -> int:
    if (args.device or args.dtype) and args.experiment != "quality":
        raise SystemExit("--device and --dtype apply to quality only (the serving experiments run their preset's "
                         "device: pick the preset)")
    if args.experiment == "admission":
        from bench.experiments import admission

        return admission.run(args)
    if args.experiment in NEW:
        return run_new(args)
    from bench.experiments.presets import PRESETS

    preset = preset_of(PRESETS, args)
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
