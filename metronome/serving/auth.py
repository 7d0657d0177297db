"""Secrets between the serving parts: the worker token (only gateways open sessions) and reading keys.

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
