"""The AIMD admission controller on latency traces: growth, app-limited guard, robust decrease,
deadline misses, bounds, logging, convergence on a simulated worker, and invariants (hypothesis)."""

from __future__ import annotations

import doctest
import logging
import random
import statistics

import pytest
from hypothesis import given, settings, strategies as st

from metronome.config import AimdConfig
from metronome.errors import ConfigError
from metronome.serving import admission
from metronome.serving.admission import AimdController, AimdDecision, PaperAimdController

# Target 600 ms, window 5, backoff 0.9, step 1, headroom 2, initial 4; additive growth only (the slow
# start has its own tests below).
CFG = AimdConfig(load_evidence=False, budget_ms=2000.0, slow_start=1.0)
LOW, HIGH = 100.0, 900.0


def additive(**kwargs) -> AimdConfig:
    return AimdConfig(load_evidence=False, slow_start=1.0, **kwargs)


def feed(c, latencies, live, missed=False):
    return [c.observe(ms, missed, live) for ms in latencies]


def test_module_docstring_examples_hold():
    result = doctest.testmod(admission, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10 and result.failed == 0


def test_steady_low_latency_with_live_at_cap_climbs_one_per_tick_and_stops_at_memory_cap():
    c = AimdController(CFG, memory_cap=20)
    caps = []
    for _ in range(40):
        c.observe(LOW, False, live=c.cap)  # demand always fills the cap
        caps.append(c.cap)
    # window-1 ticks collecting samples, then +1 per tick from the initial 4 up to the memory cap
    assert caps[:4] == [4] * 4
    assert caps[4:20] == list(range(5, 21))
    assert caps[20:] == [20] * 20
    assert c.history[-1].action == "hold" and "at memory cap 20" in c.history[-1].reason


def test_step_is_configurable_and_never_overshoots_the_ceiling():
    c = AimdController(additive(step=3, window=1, initial_cap=4), memory_cap=11)
    caps = [c.observe(LOW, False, live=c.cap).cap for _ in range(5)]
    assert caps == [7, 10, 11, 11, 11]


def test_app_limited_worker_does_not_grow_its_cap():
    c = AimdController(additive(initial_cap=30), memory_cap=1000)
    for d in feed(c, [LOW] * 50, live=10):
        assert d.action == "hold"
    assert c.cap == 30
    assert "app-limited: live 10 < cap 30 - headroom 2" == c.history[-1].reason
    # an idle worker grows at most to live + headroom + step (it grows while live >= cap - headroom)
    idle = AimdController(additive(initial_cap=1, window=1), memory_cap=1000)
    feed(idle, [LOW] * 50, live=0)
    assert idle.cap == 3


def test_single_spike_cuts_the_paper_cap_but_not_the_robust_one():
    trace = [LOW] * 8 + [1500.0] + [LOW] * 3
    cfg = additive(budget_ms=2000.0, initial_cap=41)  # live 40 sits right under the cap
    robust, paper = AimdController(cfg, memory_cap=1000), PaperAimdController(cfg, memory_cap=1000)
    live = 40
    r, p = feed(robust, trace, live), feed(paper, trace, live)
    assert all(d.action != "decrease" for d in r)
    assert r[8].statistic_ms == LOW and r[8].latency_ms == 1500.0
    assert p[8].action == "decrease" and p[8].cap == 36 and p[8].statistic_ms == 1500.0
    assert robust.cap > paper.cap


def test_sustained_overload_decreases_once_to_backoff_of_live_then_waits_for_fresh_samples():
    c = AimdController(additive(initial_cap=50), memory_cap=1000)
    d = feed(c, [HIGH] * 5, live=50)
    assert [x.action for x in d] == ["hold"] * 4 + ["decrease"]
    assert d[-1].cap_before == 50 and d[-1].cap == 45  # floor(0.9 * 50)
    assert d[-1].reason == "p50 of last 5 ticks 900.0 ms > target 600.0 ms; cap = floor(0.9*live 50) = 45"
    # sessions leave slowly; still overloaded: the next decrease waits for `window` fresh samples
    d = [c.observe(HIGH, False, live) for live in (49, 48, 47, 46, 45)]
    assert [x.action for x in d] == ["hold"] * 4 + ["decrease"]
    assert [x.reason.startswith("collecting samples") for x in d[:4]] == [True] * 4
    assert "since the last decrease" in d[0].reason
    assert d[-1].cap == 40  # floor(0.9 * 45): the load now, not 0.9**5 * 50 from per-tick cuts


def test_overload_at_unchanged_load_never_decreases_twice():
    c = AimdController(additive(initial_cap=50), memory_cap=1000)
    d = feed(c, [HIGH] * 30, live=50)
    assert sum(x.action == "decrease" for x in d) == 1 and c.cap == 45
    assert "waiting for sessions to leave" in d[-1].reason  # window refilled, decrease would not lower


def test_decrease_uses_live_when_app_limited_and_never_raises_the_cap():
    c = AimdController(additive(initial_cap=100), memory_cap=1000)
    feed(c, [HIGH] * 5, live=20)
    assert c.cap == 18  # floor(0.9 * live), not 0.9 * cap = 90
    # live above the cap (no evictions): floor(0.9 * 30) = 27 > 18 must not raise the cap
    d = feed(c, [HIGH] * 5, live=30)
    assert all(x.cap <= 18 for x in d) and c.cap == 18


def test_decrease_respects_min_cap():
    c = AimdController(additive(initial_cap=10, min_cap=3, window=1), memory_cap=100)
    assert c.observe(HIGH, False, live=2).cap == 3
    c = AimdController(additive(initial_cap=10, window=1), memory_cap=100)
    assert c.observe(HIGH, False, live=0).cap == 1


def test_deadline_miss_decreases_at_once_then_only_as_live_falls():
    c = AimdController(additive(initial_cap=20), memory_cap=100)
    d = c.observe(2100.0, True, live=20)  # first tick: window far from full, still a decrease
    assert (d.action, d.cap) == ("decrease", 18) and d.reason.startswith("deadline missed (2100.0 ms")
    # a miss counts even when the latency figure itself is under target (e.g. queueing before the Step)
    c2 = AimdController(additive(initial_cap=20), memory_cap=100)
    assert c2.observe(LOW, True, live=20).action == "decrease"
    # repeated misses: no compounding at the same load, follow live down as sessions leave
    d = [c.observe(2100.0, True, live) for live in (20, 20, 19, 15)]
    assert [(x.action, x.cap) for x in d] == [("hold", 18), ("hold", 18), ("decrease", 17), ("decrease", 13)]
    # the miss emptied the window: low latency afterwards still needs `window` samples to grow
    d = feed(c, [LOW] * 5, live=13)
    assert [x.action for x in d] == ["hold"] * 4 + ["increase"]


def test_no_increase_on_a_missed_tick_even_when_the_window_looks_fine():
    c = AimdController(additive(initial_cap=10), memory_cap=100)
    feed(c, [LOW] * 5, live=10)
    assert c.cap == 11
    d = c.observe(LOW, True, live=8)  # floor(0.9*8) = 7 < 11
    assert d.action == "decrease" and d.cap == 7
    d = c.observe(LOW, True, live=20)  # 18 >= 7: a miss never raises the cap
    assert d.action == "hold" and d.cap == 7


def test_initial_cap_is_clamped_by_memory_and_static_caps():
    assert AimdController(additive(initial_cap=50), memory_cap=30).cap == 30
    assert AimdController(additive(initial_cap=50), memory_cap=30, static_cap=20).cap == 20
    assert PaperAimdController(additive(initial_cap=50), memory_cap=30, static_cap=20).cap == 20
    assert AimdController(additive(initial_cap=5), memory_cap=0).cap == 0  # the ceiling beats min_cap


def test_static_cap_is_respected_while_growing():
    for cls in (AimdController, PaperAimdController):
        c = cls(CFG, memory_cap=1000, static_cap=12)
        for _ in range(40):
            c.observe(LOW, False, live=c.cap)
        assert c.cap == 12 and "at static cap 12" in c.history[-1].reason


def test_set_memory_cap_lowering_clamps_and_raising_does_not_jump():
    c = AimdController(additive(initial_cap=50), memory_cap=100)
    c.set_memory_cap(30)
    assert c.cap == 30 and c.memory_cap == 30
    assert not c.admits(30) and c.admits(29)
    c.set_memory_cap(200)
    assert c.cap == 30  # grows back through AIMD, not by jumping to the new capacity
    feed(c, [LOW] * 5, live=30)
    assert c.cap == 31
    c.set_memory_cap(0)
    assert c.cap == 0 and not c.admits(0)
    c.set_memory_cap(10)
    assert c.cap == 1  # back up to min_cap only
    with pytest.raises(ConfigError):
        c.set_memory_cap(-1)


def test_admits():
    c = AimdController(additive(initial_cap=3), memory_cap=100)
    assert [c.admits(n) for n in range(5)] == [True, True, True, False, False]


def test_bad_inputs_are_refused():
    with pytest.raises(ConfigError):
        AimdController(CFG, memory_cap=-1)
    with pytest.raises(ConfigError):
        AimdController(CFG, memory_cap=10, static_cap=-1)
    c = AimdController(CFG, memory_cap=10)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError):
            c.observe(bad, False, 1)
    with pytest.raises(ValueError):
        c.observe(LOW, False, -1)
    assert len(c.history) == 0  # refused observations are not ticks


