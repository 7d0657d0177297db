"""`metronome bench` parses like the harness and re-analyses a raw sweep into summary, JSON and plots."""

import argparse
import gzip
import json

from metronome.cli import bench


def parser():
    p = argparse.ArgumentParser(prog="metronome")
    bench.add_parser(p.add_subparsers(dest="command", required=True))
    return p


def synthetic_raw():
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
        return {"arm": arm, "run": 0, "spec": {"sessions": 4}, "sessions": sessions, "kv": kv}

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
    assert "| unbounded | 4 | 1/1 | 0/1 | 1/1 |" in summary
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
