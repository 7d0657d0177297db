"""The gateway's HTTP side: the small endpoints, the API key, and the throttle on failed keys.

    GET|HEAD /v1/realtime   WebSocket upgrade (Authorization: Bearer <key> when an API key is set)
    GET|HEAD /health        JSON: workers, their caps, live sessions (503 when no worker is ready)
    GET|HEAD /ready         200 while new sessions can be taken; 503 while draining or with no worker taking them
    GET|HEAD /live          200 while the event loop answers (Kubernetes' liveness probe)
    GET|HEAD /v1/models     the served model's name, OpenAI list format
    GET|HEAD /metrics       Prometheus text
    GET|HEAD /              the talk page (``page.py``; its files under /page/)

Anything else: 404 for an unknown path, 405 (``Allow: GET, HEAD``) for another method. Public answers
name the model, never a path on the workers' machine. A client address whose API keys failed
``auth_failures_per_min`` times in the last minute gets 429 (``Retry-After``) without its key being
checked, so guessing keys is slow; the throttle remembers at most ``MAX_PEERS`` addresses.
"""

from __future__ import annotations

import math
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping

from metronome.config import GatewayConfig
from metronome.serving.auth import subprotocol_api_key
from metronome.serving.gateway.client_session import TokenBucket
from metronome.serving.gateway.page import TalkPage
from metronome.serving.gateway.ws_transport import HttpReply
from metronome.serving.metrics import CONTENT_TYPE, GatewayMetrics

REALTIME_PATH = "/v1/realtime"
MAX_PEERS = 4096
METHODS = ("GET", "HEAD")


def _error(status: int, kind: str, code: str, message: str, headers: dict[str, str] | None = None) -> HttpReply:
    reply = HttpReply.json({"error": {"type": kind, "code": code, "message": message}}, status=status)
    reply.headers.update(headers or {})
    return reply


class AuthThrottle:
    """Failed API-key attempts per client address: a token bucket each, least recently failed dropped first."""

    def __init__(self, per_min: float) -> None:
        self.per_min = per_min
        self._peers: OrderedDict[str, TokenBucket] = OrderedDict()

    def blocked(self, peer: str) -> bool:
        bucket = self._peers.get(peer)
        return bucket is not None and not bucket.has(1.0)

    def failed(self, peer: str) -> None:
        bucket = self._peers.pop(peer, None) or TokenBucket(rate=self.per_min / 60.0, burst=self.per_min)
        bucket.take()
        self._peers[peer] = bucket
        while len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)

    def retry_after_s(self) -> int:
        return math.ceil(60.0 / self.per_min)


class HttpEndpoints:
    """Answers one request's head; ``None`` means: go on and upgrade it to the Realtime WebSocket."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics, health: Callable[[], dict]) -> None:
        self.config = config
        self.metrics = metrics
        self.health = health
        self.throttle = AuthThrottle(config.auth_failures_per_min)
        self.page = TalkPage(config.model_name, auth_required=bool(config.api_key))

    def request(self, method: str, path: str, headers: Mapping[str, str], peer: str = "") -> HttpReply | None:
        path = path.split("?", 1)[0]
        if method not in METHODS:
            return _error(405, "invalid_request_error", "method_not_allowed", f"{method} is not allowed here; "
                          "use GET or HEAD", {"Allow": ", ".join(METHODS)})
        if path == REALTIME_PATH:
            return self._realtime(headers, peer)
        if path == "/health":
            body = self.health()
            return HttpReply.json(body, status=200 if body["status"] == "ok" else 503)
        if path == "/ready":   # a new session has somewhere to go: this gateway and a worker both take them
            body = self.health()
            ready = not body["draining"] and any(w["healthy"] and not w["draining"] and not w["retired"]
                                                 for w in body["workers"])
            return HttpReply.json({"ready": ready, "draining": body["draining"]}, status=200 if ready else 503)
        if path == "/live":
            return HttpReply.json({"live": True})
        if path == "/v1/models":
            return HttpReply.json({"object": "list", "data": [
                {"id": self.config.model_name, "object": "model", "owned_by": "metronome"}]})
        if path == "/metrics":
            return HttpReply(200, self.metrics.render(), CONTENT_TYPE)
        page = self.page.reply(path)
        if page is not None:
            return page
        return _error(404, "invalid_request_error", "not_found", f"no endpoint {path}")

    def _realtime(self, headers: Mapping[str, str], peer: str) -> HttpReply | None:
        if not self.config.api_key:
            return None
        if self.throttle.blocked(peer):
            self.metrics.sessions_rejected.labels("auth_throttled").inc()
            return _error(429, "rate_limit_error", "too_many_auth_failures", "too many wrong API keys from this "
                          "address; try again later", {"Retry-After": str(self.throttle.retry_after_s())})
        if self._authorized(headers):
            return None
        self.throttle.failed(peer)
        self.metrics.sessions_rejected.labels("unauthorized").inc()
        return _error(401, "invalid_request_error", "invalid_api_key", "missing or wrong API key")

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        """The key as ``Authorization: Bearer KEY`` (SDKs, the CLI) or as a subprotocol (browsers: ``auth.py``)."""
        scheme, _, token = headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = subprotocol_api_key(headers.get("Sec-WebSocket-Protocol", "")) or ""
            if not token:
                return False
        # Bytes, not str: compare_digest refuses non-ASCII str (a TypeError, a 500) and headers can hold any.
        return secrets.compare_digest(
            token.strip().encode("utf-8", "surrogatepass"), self.config.api_key.encode("utf-8", "surrogatepass"))