def test_every_decision_is_recorded_with_a_reason_and_logged(caplog):
    c = AimdController(additive(initial_cap=4, window=1), memory_cap=100, name="w0")
    with caplog.at_level(logging.DEBUG, logger="metronome.serving.admission"):
        d1 = c.observe(LOW, False, live=4)     # increase
        d2 = c.observe(LOW, False, live=0)     # hold (app-limited)
        d3 = c.observe(HIGH, False, live=5)    # decrease
    assert list(c.history) == [d1, d2, d3]
    assert [d.tick for d in c.history] == [1, 2, 3]
    assert [d.action for d in c.history] == ["increase", "hold", "decrease"]
    assert d1 == AimdDecision(tick=1, live=4, latency_ms=LOW, statistic_ms=LOW, cap_before=4, cap=5,
                              action="increase", reason="p50 of last 1 ticks 100.0 ms <= target 600.0 ms")
    assert all(d.reason for d in c.history)
    recs = [r for r in caplog.records if r.name == "metronome.serving.admission"]
    assert [r.levelno for r in recs] == [logging.INFO, logging.DEBUG, logging.INFO]
    for r, d in zip(recs, c.history):
        assert d.reason in r.getMessage() and "w0" in r.getMessage()


def test_history_is_bounded():
    c = AimdController(additive(window=1), memory_cap=10)
    for _ in range(admission.HISTORY_LEN + 5):
        c.observe(LOW, False, live=0)
    assert len(c.history) == admission.HISTORY_LEN and c.history[-1].tick == admission.HISTORY_LEN + 5


