"""Which sessions' input fits one tick's last message."""

from __future__ import annotations

import logging

from metronome.serving.gateway.client_session import ClientSession

log = logging.getLogger(__name__)


def fit_step(sessions: list[ClientSession], tick: int, limit: int) -> list[ClientSession]:
    """The sessions whose remaining input fits the tick's last message of ``limit`` bytes (``max_step_bytes``);
    the others keep theirs for a later tick (the pool still names those that streamed input this tick).

    Why: a message over the worker's gRPC limit fails the tick as a whole. Taking from a rotating start
    means a session left out now is early in the order of a later tick. With the input streamed, the
    last message holds about ``stream_interval_ms`` of each session's audio plus its text, so this binds
    only under a burst of text, or when the streamed total already reached ``max_step_bytes``.
    """
    if sum(s.tick_bytes for s in sessions) <= limit:
        return sessions
    start = tick % len(sessions)
    chosen, size = [], 0
    for session in sessions[start:] + sessions[:start]:
        n = session.tick_bytes
        if chosen and size + n > limit:
            continue
        chosen.append(session)
        size += n
    log.warning("tick %d: %d of %d sessions fit in %d bytes; the rest wait", tick, len(chosen), len(sessions),
                limit)
    return chosen
