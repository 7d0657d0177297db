"""Latency-driven admission control: how many sessions one worker may hold.

Each worker owns one controller over its own ticks (``worker/admission.py``; the gateway's pool holds one
per worker instead under ``GatewayConfig.admission = "gateway"``, the paper's arrangement, kept for
experiments). :meth:`AimdController.observe` is called once per tick with that tick's latency, whether
the tick missed its deadline (ran past the frame budget ``B``) and the number of live sessions on the
worker. The controller moves a *session cap*; a new session is admitted at
connect only while ``live < cap`` (:meth:`~AimdController.admits`), otherwise it is refused
(``server_overloaded``). Admitted sessions are never evicted, so a decrease only stops admissions
until enough sessions leave on their own.

Everything here is pure and deterministic: no clocks, no I/O, no asyncio. The same trace of
``observe`` calls always produces the same decisions, which is what the tests and offline
experiments rely on. Every decision is appended to ``history`` and logged (``INFO`` when the cap
moves, ``DEBUG`` when it holds) with a human-readable reason.

The paper's rule (kept as :class:`PaperAimdController` for side-by-side experiments), per tick, on
that tick's latency sample: if ``latency > target`` then ``cap = floor(0.9 * live)`` if that is
lower; else if ``live >= cap - 2`` then ``cap += 1``. :class:`AimdController` fixes its weaknesses:

1. **A robust statistic, not one sample.** The decision uses the median of the last
   ``config.window`` latency samples. One noisy tick (a GC pause, a long prompt) moves the median
   by at most one rank, so it cannot cut the cap on its own:

   >>> from metronome.config import AimdConfig
   >>> cfg = AimdConfig(budget_ms=2000, initial_cap=10, slow_start=1, load_evidence=False)  # target 600 ms
   >>> c = AimdController(cfg, memory_cap=100)
   >>> [c.observe(ms, False, live=10).action for ms in (100, 100, 100, 100, 1500)]
   ['hold', 'hold', 'hold', 'hold', 'increase']
   >>> c.history[-1].statistic_ms, c.cap
   (100.0, 11)

2. **Fresh samples after a decrease.** A latency verdict needs a full window, and the window is
   emptied whenever the cap decreases: the samples in it were taken at a load the cap no longer
   allows, and acting on them again would cut the cap once per tick for the same overload
   (geometric collapse while the old samples age out). So after a decrease the controller holds
   for ``window`` ticks, then judges the load as it is now. The window also starts empty, so the
   first ``window - 1`` ticks after start hold ("collecting samples"):

   >>> c = AimdController(cfg, memory_cap=100)
   >>> [c.observe(900, False, live=10).action for _ in range(6)]
   ['hold', 'hold', 'hold', 'hold', 'decrease', 'hold']
   >>> c.cap, c.history[-1].reason
   (9, 'collecting samples: 1 of 5 since the last decrease')

3. **A deadline miss is a decrease, at once.** A tick that ran past ``B`` is a hard failure, so it
   does not wait for the window: the cap drops to ``floor(backoff * live)`` on that tick (and the
   window is emptied, as for any decrease). There is no cooldown between misses, on purpose: a miss
   is evidence about *this* tick's load, not a stale sample, and because the new cap is computed
   from ``live`` (next point) and only ever lowers the cap, repeated misses at the same load are
   no-ops; the cap only follows ``live`` down as sessions leave while the worker keeps missing.
   A tick is observed once, so there is at most one decrease per tick.

   >>> c = AimdController(cfg, memory_cap=100)
   >>> [(d.action, d.cap) for d in (c.observe(2100, True, live=10), c.observe(2100, True, live=10),
   ...                              c.observe(2100, True, live=8))]
   [('decrease', 9), ('hold', 9), ('decrease', 7)]

4. **Decrease from ``live``, not from the cap** (as the paper does): ``cap = max(min_cap,
   floor(backoff * live))``, applied only if lower than the current cap (a decrease never raises
   the cap). The evidence is "``live`` sessions are too many", so the cap must go below ``live``.
   Scaling the cap instead would, for an app-limited worker (``live`` far below the cap), leave the
   cap far above a load already known to be too much: at cap 100 and live 20, ``0.9 * cap = 90``
   would keep admitting 70 more sessions into an overloaded worker; ``0.9 * live`` gives 18.

5. **App-limited guard.** Grow by ``step`` only when the statistic is at or under target *and*
   ``live >= cap - grow_headroom``: low latency at a load far below the cap says nothing about the
   cap, and an idle worker must not grow its cap without bound.

   >>> c = AimdController(AimdConfig(initial_cap=10, window=1, slow_start=1, load_evidence=False), memory_cap=100)
   >>> c.observe(50, False, live=3).reason
   'app-limited: live 3 < cap 10 - headroom 2'

6. **Bounded by memory.** The cap never exceeds ``memory_cap`` (how many sessions' KV the worker
   can hold; it may change when a worker reconnects, see :meth:`set_memory_cap`) nor the optional
   operator ``static_cap``, including the initial cap (``config.initial_cap`` clamped to both).
   The floor ``min_cap`` yields to these ceilings: if the worker can hold fewer than ``min_cap``
   sessions, it gets fewer.

   >>> AimdController(AimdConfig(initial_cap=50), memory_cap=30, static_cap=20).cap
   20

7. **Slow start.** Additive growth alone is slow where ticks are long: at ``B = 2 s`` and ``+1`` a
   tick, a worker that holds 300 sessions needs ten minutes to reach them from a cap of 4, while
   sessions arriving meanwhile are refused. So until its first decrease (or deadline miss) the
   controller grows the way TCP's slow start does, but bounded by the measurement: a verdict under
   target sets the cap to ``min(slow_start * cap, floor(backoff * fit))`` (at least ``cap + step``),
   where ``fit = fewest live * target / worst latency`` over the last ``SLOW_START_SAMPLES`` (3) ticks
   is how many sessions the target allows if latency grows in proportion to sessions. A tick's fixed
   cost makes real latency grow slower, so ``fit`` undershoots; the worst of the samples and the
   ``backoff`` margin keep noise from pushing a jump past the target, which matters because admitted
   sessions are never evicted. Those 3 samples must all be taken with the cap's load in the worker
   (``live >= cap - grow_headroom``), and the window is emptied after each jump. Slow start ends at
   the first decrease or miss, at the memory/static ceiling, or once ``floor(backoff * fit)`` is no
   more than ``cap + step``; from there growth is additive on full windows. Examples 1-6 use
   ``slow_start=1`` (additive only). Here latency is ``50 + 4·live`` ms (the 600 ms target is
   crossed at live 137) and demand always fills the cap:

   >>> c = AimdController(AimdConfig(budget_ms=2000, initial_cap=4), memory_cap=1000)
   >>> caps = [c.observe(50 + 4 * c.cap, False, live=c.cap).cap for _ in range(40)]
   >>> caps[:23]
   [4, 4, 8, 8, 8, 16, 16, 16, 32, 32, 32, 64, 64, 64, 112, 112, 112, 121, 121, 121, 121, 121, 122]
   >>> c.history[17].reason
   'slow start: worst of last 3 ticks 498.0 ms at 112+ sessions, cap = min(2*cap, 0.9*projected fit) = 121'
   >>> c.history[20].reason
   'slow start ends: worst of last 3 ticks 534.0 ms projects 0.9*fit = 122 <= cap 121 + 1'
   >>> caps.index(137)  # additive growth alone: 133 ticks
   37

8. **Overload is latency that grows with load.** A tick can be slow for reasons no admission decision
   changes: one session's own speech recognition, a fixed per-tick cost. Cutting the cap for it refuses a
   second user of an idle server. So with ``load_evidence`` (the default) a verdict over target, or a
   deadline miss, lowers the cap only if latency at the current load is above what a smaller load showed
   (by ``LOAD_GROWTH_MARGIN``): the controller keeps a per-load profile (a moving average of tick latency
   at each live count). Without that evidence it holds, and the next session it admits supplies it: if
   latency then grows, the cap comes down. Examples 1-7 switch it off to show each rule alone.

   >>> c = AimdController(AimdConfig(budget_ms=2000, initial_cap=4, window=1), memory_cap=100)
   >>> [c.observe(800, False, live=1).action for _ in range(3)]    # one session, a slow front end
   ['hold', 'hold', 'hold']
   >>> c.cap, c.history[-1].reason
   (4, 'p50 of last 1 ticks 800.0 ms > target 600.0 ms, but no smaller load was faster: a fixed per-tick cost at 1 sessions, cap held')
   >>> [c.observe(ms, False, live=n).action for ms, n in ((800, 2), (1300, 3))]   # latency grows with load
   ['hold', 'decrease']
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass

from metronome.config import AimdConfig
from metronome.errors import ConfigError

logger = logging.getLogger(__name__)

# How much slower than a smaller load the current load must be to count as latency that grows with load.
LOAD_GROWTH_MARGIN = 0.1
# Weight of the newest tick in the per-load latency profile (a moving average per live count).
PROFILE_WEIGHT = 0.2
# Fresh samples a slow-start verdict needs: the fewest whose median one outlier cannot move on its own.
SLOW_START_SAMPLES = 3
HISTORY_LEN = 10_000  # decisions kept in ``history``: ~5.5 h of 2-s ticks, ~13 min of 80-ms ticks

# floor(backoff * live) in floating point: 0.7 * 90 is 62.999...; without the nudge the floor is 62.
_FLOOR_EPS = 1e-9


@dataclass(frozen=True)
class AimdDecision:
    """One tick's decision, as recorded in ``history`` and logged."""

    tick: int            # 1-based count of observe() calls
    live: int
    latency_ms: float    # this tick's sample
    statistic_ms: float  # the robust statistic the decision used
    cap_before: int
    cap: int
    action: str          # "increase" | "decrease" | "hold"
    reason: str          # human-readable, e.g. "p50 of last 5 ticks 812.0 ms > target 600.0 ms"