# -- convergence on a simulated worker ---------------------------------------------------------------

A_MS, B_MS = 50.0, 5.0                 # latency = a + b * live
N_STAR = (CFG.target_ms - A_MS) / B_MS  # 110 sessions: where latency crosses the 600 ms target


def simulate(cls, *, ticks=600, noise=0.0, seed=0, arrivals=3, lifetime=100, cfg=CFG, a_ms=A_MS, b_ms=B_MS):
    """Sessions try to connect ``arrivals`` per tick (faster than the cap's +1/tick), each admitted one
    lives ``lifetime`` ticks; a Step's latency is a + b*live with multiplicative uniform noise."""
    rng = random.Random(seed)
    c = cls(cfg, memory_cap=1000)
    ends: list[int] = []
    caps = []
    for t in range(ticks):
        ends = [e for e in ends if e > t]
        for _ in range(arrivals):
            if c.admits(len(ends)):
                ends.append(t + lifetime)
        live = len(ends)
        latency = (a_ms + b_ms * live) * (1 + rng.uniform(-noise, noise))
        c.observe(latency, latency > CFG.budget_ms, live)
        caps.append(c.cap)
    return c, caps


@pytest.mark.parametrize("cls", [AimdController, PaperAimdController])
def test_clean_linear_worker_converges_near_the_target_crossing(cls):
    c, caps = simulate(cls)
    tail = caps[300:]  # after the ramp and the first sessions' departures
    assert 0.85 * N_STAR <= min(tail) and max(tail) <= 1.10 * N_STAR
    assert abs(statistics.mean(tail) - N_STAR) <= 0.10 * N_STAR
    # a sawtooth of about one backoff, not a collapse: each cut is ~10 %
    cuts = [d for d in c.history if d.action == "decrease" and d.tick > 300]
    assert cuts and all(d.cap >= 0.85 * d.cap_before for d in cuts)
    if cls is AimdController:  # each cut waits for a fresh window
        ticks = [d.tick for d in cuts]
        assert all(b - a >= CFG.window for a, b in zip(ticks, ticks[1:]))


