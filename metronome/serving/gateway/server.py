"""Running the gateway: on picows, until a signal (``run_gateway``) or as a handle (``serve_gateway``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from metronome.config import GatewayConfig
from metronome.serving.gateway.discovery import Resolver, resolve_dns
from metronome.serving.gateway.drain import drain
from metronome.serving.gateway.realtime import REALTIME_PATH, Gateway
from metronome.serving.gc_pauses import freeze_startup_heap


@dataclass
class GatewayServer:
    """A started gateway: ``url`` is where Realtime clients connect."""

    gateway: Gateway
    server: asyncio.Server
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"ws://{self.address}{REALTIME_PATH}"

    async def drain(self, grace_s: float) -> None:
        """Admit nothing more; return once no session is live or after ``grace_s`` (``drain.py``)."""
        await drain(self.gateway, grace_s)

    async def stop(self) -> None:
        self.server.close()
        await self.gateway.stop()


async def serve_gateway(config: GatewayConfig, resolve: Resolver = resolve_dns) -> GatewayServer:
    """Start the gateway (picows) on the running loop and return at once (``port=0``: an ephemeral port).
    ``resolve``: how ``dns:`` worker entries are resolved (the system's resolver unless a test brings one)."""
    from metronome.serving.gateway.ws_picows import start_server

    gateway = Gateway(config, resolve)
    await gateway.start()
    server = await start_server(gateway, config.host, config.port, max_frame_bytes=gateway.max_frame_bytes,
                                send_queue_events=config.send_queue_events, send_queue_bytes=config.send_queue_bytes,
                                ping_interval_s=config.ping_interval_s, pong_timeout_s=config.pong_timeout_s,
                                handshake_timeout_s=config.handshake_timeout_s,
                                max_header_bytes=config.max_header_bytes)
    port = server.sockets[0].getsockname()[1]
    return GatewayServer(gateway, server, config.host, port)


def run_gateway(config: GatewayConfig, companion: Callable[[], Coroutine] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, on uvloop; ``companion()`` runs beside the gateway until then
    (``metronome serve``: the worker supervisor). SIGTERM drains first (``drain_grace_s``); SIGINT stops."""
    import signal

    import uvloop

    async def main() -> None:
        server = await serve_gateway(config)
        freeze_startup_heap()
        stop = asyncio.Event()
        signals: list[signal.Signals] = []
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda sig=sig: (signals.append(sig), stop.set()))
        beside = loop.create_task(companion()) if companion is not None else None
        try:
            await stop.wait()
            if signals[0] == signal.SIGTERM:
                await server.drain(config.drain_grace_s)
        finally:
            if beside is not None:
                beside.cancel()
            await server.stop()

    uvloop.run(main())