class _CapController:
    """What both rules share: the cap and its bounds, admission, history, logging.

    Subclasses implement :meth:`_decide`, which returns ``(statistic, proposed cap, reason)``; the
    base class clamps the proposal into ``[min_cap, ceiling]`` (ceiling winning), derives the action
    from the change and records it, so neither rule can ever step outside the envelope.
    """

    def __init__(self, config: AimdConfig, memory_cap: int, static_cap: int | None = None, *,
                 name: str = "worker") -> None:
        if static_cap is not None and static_cap < 0:
            raise ConfigError(f"static_cap must be >= 0 or None, got {static_cap}")
        self.config = config
        self.name = name  # only for log lines: one controller per worker
        self.static_cap = static_cap
        self._memory_cap = _check_memory_cap(memory_cap)
        # A small initial cap fixes the paper's unbounded one; None keeps the paper's, for experiments.
        self._cap = self._clamp(self.ceiling if config.initial_cap is None else config.initial_cap)
        self._tick = 0
        self.history: deque[AimdDecision] = deque(maxlen=HISTORY_LEN)

    # -- the cap and its bounds -----------------------------------------------------------------

    @property
    def memory_cap(self) -> int:
        return self._memory_cap

    @property
    def ceiling(self) -> int:
        """min(memory_cap, static_cap): the cap is never above it."""
        if self.static_cap is None:
            return self._memory_cap
        return min(self._memory_cap, self.static_cap)

    @property
    def cap(self) -> int:
        """The current session cap: min(AIMD cap, memory_cap, static_cap)."""
        return min(self._cap, self.ceiling)

    def set_memory_cap(self, memory_cap: int) -> None:
        """The worker's capacity changed (e.g. it reconnected). A lower capacity clamps the cap at
        once; a higher one does not raise it (beyond ``min_cap``): the cap grows back through AIMD,
        on evidence."""
        self._memory_cap = _check_memory_cap(memory_cap)
        old = self._cap
        self._cap = self._clamp(self._cap)  # only min_cap (if a 0-capacity worker comes back) lifts it
        if self._cap != old:
            logger.info("aimd %s: memory cap now %d, cap %d -> %d", self.name, memory_cap, old, self._cap)

    def admits(self, live: int) -> bool:
        """May one more session be admitted now, with ``live`` sessions on the worker?"""
        return live < self.cap

    def _clamp(self, cap: int) -> int:
        # min_cap is a floor for the controller's own decisions; the memory/static ceiling is a
        # hard limit (admitting beyond memory fails at the worker), so it wins over min_cap.
        return min(self.ceiling, max(self.config.min_cap, cap))

    def _backoff_cap(self, live: float) -> int:
        return math.floor(self.config.backoff * live + _FLOOR_EPS)

    # -- one tick --------------------------------------------------------------------------------

    def observe(self, latency_ms: float, deadline_missed: bool, live: int) -> AimdDecision:
        """Feed one tick's measurement; returns (and records) the decision it led to."""
        if not math.isfinite(latency_ms) or latency_ms < 0:
            raise ValueError(f"latency_ms must be finite and >= 0, got {latency_ms}")
        if live < 0:
            raise ValueError(f"live must be >= 0, got {live}")
        self._tick += 1
        before = self.cap
        statistic, proposed, reason = self._decide(float(latency_ms), bool(deadline_missed), live)
        after = self._clamp(proposed)
        self._cap = after
        action = "increase" if after > before else "decrease" if after < before else "hold"
        if action == "decrease":
            self._on_decrease()
        decision = AimdDecision(tick=self._tick, live=live, latency_ms=float(latency_ms),
                                statistic_ms=statistic, cap_before=before, cap=after,
                                action=action, reason=reason)
        self.history.append(decision)
        logger.log(logging.DEBUG if action == "hold" else logging.INFO,
                   "aimd %s tick %d: live %d, cap %d -> %d (%s): %s",
                   self.name, self._tick, live, before, after, action, reason)
        return decision

    def _decide(self, latency_ms: float, missed: bool, live: int) -> tuple[float, int, str]:
        raise NotImplementedError

    def _on_decrease(self) -> None:
        """Hook: called after the cap went down."""

    def _grow(self, live: int, statistic: float, what: str) -> tuple[float, int, str]:
        """The additive-increase half, shared: statistic (named by ``what``) is at or under target."""
        cfg, cap = self.config, self.cap
        if live < cap - cfg.grow_headroom:
            return statistic, cap, f"app-limited: live {live} < cap {cap} - headroom {cfg.grow_headroom}"
        if cap >= self.ceiling:
            bound = "memory cap" if self.ceiling == self._memory_cap else "static cap"
            return statistic, cap, f"{what} {statistic:.1f} ms <= target {cfg.target_ms:.1f} ms; at {bound} {cap}"
        return statistic, cap + cfg.step, f"{what} {statistic:.1f} ms <= target {cfg.target_ms:.1f} ms"

    def _shrink(self, live: int, statistic: float, why: str) -> tuple[float, int, str]:
        """The multiplicative-decrease half, shared: cap = floor(backoff * live) if lower."""
        new = max(self.config.min_cap, self._backoff_cap(live))
        if new >= self.cap:
            # Never raise on a decrease; sessions are never evicted, so wait for them to leave.
            return statistic, self.cap, (f"{why}; floor({self.config.backoff}*live {live}) = {new} "
                                         f">= cap {self.cap}, waiting for sessions to leave")
        return statistic, new, f"{why}; cap = floor({self.config.backoff}*live {live}) = {new}"


