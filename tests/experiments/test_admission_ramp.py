"""The admission ramp: the analysis on a synthetic trace, and a short real run through the gateway."""

import asyncio
import json
from dataclasses import replace

import pytest

from metronome.experiments import admission
from metronome.experiments.admission import (CPU, analyse, analyse_point, arrival_times, convergence, parse_metrics,
                                         run_point, server_spec)
from metronome.experiments.admission_report import write_report
from metronome.experiments.server import start


def _synthetic_point(arm="robust-sink_window", preempt_after=None):
    """40 s: the cap ramps 4 -> 20 by t = 8 s and then holds around 20; 60 sessions offered, 22 admitted."""
    scrape = []
    for k in range(81):
        t = k * 0.5
        cap = min(20, 4 + 2 * int(t)) if t < 12 else (21 if k % 7 == 0 else 20)
        scrape.append({"t_s": t, "cap": cap, "live": min(cap, 22), "memory_capacity": 128, "admitted": 22.0,
                       "rejected": 38.0, "deadline_misses": 0.0, "ticks": 4 * t})
    sessions = []
    for i in range(60):
        if i < 22:
            ticks = []
            for j in range(160):
                t = j * 0.25
                lat = 300.0 if t < 10 and j % 10 == 0 else 50.0 + (j % 5)     # slow transients before convergence
                pre = preempt_after is not None and t >= preempt_after
                ticks.append([t, j, lat, lat <= 250.0, 20, pre, 0 if pre else 3])
            sessions.append({"index": i, "arrival_s": i / 4, "connected_s": i / 4, "refused": None, "errors": [],
                             "ticks": ticks})
        else:
            sessions.append({"index": i, "arrival_s": i / 4, "connected_s": None, "refused": "server_overloaded",
                             "errors": [], "ticks": []})
    kv = [{"t_s": t, "used": int(min(1.0, 0.03 * t) * 1024), "total": 1024, "sessions": 22} for t in range(40)]
    controller, policy = arm.split("-")
    return {"arm": arm, "controller": "aimd" if controller == "robust" else controller, "policy": policy,
            "profile": "ramp", "offered": 60, "sessions": sessions, "kv": kv, "scrape": scrape,
            "arrivals": [i / 4 for i in range(60)]}


def test_convergence_finds_n_star_and_when_the_cap_settled():
    t = [0.5 * k for k in range(81)]
    cap = [min(20, 4 + 2 * int(x)) if x < 12 else 20 for x in t]
    c = convergence(t, cap, tail_fraction=0.25, t_end=40.0)
    assert c["n_star"] == 20.0 and c["band"] == 3.0
    assert c["converged_s"] == 7.0            # cap 18 at t = 7: within 3 of 20 from then on
    assert convergence([], [], 0.25)["n_star"] is None


def test_analysis_of_a_synthetic_trace():
    a = analyse_point(_synthetic_point(), budget_ms=250.0, target_fraction=0.3, tail_fraction=0.25, t_end=40.0)
    assert (a["offered"], a["admitted"], a["rejected"], a["other_failures"]) == (60, 22, 38, 0)
    assert a["n_star"] == 20.0 and a["converged_s"] == 7.0 and a["cap_max"] == 21
    # Steady latency excludes the slow transients before convergence (t < 7 s) but not those after it.
    assert 50.0 <= a["p50_ms"] <= 54.0
    # From t = 7 s each session has 132 frames, one of them the slow one at 7.5 s (a miss: 300 ms > B).
    assert a["steady_frames"] == 22 * 132 and a["steady_from_s"] == 7.0
    assert a["deadline_miss_fraction"] == pytest.approx(1 / 132) and a["p99_ms"] == 54.0
    assert a["preempted_fraction"] == 0.0 and a["empty_fraction"] == 0.0
    assert a["target_ms"] == 75.0 and a["memory_capacity"] == 128


def test_live_over_the_tail_is_reported_when_a_decrease_cannot_shed_sessions():
    point = _synthetic_point()
    for row in point["scrape"]:
        if row["t_s"] >= 30.0:   # a decrease to 18 at 30 s; the 20 sessions that hold stay connected
            row["cap"], row["live"] = 18, 20
    a = analyse_point(point, 250.0, 0.3, 0.25, 40.0)
    assert a["n_star"] == 18.0 and a["live_tail"] == 20.0