def test_noisy_worker_robust_controller_stays_near_target_and_beats_the_paper_rule():
    _, robust = simulate(AimdController, noise=0.3, seed=1)
    _, paper = simulate(PaperAimdController, noise=0.3, seed=1)
    r, p = statistics.mean(robust[300:]), statistics.mean(paper[300:])
    assert abs(r - N_STAR) <= 0.15 * N_STAR
    assert r > p + 0.05 * N_STAR  # single noisy samples cut the paper's cap needlessly often


# -- slow start -------------------------------------------------------------------------------------

SLOW = AimdConfig(load_evidence=False, budget_ms=2000.0)  # the defaults: slow_start 2


@pytest.mark.parametrize("a_ms, b_ms", [(A_MS, B_MS), (0.0, 600.0 / N_STAR)])  # with and without a fixed cost
@pytest.mark.parametrize("noise, seed", [(0.0, 0)] + [(0.2, seed) for seed in range(8)])
def test_slow_start_reaches_the_target_crossing_fast_without_overshooting_it(a_ms, b_ms, noise, seed):
    c, caps = simulate(AimdController, cfg=SLOW, ticks=300, arrivals=16, lifetime=10_000, noise=noise,
                       a_ms=a_ms, b_ms=b_ms, seed=seed)
    _, slow = simulate(AimdController, cfg=CFG, ticks=300, arrivals=16, lifetime=10_000, noise=noise,
                       a_ms=a_ms, b_ms=b_ms, seed=seed)
    reached = next(t for t, cap in enumerate(caps) if cap >= 0.85 * N_STAR)
    assert reached <= 55
    assert next(t for t, cap in enumerate(slow) if cap >= 0.85 * N_STAR) >= 85  # additive: ~ +1 a tick
    jumps = [d for d in c.history if d.action == "increase" and d.reason.startswith("slow start")]
    # Sessions are never evicted, so a jump past the crossing would stay admitted: none may pass it.
    assert len(jumps) >= 4 and all(d.cap <= min(2 * d.cap_before, N_STAR) for d in jumps)
    gaps = [b.tick - a.tick for a, b in zip(jumps, jumps[1:])]
    assert min(gaps) >= admission.SLOW_START_SAMPLES  # fresh samples before each jump


def test_slow_start_jumps_only_on_samples_taken_at_the_caps_load():
    c = AimdController(AimdConfig(load_evidence=False, initial_cap=40), memory_cap=1000)
    d = [c.observe(300.0, False, live) for live in (10, 25, 40)][-1]
    assert d.action == "hold" and "app-limited" in d.reason  # 10 and 25 sessions say little about 40
    d = [c.observe(300.0, False, live) for live in (38, 40)][-1]
    # the last three samples at 40, 38, 40 sessions: fit = 38 * 600 / 300 = 76 -> min(2 * 40, floor(0.9 * 76))
    assert d.cap == 68 and "slow start" in d.reason


