"""The probes Kubernetes asks: /ready follows whether a new session has somewhere to go, /live only the loop."""

from __future__ import annotations

import json

from metronome.config import GatewayConfig
from metronome.serving.gateway.http import HttpEndpoints
from metronome.serving.metrics import GatewayMetrics


def worker(healthy=True, draining=False, retired=False) -> dict:
    return {"address": "w:1", "healthy": healthy, "draining": draining, "retired": retired}


def probe(path: str, workers: list[dict], gateway_draining: bool = False) -> tuple[int, dict]:
    def health() -> dict:
        status = "ok" if any(w["healthy"] for w in workers) else "unavailable"
        return {"status": status, "workers": workers, "draining": gateway_draining}

    reply = HttpEndpoints(GatewayConfig(), GatewayMetrics(100.0), health).request("GET", path, {})
    return reply.status, json.loads(reply.body)


def test_ready_only_while_this_gateway_and_some_worker_take_new_sessions():
    assert probe("/ready", [worker(), worker(healthy=False)])[0] == 200
    assert probe("/ready", [worker()], gateway_draining=True) == (503, {"ready": False, "draining": True})
    assert probe("/ready", [worker(draining=True), worker(retired=True), worker(healthy=False)])[0] == 503
    assert probe("/ready", [])[0] == 503


def test_live_answers_whatever_the_workers_do():
    assert probe("/live", [], gateway_draining=True) == (200, {"live": True})
