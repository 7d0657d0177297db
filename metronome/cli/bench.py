"""``metronome bench <experiment> --preset cpu|gpu|gpu-short``: the paper's experiments, from the installed package.

    metronome bench cliff --preset cpu            # ~9 min on 2 CPU cores; results/experiments/cliff-cpu-<stamp>/
    metronome bench fill-model --preset cpu       # the same sweep as cliff, analysed for the fill model
    metronome bench admission --preset cpu        # ~5 min; the AIMD admission ramp
    metronome bench admission --preset cpu --profiles ramp,step,spike --arms robust-sink_window,paper-sink_window
    metronome bench recycling --preset cpu        # ~3 min; latency vs session age, recycled contexts vs SinkWindow
    metronome bench ablation --preset cpu         # ~5 min; tick latency and KV memory over a W x S grid
    metronome bench quality --preset cpu          # ~6 min; SmolLM2 perplexity per policy + spoken-question probe
    metronome bench cliff --from results/experiments/<run>/raw.json   # re-analyse without running

Each run writes raw.json, a markdown summary and, with matplotlib installed (the `experiments` extra), PNG plots.
"""

from __future__ import annotations

import argparse
import importlib
import time
from dataclasses import replace
from pathlib import Path

from metronome.cli.help import HelpFormatter

EXPERIMENTS = ("cliff", "fill-model", "admission", "recycling", "ablation", "quality")
PRESET_NAMES = ("cpu", "gpu", "gpu-short", "gpu-cliff")
# Experiments whose module holds its own PRESETS and run function, and where their write_report lives.
OWN_MODULE = {"recycling": "metronome.experiments.recycling", "ablation": "metronome.experiments.ablation",
              "quality": "metronome.experiments.quality"}
REPORT_MODULE = {"recycling": "metronome.experiments.recycling", "ablation": "metronome.experiments.ablation",
                 "quality": "metronome.experiments.quality_report"}


def csv_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def csv_paths(text: str) -> tuple[Path, ...]:
    return tuple(Path(x) for x in text.split(",") if x)


def csv_words(text: str) -> tuple[str, ...]:
    return tuple(text.split(","))