def test_slow_start_jump_is_bounded_by_doubling_and_by_the_projected_fit():
    c = AimdController(AimdConfig(load_evidence=False, initial_cap=40), memory_cap=1000)
    d = [c.observe(100.0, False, 40) for _ in range(3)][-1]
    assert d.cap == 80 and "slow start" in d.reason  # min(2 * 40, 0.9 * 240)
    d = [c.observe(200.0, False, 80) for _ in range(3)][-1]
    assert d.cap == 160  # min(2 * 80, floor(0.9 * 240) = 216)
    d = [c.observe(500.0, False, 160) for _ in range(3)][-1]
    assert d.cap == 172  # floor(0.9 * 160 * 600 / 500)
    assert [x.action for x in c.history] == ["hold", "hold", "increase"] * 3  # 3 fresh samples each
    # Near the target the projection is no more than a step: slow start ends, growth is additive on 5 samples.
    d = [c.observe(560.0, False, 172) for _ in range(3)][-1]  # floor(0.9 * 172 * 600 / 560) = 165
    assert d.cap == 172 and d.reason.startswith("slow start ends")
    assert [c.observe(LOW, False, c.cap).cap for _ in range(4)] == [172, 173, 174, 175]  # once 5 samples are in


def test_slow_start_projects_from_the_worst_recent_sample():
    c = AimdController(AimdConfig(load_evidence=False, initial_cap=40), memory_cap=1000)
    d = [c.observe(ms, False, 40) for ms in (100.0, 300.0, 100.0)][-1]
    assert d.cap == 72  # min(80, floor(0.9 * 40 * 600 / 300)): the median (100 ms) would have allowed 80


@pytest.mark.parametrize("initial, step, growth", [(1, 1, 2.0), (4, 4, 2.0), (2, 1, 1.5)])
def test_slow_start_grows_from_small_caps_by_at_least_a_step(initial, step, growth):
    """Where doubling is no bigger than a step (cap 1, or step 4 at cap 4) slow start still goes on."""
    c = AimdController(AimdConfig(load_evidence=False, initial_cap=initial, step=step, slow_start=growth), memory_cap=1000)
    caps = [c.observe(10.0, False, live=c.cap).cap for _ in range(24)]
    assert caps[-1] >= 8 * initial and all(d.reason.startswith(("slow start", "collecting")) for d in c.history)


def test_a_deadline_miss_ends_slow_start_even_when_the_cap_cannot_go_lower():
    c = AimdController(AimdConfig(load_evidence=False, initial_cap=10, min_cap=10, window=1), memory_cap=1000)
    assert c.observe(2100.0, True, live=10).cap == 10  # floor(0.9 * 10) = 9 < min_cap: the cap holds
    assert [c.observe(LOW, False, live=c.cap).cap for _ in range(3)] == [11, 12, 13]  # additive, no doubling


def test_slow_start_ends_at_the_memory_cap():
    c = AimdController(AimdConfig(load_evidence=False, initial_cap=None), memory_cap=30)
    assert c.cap == 30  # None: start at the ceiling (the paper's prototype)
    d = [c.observe(LOW, False, live=30) for _ in range(3)][-1]
    assert "at memory cap 30" in d.reason
    d = [c.observe(HIGH, False, live=30) for _ in range(3)]   # judged on the median of a full window of 5
    assert [x.action for x in d] == ["hold", "hold", "decrease"] and d[-1].cap == 27


def test_slow_start_waits_for_demand_and_ends_at_the_first_decrease():
    idle = AimdController(AimdConfig(load_evidence=False, initial_cap=20), memory_cap=1000)
    feed(idle, [LOW] * 10, live=5)
    assert idle.cap == 20 and "app-limited" in idle.history[-1].reason
    c = AimdController(AimdConfig(load_evidence=False, initial_cap=20), memory_cap=1000)
    assert feed(c, [HIGH] * 3, live=20)[-1].action == "decrease"  # floor(0.9 * 20) = 18
    assert c.cap == 18
    d = [c.observe(LOW, False, live=c.cap) for _ in range(8)]
    assert [x.cap for x in d] == [18] * 4 + [19, 20, 21, 22]  # additive once a fresh window is full


def test_slow_start_below_one_is_refused():
    with pytest.raises(ConfigError):
        AimdConfig(load_evidence=False, slow_start=0.5)


# -- invariants ----------------------------------------------------------------------------------------

