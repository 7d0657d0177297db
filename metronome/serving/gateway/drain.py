"""A gateway's graceful stop: admit nothing, tell the sessions, let them run out a grace period.

On drain the gateway refuses new connections (``server_draining``, close 1001) and ``/ready`` answers
503, so Kubernetes takes it out of its Service; every live session gets a ``session_ending`` event that
says how long it has. Sessions that end within ``grace_s`` end as usual; at the deadline the rest are
closed with 1001 (going away) by ``Gateway.stop``. A client reconnects and reaches another gateway.
"""

from __future__ import annotations

import asyncio
import logging

from metronome.serving.gateway.realtime import Gateway

log = logging.getLogger(__name__)

POLL_S = 0.1
SESSION_ENDING = "session_ending"


def session_ending_event(grace_s: float) -> dict:
    return {"type": SESSION_ENDING, "reason": "server_draining", "ends_in_s": grace_s,
            "message": f"this server is shutting down: the session ends within {grace_s:g} s; "
                       "connect again to continue on another"}


def live_sessions(gateway: Gateway) -> int:
    return sum(1 for c in gateway.connections if c.session is not None and not c.session.closed)


async def drain(gateway: Gateway, grace_s: float) -> None:
    """Stop admitting, warn every session, and wait until none is live or ``grace_s`` has passed."""
    gateway.draining = True
    for conn in list(gateway.connections):
        if conn.session is not None and not conn.session.closed:
            conn.session.send(session_ending_event(grace_s))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    log.info("draining: %d sessions live, up to %g s for them to end", live_sessions(gateway), grace_s)
    while live_sessions(gateway) and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
    if live_sessions(gateway):
        log.info("drain grace over: closing %d sessions (1001)", live_sessions(gateway))
