"""`metronome bench` parses like the harness and re-analyses a raw sweep into summary, JSON and plots."""

import argparse
import gzip
import json

from metronome.cli import bench


def parser():
    p = argparse.ArgumentParser(prog="metronome")
    bench.add_parser(p.add_subparsers(dest="command", required=True))
    return p


def synthetic_raw(run: int = 0):
    from metronome.experiments.presets import CPU

    def point(arm, fill_rate):
        sessions, kv = [], []
        for s in range(4):
            ticks = []
            for k in range(120):          # 30 s of 250-ms ticks
                t = 0.25 * k + 0.1
                pre = arm == "unbounded" and t > 20 and s >= 1
                ticks.append([t, k + 1, 40.0, True, 4, pre, 0 if pre else 6])
            sessions.append({"index": s, "arrival_s": s / 8, "connected_s": s / 8, "refused": None, "errors": [],
                             "chunks_sent": 1500, "chunks_skipped": 0, "ticks": ticks, "deltas": 100,
                             "delta_chars": 600})
        for k in range(60):
            used = min(240, int(fill_rate * k * 0.5)) if arm == "unbounded" else min(24, 4 * k)
            kv.append({"t_s": 0.5 * k, "used": used, "total": 240, "sessions": 4})
        return {"arm": arm, "run": run, "spec": {"sessions": 4}, "sessions": sessions, "kv": kv}

    return {"preset": CPU.to_dict(), "machine": {"platform": "test", "cpus": 2, "torch": "x"}, "started": "now",
            "finished": "now", "command": "test", "runs_per_point": 1, "duration_s": 30.0, "elapsed_s": 1.0,
            "points": [point("unbounded", 12.0), point("sink_window", 0.0)]}


def test_bench_subcommand_reanalyses_a_raw_sweep(tmp_path, capsys):
    raw_path = tmp_path / "raw.json.gz"
    raw_path.write_bytes(gzip.compress(json.dumps(synthetic_raw()).encode()))
    args = parser().parse_args(["bench", "cliff", "--preset", "cpu", "--from", str(raw_path), "--out",
                                str(tmp_path / "out")])
    assert args.experiment == "cliff" and args.preset == "cpu"
    assert args.run(args) == 0
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| unbounded | 4 | 1/1 | 21%–100% | 0/1 | 1/1 |" in summary   # Wilson 95 % for 1 of 1
    assert "| sink_window | 4 | 0/1 |" in summary
    analysis = json.loads((tmp_path / "out" / "analysis.json").read_text())
    fit = analysis["fills"][0]["fit"]
    assert abs(fit["t_wall_s"] - 20.0) < 0.5            # 6 blocks per 0.5-s sample = 12/s of 240: ρ = 1 at 20 s
    assert analysis["plateaus"][0]["blocks_per_session"] == 6.0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert {"latency_traces.png", "preempted_traces.png", "kv_fill.png"} <= {p.name for p in (tmp_path / "out").iterdir()}


def test_parts_of_one_sweep_join_into_one_report(tmp_path):
    paths = []
    for run in (0, 1, 2):
        path = tmp_path / f"part{run}.json.gz"
        path.write_bytes(gzip.compress(json.dumps(synthetic_raw(run)).encode()))
        paths.append(str(path))
    args = parser().parse_args(["bench", "cliff", "--preset", "cpu", "--from", ",".join(paths), "--out",
                                str(tmp_path / "out")])
    assert args.run(args) == 0
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| unbounded | 4 | 3/3 |" in summary and "| sink_window | 4 | 0/3 |" in summary
    assert "R = 3 runs each" in summary


def test_parts_that_clash_or_differ_are_refused(tmp_path):
    import pytest

    from metronome.experiments.report import merge_raws

    with pytest.raises(ValueError, match="first-run"):
        merge_raws([synthetic_raw(0), synthetic_raw(0)])
    other = synthetic_raw(1)
    other["duration_s"] = 60.0
    with pytest.raises(ValueError, match="different settings"):
        merge_raws([synthetic_raw(0), other])


def test_wilson_interval_against_its_textbook_values():
    from metronome.experiments.report import wilson_interval

    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and abs(hi - 0.2775) < 1e-3       # the "rule of three"-like upper bound at 0/10
    lo, hi = wilson_interval(10, 10)
    assert abs(lo - 0.7225) < 1e-3 and hi == 1.0
    lo, hi = wilson_interval(5, 10)
    assert abs(lo - 0.2366) < 1e-3 and abs(hi - 0.7634) < 1e-3
