"""Secrets between the serving parts: the worker token (only gateways open sessions), reading keys, and the
client's API key as a browser sends it (a WebSocket subprotocol).

A worker started with a token refuses every RPC that does not carry ``authorization: Bearer TOKEN`` in
its metadata (``UNAUTHENTICATED``), so a local process that finds the worker's port cannot open sessions
behind the gateway's admission control. ``metronome serve`` makes a fresh token per run and hands it to
its workers and its gateway in the environment (``TOKEN_ENV``), never on a command line (``ps`` shows
those to every user).
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

TOKEN_ENV = "METRONOME_WORKER_TOKEN"
API_KEY_ENV = "METRONOME_API_KEY"
# Browsers cannot set headers on a WebSocket: OpenAI's browser clients send the key as a subprotocol,
# ``new WebSocket(url, ["realtime", "openai-insecure-api-key." + key])``, and expect "realtime" echoed.
KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
REALTIME_SUBPROTOCOL = "realtime"


def offered_subprotocols(header: str) -> list[str]:
    """The subprotocols a ``Sec-WebSocket-Protocol`` request header offers, in order.

    >>> offered_subprotocols("realtime, openai-insecure-api-key.sk-1")
    ['realtime', 'openai-insecure-api-key.sk-1']
    """
    return [p.strip() for p in header.split(",") if p.strip()]


def subprotocol_api_key(header: str) -> str | None:
    """The API key a browser client sent as a subprotocol; None when it sent none."""
    return next((p[len(KEY_SUBPROTOCOL_PREFIX):] for p in offered_subprotocols(header)
                 if p.startswith(KEY_SUBPROTOCOL_PREFIX)), None)


def chosen_subprotocol(header: str) -> str | None:
    """The subprotocol the 101 response names: "realtime" when offered, else the first offered (a browser fails
    a handshake that offered some and got none back); None when none was offered.

    >>> chosen_subprotocol("openai-insecure-api-key.sk-1, realtime"), chosen_subprotocol("")
    ('realtime', None)
    """
    offered = offered_subprotocols(header)
    if REALTIME_SUBPROTOCOL in offered:
        return REALTIME_SUBPROTOCOL
    return offered[0] if offered else None


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every gateway → worker call carries (empty without a token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def read_secret(path: str | None, env: str) -> str | None:
    """A secret from a file (first line, stripped) or else the environment variable ``env``; None if neither."""
    if path:
        text = Path(path).read_text(encoding="utf-8").strip()
        if not text:
            raise SystemExit(f"{path} is empty")
        return text.splitlines()[0].strip()
    return os.environ.get(env) or None


# The standard gRPC health service answers without the token: Kubernetes' grpc probes send none, and it
# tells only SERVING or NOT_SERVING.
OPEN_PREFIX = "/grpc.health.v1.Health/"


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuse RPCs without the worker token: the real handler is swapped for one that aborts."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self.refused = 0   # logged on the first and every 1000th: a prober must not flood the log

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler_call_details.method.startswith(OPEN_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        if isinstance(given, str) and secrets.compare_digest(given.encode("utf-8", "surrogatepass"), self._expected):
            return handler
        if handler is None:
            return None
        self.refused += 1
        if self.refused % 1000 == 1:
            log.warning("refused %s: missing or wrong worker token (%d refused so far)",
                        handler_call_details.method, self.refused)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token")

        make = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
                else grpc.unary_unary_rpc_method_handler)
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