def test_tick_breakdown_counts_each_worker_tick_once_from_the_steady_state():
    point = _synthetic_point()
    for s in point["sessions"]:   # this worker's ticks: 600 ms, of which the worker 560 (engine 500, front end 50)
        s["ticks"] = [row + [500.0, 50.0, 560.0 if row[0] >= 7.0 else 100.0] for row in s["ticks"]]
    b = analyse_point(point, 250.0, 0.3, 0.25, 40.0)["tick_breakdown"]
    assert b["ticks"] == 132      # ticks 28..159 (t >= 7 s), not 22 sessions x 132 rows
    assert (b["worker_ms"], b["engine_ms"], b["frontend_ms"]) == (560.0, 500.0, 50.0)
    assert b["outside_worker_ms"] == b["latency_ms"] - 560.0
    old = analyse_point(_synthetic_point(), 250.0, 0.3, 0.25, 40.0)["tick_breakdown"]
    assert old["worker_ms"] is None and old["outside_worker_ms"] is None and old["latency_ms"] is not None


def test_unbounded_arm_shows_the_pool_running_dry_as_preempted_empty_frames():
    a = analyse_point(_synthetic_point("robust-unbounded", preempt_after=30.0), 250.0, 0.3, 0.25, 40.0)
    assert a["first_preempted_s"] == 30.0
    assert 0.25 < a["preempted_fraction"] < 0.35 and a["preempted_fraction"] == a["empty_fraction"]
    assert a["kv_max_fill"] == 1.0


def test_report_writes_analysis_summary_and_plots(tmp_path):
    raw = {"preset": CPU.to_dict(), "duration_s": 40.0, "machine": {}, "points": [
        _synthetic_point(), _synthetic_point("robust-unbounded", 30.0), _synthetic_point("paper-sink_window")]}
    summary = write_report(raw, tmp_path)
    assert "| ramp | robust-unbounded | 22 / 60 | 38 | 20 |" in summary
    assert json.loads((tmp_path / "analysis.json").read_text()) == json.loads(json.dumps(analyse(raw)))
    assert (tmp_path / "summary.md").is_file()
    assert {p.name for p in tmp_path.glob("*.png")} <= {"cap_live.png", "latency.png"}


def test_arrival_profiles_and_metrics_parsing():
    assert arrival_times("ramp", 3, 4.0) == [0.0, 0.25, 0.5]
    assert arrival_times("ramp", 10, 1.0, duration_s=4.0) == [0.0, 1.0, 2.0, 3.0]      # none after the end
    step = arrival_times("step", 200, 4.0, duration_s=60.0)           # 1/s for 20 s, then 8/s
    assert step[:20] == [float(i) for i in range(20)] and step[20] == 20.0 and step[21] == 20.125
    assert len(step) == 200 and step[-1] < 60.0
    spike = arrival_times("spike", 200, 4.0, duration_s=60.0)         # 1/s, plus 50 at once at 20 s
    assert spike.count(20.0) == 51 and len(spike) == 50 + 60 and spike == sorted(spike)
    text = ('# HELP x\nmetronome_sessions_admitted_total{worker="a"} 5.0\n'
            'metronome_sessions_rejected_total{reason="server_overloaded"} 7.0\n'
            'metronome_sessions_rejected_total{reason="unauthorized"} 2.0\n'
            'metronome_deadline_misses_total{worker="a"} 1.0\nmetronome_ticks_total{worker="a"} 40.0\n'
            'metronome_sessions_admitted_created{worker="a"} 1.7e9\n')
    assert parse_metrics(text) == {"admitted": 5.0, "rejected": 7.0, "deadline_misses": 1.0, "ticks": 40.0}


async def test_short_real_ramp_refuses_what_the_cap_does_not_allow(chat_checkpoint):
    """~6 s through a real gateway + worker: 20 sessions offered at 10/s against a cap starting at 2."""
    preset = replace(CPU, model=chat_checkpoint, offered=20, arrival_rate=10.0, duration_s=5.0, initial_cap=2,
                     num_blocks=256, scrape_s=0.25)
    spec = server_spec(preset, chat_checkpoint, "robust-sink_window")
    assert spec["admission"] == {"controller": "aimd", "initial_cap": 2, "min_cap": 1, "target_fraction": 0.3}
    worker, server, gateway = await start(spec)
    try:
        point = await asyncio.wait_for(run_point(gateway, worker.address, preset), timeout=20)
    finally:
        await server.stop()
        await worker.stop(0)
    point.update(arm="robust-sink_window", controller="aimd", policy="sink_window")
    a = analyse_point(point, preset.budget_ms, preset.target_fraction, preset.tail_fraction, preset.duration_s)
    assert a["offered"] == 20 and a["admitted"] + a["rejected"] + a["other_failures"] == 20
    assert a["other_failures"] == 0
    assert a["rejected"] > 0 and a["admitted"] >= 2            # the cap grows by at most ~1 a tick: 10/s is too fast
    assert len(point["scrape"]) >= 12 and point["scrape"][0]["cap"] >= 2
    assert point["scrape"][-1]["rejected"] == a["rejected"]    # the gateway's counter agrees with the clients
    assert a["memory_capacity"] > a["cap_max"]                 # the cap was set by the controller, not memory
    assert a["p50_ms"] is not None and a["steady_frames"] > 0


