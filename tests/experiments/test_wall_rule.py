"""The cliff experiment's wall rule on synthetic, deterministic traces."""

import numpy as np
import pytest

from metronome.experiments.cliff import analyse_run, bucket_stat, first_time, wall_onset, walled

BUCKET, THRESHOLD = 10.0, 500.0   # the paper's rule at B = 2 s


def trace(levels, per_bucket=20, bucket=BUCKET):
    """Frames spread evenly through consecutive buckets, bucket i at latency levels[i]."""
    t = np.concatenate([i * bucket + (np.arange(per_bucket) + 0.5) * bucket / per_bucket for i in range(len(levels))])
    return t, np.repeat(np.asarray(levels, float), per_bucket)


def test_flat_latency_under_the_threshold_never_walls():
    t, lat = trace([20.0] * 30)
    assert not walled(t, lat, BUCKET, THRESHOLD, t_end=300.0)
    assert wall_onset(t, lat, BUCKET, THRESHOLD, t_end=300.0) is None


def test_a_late_cliff_walls_with_its_onset_at_the_first_slow_bucket():
    t, lat = trace([15.0] * 14 + [1600.0] * 16)
    assert walled(t, lat, BUCKET, THRESHOLD, t_end=300.0)
    assert wall_onset(t, lat, BUCKET, THRESHOLD, t_end=300.0) == 140.0


def test_the_rule_is_the_median_of_the_last_three_bucket_medians():
    # Two of the last three buckets slow: walled. Only one: not walled (a single bad bucket is noise).
    t, lat = trace([10.0] * 7 + [900.0, 10.0, 900.0])
    assert walled(t, lat, BUCKET, THRESHOLD, t_end=100.0)
    t, lat = trace([10.0] * 7 + [10.0, 900.0, 10.0])
    assert not walled(t, lat, BUCKET, THRESHOLD, t_end=100.0)


def test_a_bucket_median_ignores_a_minority_of_huge_frames():
    t, lat = trace([10.0] * 10)
    lat[::3] = 5000.0          # a third of the frames spike: every bucket median stays at 10 ms
    assert not walled(t, lat, BUCKET, THRESHOLD, t_end=100.0)


def test_an_early_transient_is_not_an_onset():
    t, lat = trace([10.0, 10.0, 900.0, 10.0, 10.0, 10.0, 900.0, 900.0, 900.0, 900.0])
    assert wall_onset(t, lat, BUCKET, THRESHOLD, t_end=100.0) == 60.0


def test_partial_last_bucket_is_dropped_and_empty_buckets_are_nan():
    t = np.array([1.0, 2.0, 25.0, 31.0])
    starts, med = bucket_stat(t, np.ones(4), 10.0, t_end=35.0)
    assert list(starts) == [0.0, 10.0, 20.0]
    assert med[0] == 1.0 and np.isnan(med[1]) and med[2] == 1.0


def test_too_short_a_run_cannot_wall():
    t, lat = trace([900.0, 900.0])
    assert not walled(t, lat, BUCKET, THRESHOLD, t_end=20.0)


def test_quiet_wall_and_first_preemption_from_tick_rows():
    # 4 sessions, 1 frame/s for 60 s; from t = 30 s three of them come back preempted (empty) every frame.
    sessions = []
    for s in range(4):
        ticks = []
        for k in range(60):
            pre = s > 0 and k >= 30
            ticks.append([k + 0.5, k + 1, 40.0, True, 4, pre, 0 if pre else 5])
        sessions.append({"ticks": ticks, "refused": None, "chunks_skipped": 0, "chunks_sent": 3000})
    point = {"arm": "unbounded", "run": 0, "spec": {"sessions": 4}, "sessions": sessions}
    a = analyse_run(point, bucket_s=10.0, wall_ms=500.0, quiet_fraction=0.5, t_end=60.0)
    assert not a["latency_wall"] and a["quiet_wall"] and a["walled"]
    assert a["quiet_wall_onset_s"] == 30.0 and a["first_preempted_s"] == 30.5
    assert a["preempted_fraction"] == pytest.approx(90 / 240) and a["empty_frames"] == 90
    assert first_time([1.0, 2.0], [False, False]) is None