steps = st.tuples(st.floats(0, 5000, allow_nan=False), st.booleans(), st.integers(0, 300),
                  st.one_of(st.none(), st.integers(0, 300)))  # last: an optional set_memory_cap first


@settings(max_examples=150, deadline=None)
@given(window=st.integers(1, 6), initial=st.integers(0, 400), min_cap=st.integers(0, 5),
       memory_cap=st.integers(0, 300), static_cap=st.one_of(st.none(), st.integers(0, 300)),
       headroom=st.integers(0, 4), step=st.integers(1, 4), backoff=st.floats(0.05, 0.95),
       trace=st.lists(steps, max_size=60), paper=st.booleans(), slow_start=st.sampled_from([1.0, 1.5, 2.0]))
def test_cap_stays_in_bounds_and_decisions_are_deterministic(window, initial, min_cap, memory_cap, static_cap,
                                                             headroom, step, backoff, trace, paper, slow_start):
    cfg = AimdConfig(load_evidence=False, window=window, initial_cap=max(initial, min_cap), min_cap=min_cap,
                     grow_headroom=headroom, step=step, backoff=backoff, slow_start=slow_start)
    cls = PaperAimdController if paper else AimdController

    def run():
        c = cls(cfg, memory_cap=memory_cap, static_cap=static_cap)
        out = []
        for latency, missed, live, new_mem in trace:
            if new_mem is not None:
                c.set_memory_cap(new_mem)
            ceiling = c.memory_cap if static_cap is None else min(c.memory_cap, static_cap)
            assert min(min_cap, ceiling) <= c.cap <= ceiling
            d = c.observe(latency, missed, live)
            assert min(min_cap, ceiling) <= d.cap == c.cap <= ceiling
            assert d.action == ("increase" if d.cap > d.cap_before else
                                "decrease" if d.cap < d.cap_before else "hold")
            if d.action == "increase":
                growth = step if paper else max(step, int(slow_start * d.cap_before + 1e-9) - d.cap_before)
                assert d.cap - d.cap_before <= growth and not (missed and not paper)
                assert live >= d.cap_before - headroom
            if d.action == "decrease":
                assert d.cap == max(min_cap, int(backoff * live + 1e-9))
            assert c.admits(live) == (live < c.cap)
            out.append(d)
        return out

    assert run() == run()


# -- rule 8: overload is latency that grows with load ----------------------------------------------------------


def test_one_sessions_slow_front_end_does_not_refuse_a_second_user():
    # One client asks five questions; the ticks that run its speech recognition overrun the target (and at a
    # short B, the deadline): none of that is load, so the cap stays above the one live session.
    c = AimdController(AimdConfig(budget_ms=2000.0), memory_cap=94)
    for question in range(5):
        for ms, missed in ((250.0, False), (800.0, False), (2100.0, True), (300.0, False), (250.0, False)):
            c.observe(ms, missed, live=1)
    assert c.cap > 1 and c.admits(live=1)
    assert all(d.action != "decrease" for d in c.history)


def test_latency_that_grows_with_load_still_brings_the_cap_down():
    c = AimdController(AimdConfig(budget_ms=2000.0, slow_start=1.0, initial_cap=12), memory_cap=100)
    for live in range(1, 13):                       # latency 60 ms per session: the target is crossed at 11
        for _ in range(5):
            c.observe(60.0 * live, False, live)
    assert c.cap < 12 and any(d.action == "decrease" for d in c.history)
    assert c.observe(2500.0, True, live=12).action in ("decrease", "hold")   # a miss at a grown load acts


def test_a_miss_with_no_smaller_load_seen_holds_and_says_why():
    c = AimdController(AimdConfig(budget_ms=500.0, initial_cap=4), memory_cap=10)
    d = c.observe(800.0, True, live=1)
    assert d.action == "hold" and c.cap == 4 and "fixed per-tick cost" in d.reason


def test_the_papers_rule_keeps_its_behaviour():
    c = PaperAimdController(AimdConfig(budget_ms=2000.0, initial_cap=4), memory_cap=94)
    assert c.observe(800.0, False, live=1).action == "decrease" and c.cap == 1