async def test_churned_sessions_leave_and_free_their_place(chat_checkpoint):
    """The churn profile through a real gateway + worker: clients close after their session length, the
    gateway's live count falls with them, and a later arrival takes a freed place."""
    preset = replace(CPU, model=chat_checkpoint, offered=12, arrival_rate=4.0, duration_s=6.0, initial_cap=4,
                     num_blocks=256, scrape_s=0.25, hold_s=1.0)
    spec = server_spec(preset, chat_checkpoint, "robust-sink_window")
    spec["admission"].update(min_cap=4, target_fraction=1.0)   # a fixed cap of 4: admission by places alone
    worker, server, gateway = await start(spec)
    try:
        point = await asyncio.wait_for(run_point(gateway, worker.address, preset, profile="churn", seed=3), timeout=20)
    finally:
        await server.stop()
        await worker.stop(0)
    admitted = [s for s in point["sessions"] if s["refused"] is None]
    left = [s for s in admitted if s["left_s"] is not None]
    assert left and all(s["left_s"] >= s["connected_s"] + s["hold_s"] - 0.05 for s in left)
    assert all(t[0] <= s["left_s"] + 0.5 for s in left for t in s["ticks"])   # no frames after leaving
    lives = [x["live"] for x in point["scrape"]]
    assert max(lives) <= 4 and any(b < a for a, b in zip(lives, lives[1:]))  # live fell when calls ended
    assert len(admitted) > 4                                   # freed places went to later arrivals


def test_metronome_bench_admission_reanalyses_a_raw_run(tmp_path, capsys):
    import argparse
    import gzip

    from metronome.cli import bench

    p = argparse.ArgumentParser(prog="metronome")
    bench.add_parser(p.add_subparsers(dest="command", required=True))
    raw = {"preset": CPU.to_dict(), "duration_s": 40.0, "machine": {}, "points": [_synthetic_point()]}
    raw_path = tmp_path / "raw.json.gz"
    raw_path.write_bytes(gzip.compress(json.dumps(raw).encode()))
    args = p.parse_args(["bench", "admission", "--preset", "cpu", "--from", str(raw_path), "--out",
                         str(tmp_path / "out"), "--profiles", "ramp,spike"])
    assert args.experiment == "admission" and args.profiles == ("ramp", "spike")
    assert args.run(args) == 0
    assert "| ramp | robust-sink_window | 22 / 60 | 38 | 20 |" in (tmp_path / "out" / "summary.md").read_text()
    # the other experiments still parse as before
    assert p.parse_args(["bench", "cliff", "--preset", "cpu"]).experiment == "cliff"


def metronome_bench(argv: list[str]) -> int:
    from metronome.cli.main import main

    return main(["bench", *argv])


@pytest.mark.parametrize("rate", ["0", "-2"])
def test_a_non_positive_arrival_rate_is_refused_before_anything_runs(tmp_path, rate):
    with pytest.raises(SystemExit, match="--arrival-rate must be > 0"):
        metronome_bench(["admission", "--preset", "cpu", "--arrival-rate", rate, "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_run_shaping_options_are_refused_when_re_analysing(tmp_path):
    with pytest.raises(SystemExit, match="--from re-analyses a finished one"):
        metronome_bench(["admission", "--preset", "cpu", "--from", str(tmp_path / "raw.json"), "--arrival-rate", "2"])


def test_the_paper_arm_starts_uncapped_as_its_prototype_and_ours_at_the_preset_cap():
    paper = server_spec(CPU, "m", "paper-sink_window")["admission"]
    ours = server_spec(CPU, "m", "robust-sink_window")["admission"]
    assert (paper["controller"], paper["initial_cap"]) == ("paper", None)
    assert (ours["controller"], ours["initial_cap"]) == ("aimd", CPU.initial_cap)
