"""The decode-timeline summary's arithmetic, on timelines built by hand (the probe itself needs a GPU:
tests/attention/test_triton_paged.py)."""

import doctest

import numpy as np
import pytest

from bench import decode_timeline_gpu
from bench.decode_timeline_gpu import fixed_cost, summarise_launch, summarise_replay, timer_step_ns


def _launch(t0_ns, sms, programs_per_sm, duration_ns, *, late_extra=0, clock_ghz=1.98, tiles=17):
    """Programs that fill ``programs_per_sm`` slots on each SM at ``t0``, then ``late_extra`` more that start
    on SM 0 when its first program ends (a second wave)."""
    rows = []
    for sm in range(sms):
        for _ in range(programs_per_sm):
            rows.append([sm, t0_ns, t0_ns + duration_ns, 1000, 1000 + int(duration_ns * clock_ghz), tiles])
    for _ in range(late_extra):
        start = t0_ns + duration_ns
        rows.append([0, start, start + duration_ns, 0, int(duration_ns * clock_ghz), tiles])
    return np.array(rows, dtype=np.int64)


def test_doctests():
    assert doctest.testmod(decode_timeline_gpu).failed == 0


def test_one_full_wave_runs_full_from_start_to_end():
    s = summarise_launch(_launch(1_000_000, 132, 2, 40_000))
    assert s["programs"] == 264 and s["sms_used"] == 132 and s["programs_per_sm"] == {"2": 132}
    assert s["span_us"] == 40.0 and s["below_full_us"] == 0.0 and s["late_programs"] == 0
    assert s["peak_resident"] == 264
    assert s["program_us"] == {10: 40.0, 50: 40.0, 90: 40.0}
    assert s["clock_ghz"] == pytest.approx(1.98)


def test_a_second_wave_shows_as_late_programs_and_time_below_full():
    s = summarise_launch(_launch(0, 132, 3, 20_000, late_extra=4))
    assert s["late_programs"] == 4
    assert s["span_us"] == 40.0
    assert s["below_full_us"] == pytest.approx(20.0)        # the second wave runs 4 of 396 slots
    assert s["programs_per_sm"] == {"3": 131, "7": 1}
    assert s["start_offsets_us"][100] == 20.0


def test_a_staggered_ramp_down_counts_only_the_time_under_90_percent():
    rows = _launch(0, 10, 1, 10_000)
    rows[:, 2] = np.arange(10) * 1_000 + 10_000     # program i ends at 10 + i µs
    s = summarise_launch(rows)
    # 10 resident until 10 µs, then 9 (= 90 %: still full) until 11 µs, below from there to 19 µs
    assert s["span_us"] == 19.0
    assert s["below_full_us"] == pytest.approx(8.0)


def test_replay_reports_the_gap_between_launches_and_the_timer_step():
    launches = [_launch(t, 4, 2, 10_000) for t in (0, 12_000, 25_000)]
    r = summarise_replay(launches)
    assert r["launches"] == 3 and r["gap_us"] == pytest.approx(2.5)      # gaps of 2 and 3 µs
    assert r["span_us"] == 10.0 and r["middle"]["first_start_ns"] == 12_000
    assert timer_step_ns([np.array([[0, 32, 64, 0, 1, 1], [0, 32, 96, 0, 1, 1]])]) == 32
    assert timer_step_ns([np.array([[0, 5, 5, 0, 1, 1]])]) is None


def test_fixed_cost_is_the_intercept_of_program_time_against_tiles():
    points = [(3.0, 4.1), (7.0, 8.1), (11.0, 12.1), (17.0, 18.1)]
    assert fixed_cost(points) == {"fixed_us": pytest.approx(1.1), "per_tile_us": pytest.approx(1.0)}