def add_parser(sub) -> None:
    from metronome.experiments.admission import ARMS, PROFILES

    p = sub.add_parser("bench", help="run one of the paper's experiments (cliff, fill-model, admission, recycling, "
                                     "ablation, quality)", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("experiment", choices=EXPERIMENTS,
                   help="cliff: Unbounded vs SinkWindow walls; fill-model: the fill fit and predicted stall "
                        "(both run the same sweep); admission: the AIMD ramp; recycling: application-level "
                        "recycling vs SinkWindow; ablation: W and S; quality: perplexity and the spoken-question probe")
    p.add_argument("--preset", choices=PRESET_NAMES, default="cpu",
                   help="cpu: minutes on this machine; gpu: the paper's scale on an H200; gpu-short: what 30 "
                        "minutes of an H200 hold (all but quality); gpu-cliff: cliff and fill-model only, R = 10 one-minute runs "
                        "at N = 128 (split them with --first-run)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: results/experiments/<experiment>-<preset>-<timestamp>/)")
    p.add_argument("--from", dest="from_raw", type=csv_paths, default=None,
                   help="re-analyse an existing raw.json (or raw.json.gz) instead of running; cliff and fill-model "
                        "join several parts of one sweep given comma-separated (see --first-run)")
    p.add_argument("--sessions", type=csv_ints, default=None, help="override the preset's N values, e.g. 8,16")
    p.add_argument("--runs", type=int, default=None, help="override the runs per point R")
    p.add_argument("--first-run", type=int, default=0,
                   help="cliff and fill-model: number (and seed) the runs from here, to split R over several "
                        "processes or machines' time slots")
    p.add_argument("--duration-s", type=float, default=None, help="override the run length")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group("quality")
    g.add_argument("--parts", type=csv_words, default=("perplexity", "probe"), help="which parts to run")
    g.add_argument("--text-tokens", type=int, default=None, help="override the perplexity text length")
    g.add_argument("--probe-s", type=float, default=None, help="override the probe session length")
    g.add_argument("--window", type=int, default=None, help="override the perplexity window W")
    g.add_argument("--device", default=None,
                   help="run the preset on another device (e.g. the gpu preset's scale on the CPU: "
                        "--preset gpu --device cpu --dtype float32; its results do not depend on timing)")
    g.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"), help="with --device")
    g = p.add_argument_group("admission")
    g.add_argument("--arms", type=csv_words, default=None, help=f"comma-separated subset of {','.join(ARMS)}")
    g.add_argument("--profiles", type=csv_words, default=("ramp",),
                   help=f"comma-separated load profiles out of {','.join(PROFILES)}")
    g.add_argument("--offered", type=int, default=None, help="override the sessions offered")
    g.add_argument("--arrival-rate", type=float, default=None,
                   help="override the open-loop arrivals per second (a lower rate offers load for longer)")
    p.set_defaults(run=run)


def preset_of(presets: dict, args: argparse.Namespace):
    if args.preset not in presets:
        raise SystemExit(f"{args.experiment} has no preset {args.preset!r}; its presets: {', '.join(presets)}")
    return presets[args.preset]


def out_dir(args: argparse.Namespace, preset_name: str) -> Path:
    if args.out:
        return args.out
    if args.from_raw:
        return Path(args.from_raw[0]).parent
    return Path("results/experiments") / f"{args.experiment}-{preset_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def one_raw(args: argparse.Namespace):
    """``--from`` for the experiments that re-analyse a single run."""
    from metronome.experiments.report import load_raw

    if len(args.from_raw) != 1:
        raise SystemExit(f"{args.experiment} re-analyses one run: give --from a single raw.json")
    return load_raw(args.from_raw[0])


def run_own_module(args: argparse.Namespace) -> tuple[str, Path]:
    module = importlib.import_module(OWN_MODULE[args.experiment])
    preset = preset_of(module.PRESETS, args)
    out = out_dir(args, preset.name)
    progress = not args.no_progress
    if args.from_raw:
        raw = one_raw(args)
    elif args.experiment == "recycling":
        raw = module.run_recycling(preset, out, sessions=args.sessions, runs=args.runs,
                                   duration_s=args.duration_s, progress=progress)
    elif args.experiment == "ablation":
        raw = module.run_ablation(preset, out, runs=args.runs, duration_s=args.duration_s, progress=progress)
    else:
        if args.window:
            preset = replace(preset, window=args.window)
        if args.device or args.dtype:
            preset = replace(preset, device=args.device or preset.device, dtype=args.dtype or preset.dtype)
        raw = module.run_quality(preset, out, parts=args.parts, progress=progress,
                                 text_tokens_override=args.text_tokens, session_s=args.probe_s)
    return importlib.import_module(REPORT_MODULE[args.experiment]).write_report(raw, out), out


def run_sweep(args: argparse.Namespace) -> tuple[str, Path]:
    """cliff and fill-model: one sweep of fresh servers per data point, two analyses."""
    from metronome.experiments.presets import PRESETS
    from metronome.experiments.report import load_raw, merge_raws, write_report

    preset = preset_of(PRESETS, args)
    out = out_dir(args, preset.name)
    if args.from_raw:
        try:
            raw = merge_raws([load_raw(path) for path in args.from_raw])
        except ValueError as exc:
            raise SystemExit(f"--from: {exc}") from None
    else:
        from metronome.experiments.sweep import run_sweep as sweep

        raw = sweep(preset, out, sessions=args.sessions, runs=args.runs, duration_s=args.duration_s,
                    first_run=args.first_run, progress=not args.no_progress)
    return write_report(raw, out, focus=args.experiment), out


def run_admission(args: argparse.Namespace) -> tuple[str, Path]:
    from metronome.experiments.admission import ARMS, PRESETS, PROFILES, run_admission as admission
    from metronome.experiments.admission_report import write_report

    preset = preset_of(PRESETS, args)
    if args.from_raw:
        if args.arrival_rate is not None or args.offered is not None:
            raise SystemExit("--arrival-rate and --offered shape a new run; --from re-analyses a finished one")
        return write_report(one_raw(args), out_dir(args, preset.name)), out_dir(args, preset.name)
    for arm in args.arms or ():
        if arm not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")
    for profile in args.profiles:
        if profile not in PROFILES:
            raise SystemExit(f"unknown profile {profile!r}; one of {', '.join(PROFILES)}")
    if args.arrival_rate is not None:
        if not args.arrival_rate > 0:
            raise SystemExit(f"--arrival-rate must be > 0, got {args.arrival_rate}")
        preset = replace(preset, arrival_rate=args.arrival_rate)
    out = out_dir(args, preset.name)
    raw = admission(preset, out, arms=args.arms, profiles=args.profiles, duration_s=args.duration_s,
                    offered=args.offered, progress=not args.no_progress)
    return write_report(raw, out), out


def run(args: argparse.Namespace) -> int:
    if (args.device or args.dtype) and args.experiment != "quality":
        raise SystemExit("--device and --dtype apply to quality only (the serving experiments run their preset's "
                         "device: pick the preset)")
    if args.experiment == "admission":
        summary, out = run_admission(args)
    elif args.experiment in OWN_MODULE:
        summary, out = run_own_module(args)
    else:
        summary, out = run_sweep(args)
    print(summary)
    print(f"\nresults in {out}/")
    return 0
