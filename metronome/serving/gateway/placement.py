"""Placing a new session: the worker with the most headroom, then the next one if it says no.

Under worker admission each worker answers OpenSession with ok or refused and the reason ("memory",
"latency cap", "draining"): the gateway's view of its cap is only a guess for the order in which to
ask, so two gateways sharing workers never over-admit. A refused ask updates the view and the next
worker with headroom is tried; when every one says no, the last reason is the client's.
"""

from __future__ import annotations

import logging

import grpc

from metronome.serving.gateway.handle import WorkerHandle
from metronome.serving.proto import worker_pb2 as pb

log = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 10.0


def pick(handles: list[WorkerHandle], tried: frozenset[str] = frozenset()) -> WorkerHandle | None:
    """The placeable worker with the most headroom not yet tried, a slot held on it (``pending``); None: none."""
    candidates = [h for h in handles if h.address not in tried and h.placeable and h.headroom() > 0]
    if not candidates:
        return None
    best = max(candidates, key=WorkerHandle.headroom)
    best.pending += 1
    return best


def refusal(handles: list[WorkerHandle]) -> tuple[str, str]:
    """(code, why) for a connection ``pick`` found no room for: no worker up at all, or all full."""
    if any(h.healthy and not h.draining for h in handles):
        return "server_overloaded", "no worker has room under its admission cap"
    refused = [f"worker {h.address} {h.refused}" for h in handles if h.refused]
    if refused:
        return "server_overloaded", f"no usable worker: {refused[0]}"
    return "worker_restarting", "worker restarting: no worker is ready to take sessions; try again in a few seconds"


async def open_session(handles: list[WorkerHandle], first: WorkerHandle, sid: str, gateway_admits: bool
                       ) -> tuple[WorkerHandle, pb.OpenSessionResponse]:
    """OpenSession on ``first`` (picked, its slot held), then on the next best worker while refused for
    admission; returns the worker that answered last and its answer (ok, or the last refusal)."""
    handle, tried = first, {first.address}
    while True:
        try:
            opened = await handle.stub.OpenSession(pb.OpenSessionRequest(sid=sid, gateway_admits=gateway_admits),
                                                   timeout=OPEN_TIMEOUT_S, metadata=handle.metadata)
        except grpc.aio.AioRpcError as exc:
            opened = pb.OpenSessionResponse(ok=False, error=f"worker unavailable: {exc.code().name}",
                                            refused="unavailable")
        else:
            if not gateway_admits and opened.admission_cap:   # 0: a worker older than worker admission
                handle.heard(opened.admission_cap, opened.sessions)
            handle.draining |= opened.refused == "draining"
        handle.pending -= 1
        if opened.ok or not opened.refused:
            return handle, opened
        log.info("session %s refused by %s: %s", sid, handle.address, opened.refused)
        following = pick(handles, frozenset(tried))
        if following is None:
            return handle, opened
        handle = following
        tried.add(handle.address)
