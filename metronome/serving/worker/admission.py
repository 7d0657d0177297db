"""The worker's own admission: what limits it is its to judge, so any number of gateways may ask.

Two limits: memory, the engine's reservation (``open_session`` raises ``AdmissionError`` when a
session's blocks cannot be reserved; ``tick.py`` answers that as ``refused="memory"``), and the AIMD cap
over this worker's tick latency (``serving/admission.py``), checked here first, measured from a Step's
last message to its answer, the wait behind other gateways' ticks on the one engine thread included. A
draining worker admits nothing.

Decisions come from the worker's asyncio loop (``service.py``): a decision and the count of sessions being
opened change together, under one lock and with no await between, so two gateways asking at once cannot
both take the last slot. The engine thread takes a session off that count as it opens it.

>>> from metronome.config import AimdConfig
>>> a = WorkerAdmission(AimdConfig(budget_ms=100, initial_cap=2), memory_cap=3)
>>> a.refusal(live=1), a.refusal(live=2)
(None, 'latency cap')
>>> a.refusal(live=2, gateway_admits=True)   # the gateway's own rule decided; the engine's memory still binds
>>> a.draining = True
>>> a.refusal(live=0)
'draining'
"""

from __future__ import annotations

from metronome.config import AimdConfig
from metronome.serving.admission import AimdController

MEMORY, LATENCY_CAP, STATIC_CAP, DRAINING = "memory", "latency cap", "static cap", "draining"


class WorkerAdmission:
    """The worker's admission state: its AIMD controller, its memory cap and whether it is draining."""

    def __init__(self, config: AimdConfig, memory_cap: int, static_cap: int | None = None) -> None:
        self.controller = AimdController(config, memory_cap, static_cap, name="this worker")
        self.draining = False

    @property
    def cap(self) -> int:
        return self.controller.cap

    def refusal(self, live: int, gateway_admits: bool = False) -> str | None:
        """Why one more session cannot be admitted with ``live`` open or opening; None: it can."""
        c = self.controller
        if self.draining:
            return DRAINING
        if c.static_cap is not None and live >= c.static_cap and c.static_cap < c.memory_cap:
            return STATIC_CAP
        if not gateway_admits and not c.admits(live) and c.cap < c.memory_cap:
            return LATENCY_CAP
        return None   # at the memory cap, the engine's reservation refuses it

    def explain(self, reason: str) -> str:
        """A refusal of ``refusal`` in words for the client."""
        if reason == LATENCY_CAP:
            return f"this worker is at its latency-driven admission cap of {self.cap} sessions"
        if reason == STATIC_CAP:
            return f"this worker is at its static cap of {self.controller.static_cap} sessions"
        return "this worker is draining (shutting down)"

    def observe(self, latency_ms: float, live: int) -> None:
        """One tick's latency as this worker saw it (over B is a missed deadline)."""
        self.controller.observe(latency_ms, latency_ms > self.controller.config.budget_ms, live)
