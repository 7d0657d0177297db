"""Prometheus metrics of one gateway, in a registry of its own (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def latency_buckets(budget_ms: float) -> list[float]:
    """Seconds, dense below the budget B and reaching it (plus a few overrun buckets)."""
    b = budget_ms / 1000.0
    return sorted({round(b * f, 6) for f in (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9, 1.0,
                                             1.5, 2.0, 4.0)})


class GatewayMetrics:
    """``budget_ms=None``: a gateway that adopts its workers' B; the tick histograms wait for it."""

    def __init__(self, budget_ms: float | None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions_live = Gauge("metronome_sessions_live", "Sessions open", ["worker"], registry=r)
        self.sessions_admitted = Counter("metronome_sessions_admitted", "Sessions admitted", ["worker"], registry=r)
        self.sessions_rejected = Counter("metronome_sessions_rejected", "Sessions refused at connect", ["reason"],
                                         registry=r)
        self.admission_cap = Gauge("metronome_admission_cap", "Session cap set by the AIMD controller", ["worker"],
                                   registry=r)
        self.memory_capacity = Gauge("metronome_memory_capacity_sessions", "Sessions the worker's KV pool holds",
                                     ["worker"], registry=r)
        self.tick_latency: Histogram | None = None   # bucketed by B: made once B is known (``set_budget``)
        self.tick_drift: Histogram | None = None
        if budget_ms is not None:
            self.set_budget(budget_ms)
        self.deadline_misses = Counter("metronome_deadline_misses", "Ticks that overran the budget", ["worker"],
                                       registry=r)
        self.ticks = Counter("metronome_ticks", "Ticks sent to a worker", ["worker"], registry=r)
        self.kv_blocks_used = Gauge("metronome_kv_blocks_used", "KV blocks in use", ["worker"], registry=r)
        self.kv_blocks_total = Gauge("metronome_kv_blocks_total", "KV blocks in the pool", ["worker"], registry=r)
        self.worker_time = Counter("metronome_worker_time_seconds", "Worker time by part", ["worker", "part"],
                                   registry=r)
        self.client_errors = Counter("metronome_client_errors", "Error events sent to clients", ["code"], registry=r)
        self.worker_up = Gauge("metronome_worker_up", "1 when the worker answers", ["worker"], registry=r)
        self.time_to_wall = Gauge("metronome_kv_time_to_wall_seconds",
                                  "Seconds until the KV pool runs dry at the recent fill rate (+Inf: not filling)",
                                  ["worker"], registry=r)

    def set_budget(self, budget_ms: float) -> None:
        """Make the tick histograms, bucketed by B (once: a gateway's B never changes)."""
        if self.tick_latency is not None:
            return
        r = self.registry
        self.tick_latency = Histogram("metronome_tick_latency_seconds", "Step round trip per tick", ["worker"],
                                      buckets=latency_buckets(budget_ms), registry=r)
        self.tick_drift = Histogram("metronome_tick_drift_seconds", "Tick start minus its scheduled time",
                                    ["worker"], buckets=latency_buckets(budget_ms), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
