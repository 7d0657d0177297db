"""Which workers the pool drives: what discovery finds now, against the handles the pool has.

A worker that appears is added (health, ticker; new sessions go to it). One that leaves discovery is
retired, not cut off: it takes no new session but its live ones keep ticking (a draining pod leaves its
Service's DNS at once, while its sessions run out their grace); it is dropped once it has none. One
that comes back before that is simply taken back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from metronome.serving.gateway.discovery import Discovery
from metronome.serving.gateway.handle import WorkerHandle

log = logging.getLogger(__name__)


class Membership:
    """Keeps the pool's ``handles`` in step with discovery through the pool's ``add`` and ``drop``."""

    def __init__(self, discovery: Discovery, handles: list[WorkerHandle], add: Callable[[str], Awaitable[None]],
                 drop: Callable[[WorkerHandle], Awaitable[None]], interval_s: float) -> None:
        self.discovery = discovery
        self.handles = handles   # the pool's own list: read here, changed only through add and drop
        self.add, self.drop = add, drop
        self.interval_s = interval_s

    async def run(self) -> None:
        """Ask discovery again every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync()
            except Exception:  # a bug must not end discovery for the gateway's lifetime
                log.exception("worker discovery failed")

    async def sync(self) -> None:
        """Add the workers that appeared, retire those that left, drop the retired ones with no session left."""
        addresses = await self.discovery.addresses()
        known = {h.address: h for h in self.handles}
        for handle in known.values():
            if handle.retired != (handle.address not in addresses):
                handle.retired = not handle.retired
                log.info("worker %s %s", handle.address,
                         "left discovery: no new sessions" if handle.retired else "is back in discovery")
        for handle in [h for h in self.handles if h.retired and not h.sessions and not h.pending]:
            await self.drop(handle)
        for address in addresses:   # in order: the first to answer may set the pool's B
            if address not in known:
                await self.add(address)
