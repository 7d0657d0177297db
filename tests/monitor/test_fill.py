"""The fill model ρ(t) = ρ0 + N·r·t on synthetic, deterministic KV traces."""

import numpy as np
import pytest

from metronome.monitor.fill import fit_fill, live_time_to_wall, plateau, time_to_wall


def unbounded_trace(n=96, r=0.0000694, rho0=0.03, t_end=200.0, ramp_s=12.0, noise=0.004, seed=0):
    """An arrival ramp, then a linear fill, then the pool saturates at 1 (what the paper's runs look like)."""
    t = np.arange(0.0, t_end, 1.0)
    arrived = np.minimum(1.0, t / ramp_s)
    rho = rho0 * arrived + n * r * np.maximum(0.0, t - ramp_s / 2) * arrived
    rho += np.random.default_rng(seed).normal(0, noise, t.size)
    return t, np.clip(rho, 0.0, 1.0)


def test_the_fit_recovers_rate_and_predicts_the_stall():
    n, r = 96, 0.0000694                       # 96 sessions, ~0.007 %/s each: ρ = 1 at ~150 s
    t, rho = unbounded_trace(n, r)
    fit = fit_fill(t, rho, sessions=n)
    assert fit["r_per_session"] == pytest.approx(r, rel=0.03)
    true_stall = (1.0 - 0.03) / (n * r) + 6.0  # ramp shifts the line by ramp/2
    assert fit["t_wall_s"] == pytest.approx(true_stall, abs=3.0)
    assert fit["samples"] == int(((rho > 0.1) & (rho < 0.8)).sum())


def test_samples_outside_the_band_do_not_bend_the_fit():
    t = np.arange(60.0)
    rho = np.clip(0.05 + 0.02 * t, 0, 1)
    rho[t > 47] = 0.97                          # saturated / preempting: excluded by ρ < 0.8
    fit = fit_fill(t, rho, sessions=10)
    assert fit["slope"] == pytest.approx(0.02) and fit["rho0"] == pytest.approx(0.05)
    assert fit["t_wall_s"] == pytest.approx(47.5)


def test_after_the_stall_the_preemption_saw_tooth_is_not_fitted():
    # The pool fills, then preempted sessions free blocks and ρ falls back into (0.1, 0.8) for a while.
    t = np.arange(60.0)
    rho = np.clip(0.02 + 0.05 * t, 0, 1)
    rho[t >= 20] = np.where(t[t >= 20] % 6 < 3, 0.75, 0.98)
    fit = fit_fill(t, rho, sessions=8)
    assert fit["slope"] == pytest.approx(0.05) and fit["t_wall_s"] == pytest.approx(19.6)
    assert fit["samples"] == int(((rho[:16] > 0.1) & (rho[:16] < 0.8)).sum())


def test_too_few_samples_or_no_growth_gives_no_fit():
    assert fit_fill([0, 1, 2], [0.05, 0.5, 0.9], sessions=4) is None
    assert fit_fill(np.arange(10.0), np.full(10, 0.3), sessions=4) is None


def test_a_plateau_is_judged_against_its_noise():
    rng = np.random.default_rng(1)
    t = np.arange(40.0)
    for seed in range(20):                          # a bounded pool at its plateau, sampled with noise
        rho = 0.4 + np.random.default_rng(seed).normal(0, 0.01, t.size)
        assert fit_fill(t, rho, sessions=8) is None
        assert live_time_to_wall(t, rho) == float("inf")
    rho = 0.2 + 0.01 * t + rng.normal(0, 0.01, t.size)   # the same noise on a real fill is still a fill
    fit = fit_fill(t, rho, sessions=8)
    assert fit is not None and fit["slope"] == pytest.approx(0.01, rel=0.2)


def test_plateau_per_session_and_the_ceiling_it_implies():
    t = np.arange(60.0)
    used = np.minimum(t * 12, 96.0)              # 16 sessions settle at 6 blocks each
    pl = plateau(t, used, total=400, sessions=16)
    assert pl["blocks_per_session"] == 6.0
    assert pl["pool_fraction_per_session"] == pytest.approx(0.015)
    assert pl["ceiling_sessions"] == pytest.approx(400 / 6)


def test_time_to_wall_gauge():
    assert time_to_wall(0.8, 0.01) == pytest.approx(20.0)
    assert time_to_wall(1.2, 0.01) == 0.0
    assert time_to_wall(0.5, 0.0) == float("inf")


def test_live_time_to_wall_tracks_an_unbounded_fill_and_ignores_a_plateau():
    t, rho = unbounded_trace(noise=0.0)
    window = slice(40, 80)  # mid-fill: the estimate from the last samples points at the real stall
    stall = float(t[np.argmax(rho >= 1.0)])
    eta = live_time_to_wall(t[window], rho[window])
    assert abs((t[window][-1] + eta) - stall) < 0.05 * stall
    assert live_time_to_wall(np.arange(50.0), np.full(50, 0.4)) == float("inf")
    assert live_time_to_wall([0.0, 1.0], [0.1, 0.2]) == float("inf")  # too few samples to say
