"""The gateway: Realtime WebSocket sessions in front of the workers.

    realtime.py        Gateway: the WebSocket life cycle, client events, input budgets, idle sessions
    http.py            the HTTP endpoints, the API key and the throttle on failed keys
    http_front.py      each connection's request head (h11): answered, or handed to picows to upgrade
    responses.py       a tick's output for one session as server events
    client_session.py  one client's buffered input and its way out
    pool.py            WorkerPool: health, frame budget B, one ticker per worker
    handle.py          WorkerHandle: one worker as the pool sees it
    placement.py       a new session to the worker with the most headroom, the next one if it refuses
    discovery.py       where the workers are: host:port entries and dns:NAME:PORT (a headless Service)
    membership.py      workers joining and leaving the pool as discovery changes
    step_fit.py        which sessions' input fits one tick's message
    drain.py           a graceful stop: no admissions, session_ending, 1001 after the grace period
    ws_transport.py    the transport interface; ws_picows.py (default) and ws_aiohttp.py implement it
    server.py          serve_gateway, run_gateway
"""

from metronome.serving.gateway.realtime import FLOOD_STRIKES, REALTIME_PATH, Gateway
from metronome.serving.gateway.server import GatewayServer, run_gateway, serve_gateway

__all__ = ["FLOOD_STRIKES", "REALTIME_PATH", "Gateway", "GatewayServer", "run_gateway", "serve_gateway"]
