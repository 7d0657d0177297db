"""``metronome bench <experiment> --preset cpu|gpu|gpu-short``: the experiments of issue 6.

cliff, fill-model (1, 2), admission (3), recycling (4: application-level recycling vs the in-engine
window), ablation (5: W and S), quality (6: perplexity and the spoken-question probe with SmolLM2).

The harness lives in the repository's ``bench/experiments/`` folder, which is not part of the
installed package (the package never imports it), so this command works from a **source checkout**:
it looks for ``bench/experiments`` in ``$METRONOME_REPO`` if set, then beside the ``metronome`` package
(an editable install, or running from the checkout), then in the current directory, and runs it from there.
Equivalent without the CLI: ``python -m bench.experiments cliff --preset cpu`` at the repository root.

    metronome bench cliff --preset cpu            # ~9 min on 2 CPU cores; results/experiments/cliff-cpu-<stamp>/
    metronome bench fill-model --preset cpu
    metronome bench admission --preset cpu        # ~5 min; AIMD admission ramp (experiment 3)
    metronome bench admission --preset cpu --profiles ramp,step,spike --arms robust-sink_window,paper-sink_window
    metronome bench recycling --preset cpu        # ~3 min; latency vs session age, recycled contexts vs SinkWindow
    metronome bench ablation --preset cpu         # ~5 min; tick latency and KV memory over a W × S grid
    metronome bench quality --preset cpu          # ~6 min; SmolLM2 perplexity per policy + spoken-question probe
    metronome bench quality --preset cpu --parts perplexity --text-tokens 1024
    metronome bench cliff --from results/experiments/<run>/raw.json   # re-analyse without running
    metronome bench cliff --preset gpu-short      # on an H200 (bench/gpu_experiments.sh runs it on the device machine)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXPERIMENTS = ("cliff", "fill-model", "admission", "recycling", "ablation", "quality")


def find_repo() -> Path | None:
    """The checkout whose ``bench/experiments`` to run, or None."""
    candidates = [Path(__file__).resolve().parents[2]]
    if os.environ.get("METRONOME_REPO"):
        candidates.insert(0, Path(os.environ["METRONOME_REPO"]))
    candidates.append(Path.cwd())
    for root in candidates:
        if (root / "bench" / "experiments" / "__main__.py").is_file():
            return root.resolve()
    return None


def _harness(repo: Path):
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from bench.experiments import __main__ as harness

    return harness


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run an experiment (cliff, fill-model, admission, recycling, ablation, quality) "
                                     "from a source checkout",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    repo = find_repo()
    if repo is not None:
        _harness(repo).add_arguments(p)
        _add_admission(p)
    else:  # keep `metronome --help` working in an installed package; running explains what is missing
        p.add_argument("experiment", choices=EXPERIMENTS)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    repo = find_repo()
    if repo is None:
        print("metronome bench needs a source checkout (the bench/experiments folder is not installed with the "
              "package): run it inside the repository, or set METRONOME_REPO=/path/to/checkout", file=sys.stderr)
        return 2
    harness = _harness(repo)
    if args.experiment == "admission" and "admission" not in getattr(harness, "EXPERIMENTS", ()):
        from bench.experiments import admission    # an older harness without the dispatch

        return admission.run(args)
    return harness.run(args)


def _add_admission(p: argparse.ArgumentParser) -> None:
    """Let the harness's parser take ``admission`` too, with its extra options (--arms, --profiles, --offered)."""
    try:
        from bench.experiments import admission
    except ImportError:  # an older checkout without the admission experiment
        return
    for action in p._actions:
        if action.dest == "experiment" and action.choices is not None and "admission" not in action.choices:
            action.choices = tuple(action.choices) + ("admission",)
    known = {opt for action in p._actions for opt in action.option_strings}
    if "--arms" not in known:
        admission.add_arguments(p)