class AimdController(_CapController):
    """The robust AIMD admission controller (see the module docstring for the rule and why)."""

    def __init__(self, config: AimdConfig, memory_cap: int, static_cap: int | None = None, *,
                 name: str = "worker") -> None:
        super().__init__(config, memory_cap, static_cap, name=name)
        # Latency samples taken since start or since the last decrease (at most ``window``).
        self._samples: deque[float] = deque(maxlen=config.window)
        self._lives: deque[int] = deque(maxlen=config.window)  # live sessions at each of those samples
        self._since = "since start"  # only for the wording of "collecting samples" reasons
        self._slow_start = config.slow_start > 1.0
        # live count → moving average of tick latency at that load (rule 8); bounded by the memory cap.
        self._profile: dict[int, float] = {}

    def _decide(self, latency_ms: float, missed: bool, live: int) -> tuple[float, int, str]:
        cfg = self.config
        self._samples.append(latency_ms)
        self._lives.append(live)
        statistic = float(statistics.median(self._samples))
        slower_than_smaller = self._grown_with_load(live, latency_ms if missed else statistic)
        self._record_profile(live, latency_ms)
        if missed:
            self._slow_start = False  # a miss ends it even when the cap cannot go lower (see _shrink)
            why = f"deadline missed ({latency_ms:.1f} ms, budget {cfg.budget_ms:.1f} ms)"
            return self._overload(live, statistic, why, slower_than_smaller)
        needed = min(cfg.window, SLOW_START_SAMPLES) if self._slow_start else cfg.window
        if len(self._samples) < needed:
            return statistic, self.cap, f"collecting samples: {len(self._samples)} of {needed} {self._since}"
        what = f"p50 of last {len(self._samples)} ticks"
        if statistic > cfg.target_ms:
            why = f"{what} {statistic:.1f} ms > target {cfg.target_ms:.1f} ms"
            return self._overload(live, statistic, why, slower_than_smaller)
        if self._slow_start:
            return self._slow_start_step(live, statistic, what)
        return self._grow(live, statistic, what)

    def _overload(self, live: int, statistic: float, why: str, grown: bool) -> tuple[float, int, str]:
        if self.config.load_evidence and not grown:
            return statistic, self.cap, (f"{why}, but no smaller load was faster: a fixed per-tick cost at "
                                         f"{live} sessions, cap held")
        return self._shrink(live, statistic, why)

    def _grown_with_load(self, live: int, latency_ms: float) -> bool:
        """Was some smaller load (at least one session) faster than ``latency_ms`` by the margin?"""
        smaller = [ms for n, ms in self._profile.items() if 1 <= n < live]
        return bool(smaller) and latency_ms > (1.0 + LOAD_GROWTH_MARGIN) * min(smaller)

    def _record_profile(self, live: int, latency_ms: float) -> None:
        if live >= 1:
            old = self._profile.get(live, latency_ms)
            self._profile[live] = old + PROFILE_WEIGHT * (latency_ms - old)

    def _slow_start_step(self, live: int, statistic: float, what: str) -> tuple[float, int, str]:
        """A verdict under target during slow start: jump to min(slow_start * cap, floor(backoff * fit)),
        judged on the last ``SLOW_START_SAMPLES`` samples, all taken with the cap's load in the worker."""
        cfg, cap = self.config, self.cap
        n = min(cfg.window, SLOW_START_SAMPLES)
        lives, recent = list(self._lives)[-n:], list(self._samples)[-n:]
        if min(lives) < cap - cfg.grow_headroom:
            # Samples at a load below the cap say little about the cap (the app-limited guard, over the
            # samples the jump is judged on): wait until demand fills it.
            return statistic, cap, (f"slow start: app-limited: live {min(lives)} < cap {cap} - headroom "
                                    f"{cfg.grow_headroom} in the last {n} ticks")
        if cap >= self.ceiling:
            self._slow_start = False  # nothing left to find; full windows from here
            return self._grow(live, statistic, what)
        # The sessions the target allows if latency grew in proportion to them (it grows slower when part
        # of a tick is a fixed cost, so this undershoots), from the worst of the samples (a median of 3 is
        # optimistic a third of the time under noise), less a backoff's margin.
        worst = max(recent)
        bound = self._backoff_cap(min(lives) * cfg.target_ms / max(worst, 1e-6))
        if bound <= cap + cfg.step:
            # The cap's load is near the target: additive growth, judged on full windows, from here.
            self._slow_start = False
            return statistic, cap, (f"slow start ends: worst of last {n} ticks {worst:.1f} ms projects "
                                    f"{cfg.backoff:g}*fit = {bound} <= cap {cap} + {cfg.step}")
        jump = max(cap + cfg.step, min(math.floor(cfg.slow_start * cap + _FLOOR_EPS), bound))
        # Judge the next jump on samples taken at the new load only.
        self._samples.clear()
        self._lives.clear()
        self._since = "since the last slow-start increase"
        return worst, jump, (f"slow start: worst of last {n} ticks {worst:.1f} ms at {min(lives)}+ sessions, "
                             f"cap = min({cfg.slow_start:g}*cap, {cfg.backoff:g}*projected fit) = {jump}")

    def _on_decrease(self) -> None:
        # The samples in the window were taken at a load the cap no longer allows: start afresh.
        self._samples.clear()
        self._lives.clear()
        self._since = "since the last decrease"
        self._slow_start = False


class PaperAimdController(_CapController):
    """The prototype's plain rule, for side-by-side experiments.

    Per tick, on that tick's single latency sample: if ``latency > target`` then
    ``cap = floor(backoff * live)`` if lower, else if ``live >= cap - grow_headroom`` then
    ``cap += step`` (the paper: target 0.3·B, backoff 0.9, headroom 2, step 1, the config defaults).
    No window, no refresh after a decrease, no separate deadline-miss signal (a missed tick's
    latency exceeds ``B`` and so the target anyway). It shares the envelope with
    :class:`AimdController` (initial cap, ``min_cap``, memory and static ceilings) so that
    experiments compare the rules, not the bounds.
    """

    def _decide(self, latency_ms: float, missed: bool, live: int) -> tuple[float, int, str]:
        target = self.config.target_ms
        if latency_ms > target:
            return self._shrink(live, latency_ms, f"latency {latency_ms:.1f} ms > target {target:.1f} ms")
        return self._grow(live, latency_ms, "latency")


def _check_memory_cap(memory_cap: int) -> int:
    if memory_cap < 0:
        raise ConfigError(f"memory_cap must be >= 0, got {memory_cap}")
    return int(memory_cap)
