"""The fill model ρ(t) = ρ0 + N·r·t and time-to-wall (pure functions; numpy only).

For the Unbounded arm every session adds ``r`` of the pool per second, so the pool fraction in use
grows linearly and the stall (ρ = 1, the pool is dry) is predictable long before it happens. The
fit uses only samples with ``0.1 < ρ < 0.8`` (past the arrival ramp, before any preemption).

>>> t = [float(i) for i in range(40)]
>>> rho = [min(1.0, 0.02 + 8 * 0.004 * x) for x in t]     # N = 8 sessions, r = 0.4 % of the pool per s
>>> fit = fit_fill(t, rho, sessions=8)
>>> round(fit["rho0"], 4), round(fit["r_per_session"], 5), round(fit["t_wall_s"], 1)
(0.02, 0.004, 30.6)

For a bounded arm ρ levels off: each session holds at most S + W (+ one chunk) tokens of blocks.

>>> plateau([float(i) for i in range(30)], [min(80, 10 * i) for i in range(30)], total=400, sessions=16)["blocks_per_session"]
5.0
"""

from __future__ import annotations

import numpy as np

# Changes of the pool fraction smaller than this are arithmetic, not blocks: no pool has 1e9 blocks.
RHO_RESOLUTION = 1e-9


def fit_fill(t, rho, sessions: int, lo: float = 0.1, hi: float = 0.8) -> dict | None:
    """Least-squares line through the samples with lo < ρ < hi of the *growth phase*; None with fewer than 3
    of them or when they do not rise above their own noise (``rising_line``).

    Only samples before ρ first reaches ``hi`` count: after the stall the Unbounded baseline preempts
    sessions and frees their blocks, so ρ falls back into the band on a saw-tooth that is not the fill.

    Returns ρ0, the slope N·r, r per session (fraction of the pool per second), the predicted
    time-to-wall ``(1 - ρ0) / (N·r)`` and the number of samples used.
    """
    t, rho = np.asarray(t, float), np.asarray(rho, float)
    order = np.argsort(t, kind="stable")
    t, rho = t[order], rho[order]
    growth = np.cumsum(rho >= hi) == 0          # before the first sample at or above hi
    sel = (rho > lo) & (rho < hi) & growth
    if sel.sum() < 3:
        return None
    line = rising_line(t[sel], rho[sel])
    if line is None:
        return None
    slope, rho0, rms = line
    return {"rho0": rho0, "slope": slope, "r_per_session": slope / sessions,
            "t_wall_s": (1.0 - rho0) / slope, "samples": int(sel.sum()), "rms_residual": rms}


def rising_line(t, rho, t_stat: float = 3.0) -> tuple[float, float, float] | None:
    """Least-squares ``(slope, intercept, rms residual)`` of ρ over t, or None when ρ does not rise.

    Rising means the slope stands ``t_stat`` standard errors above zero and lifts ρ by more than
    ``RHO_RESOLUTION`` over the samples' span: a flat series fits a slope of rounding noise (1e-17), and a
    noisy plateau fits small slopes of either sign; neither is a fill.

    >>> rising_line([0, 1, 2, 3], [0.3] * 4) is None
    True
    >>> [round(x, 3) for x in rising_line([0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4])]
    [0.1, 0.1, 0.0]
    """
    t, rho = np.asarray(t, float), np.asarray(rho, float)
    n, span = len(t), float(np.ptp(t)) if len(t) else 0.0
    if n < 3 or span <= 0:
        return None
    slope, intercept = np.polyfit(t, rho, 1)
    resid = rho - (intercept + slope * t)
    stderr = np.sqrt(np.sum(resid ** 2) / (n - 2) / np.sum((t - t.mean()) ** 2))
    if slope * span <= RHO_RESOLUTION or slope <= t_stat * stderr:
        return None
    return float(slope), float(intercept), float(np.sqrt(np.mean(resid ** 2)))


def time_to_wall(rho_now: float, slope: float) -> float:
    """Seconds until ρ reaches 1 at the fitted slope (what a live gauge would show).

    >>> time_to_wall(0.5, 0.05)
    10.0
    """
    return max(0.0, (1.0 - rho_now) / slope) if slope > 0 else float("inf")


def plateau(t, used, total: int, sessions: int, tail: float = 1 / 3) -> dict:
    """Steady-state KV of a bounded arm: median blocks in use over the last ``tail`` of the samples.

    ``ceiling_sessions`` is how many sessions the pool would hold at that per-session footprint
    (the memory ceiling the plateau implies); the reservation (worst case) is reported beside it.
    """
    used = np.asarray(used, float)
    k = max(1, int(round(len(used) * tail)))
    steady = float(np.median(used[-k:]))
    per_session = steady / sessions
    frac = per_session / total
    return {"steady_blocks": steady, "blocks_per_session": per_session, "pool_fraction_per_session": frac,
            "ceiling_sessions": float(1.0 / frac) if frac > 0 else float("inf")}


def live_time_to_wall(t, rho, min_samples: int = 5) -> float:
    """Seconds until the pool runs dry if it keeps filling as it did over the samples given (a recent
    window); ``inf`` when it is not filling (a bounded pool at its plateau, or too few samples).

    >>> round(live_time_to_wall([0, 1, 2, 3, 4, 5], [0.10, 0.12, 0.14, 0.16, 0.18, 0.20]), 1)
    40.0
    >>> live_time_to_wall([0, 1, 2, 3, 4, 5], [0.3] * 6)
    inf
    """
    t, rho = np.asarray(t, float), np.asarray(rho, float)
    if len(t) < min_samples:
        return float("inf")
    line = rising_line(t - t[0], rho)
    return time_to_wall(float(rho[-1]), line[0]) if line is not None else float("inf")
