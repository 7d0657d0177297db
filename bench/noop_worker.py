"""A no-op Metronome worker for gateway benchmarks: the real gRPC ``Worker`` service, no model.

    python bench/noop_worker.py --port 0 [--stats steps.jsonl]

``bench/gateway.py`` starts one per sweep point; its figures are in docs/benchmarks/gateway.md. It measures
nothing itself: it prints no table and writes no JSON beyond the ``--stats`` lines.

Every ``OpenSession`` succeeds, ``Health`` reports ready with a huge memory capacity, and ``Step``
answers at once with one ``SessionOutput`` per input (text ``"."``, one token). It prints
``PORT <n>`` on stdout once it serves, so a parent can start it on an ephemeral port.

With ``--stats`` it appends one JSON line per Step, written when the Step arrives::

    {"t": <time.monotonic()>, "tick": 7, "sessions": 1000, "audio_bytes": 32000000, "t_done": ...}

``time.monotonic`` is CLOCK_MONOTONIC, the same clock in every process on the machine, so the
benchmark compares these times with its own: how much audio the gateway really forwarded (its
sustained ingest rate) and the Step cadence the worker saw.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import importlib.util
import resource
import signal
import sys
import time
import types

import grpc

if "metronome" not in sys.modules:
    # Only the generated stubs are needed: register the installed package without running its __init__
    # (which imports the engine, hence torch: seconds of start-up and ~200 MB for a worker with no model).
    _pkg = types.ModuleType("metronome")
    _pkg.__path__ = list(importlib.util.find_spec("metronome").submodule_search_locations)
    sys.modules["metronome"] = _pkg

from metronome.serving.proto import worker_pb2 as pb  # noqa: E402
from metronome.serving.proto import worker_pb2_grpc as pb_grpc  # noqa: E402

CAPACITY = 100_000


class NoopWorker(pb_grpc.WorkerServicer):
    def __init__(self, budget_ms: float, stats_path: str | None) -> None:
        self.budget_ms = budget_ms
        self.sessions: set[str] = set()
        # Line-buffered, open for the server's lifetime: one line per Step (one a second at B = 1 s).
        self.stats = open(stats_path, "a", buffering=1) if stats_path else None  # noqa: SIM115

    async def OpenSession(self, request, context):
        self.sessions.add(request.sid)
        return pb.OpenSessionResponse(ok=True)

    async def CloseSession(self, request, context):
        known = request.sid in self.sessions
        self.sessions.discard(request.sid)
        return pb.CloseSessionResponse(closed=known)

    async def Health(self, request, context):
        return pb.HealthResponse(ready=True, model="noop", budget_ms=self.budget_ms, capacity_sessions=CAPACITY,
                                 kv_blocks_used=0, kv_blocks_total=CAPACITY, sessions=len(self.sessions),
                                 input_sample_rate=16000, kv_policy="noop")

    async def StreamStep(self, request_iterator, context):
        """The gateway's tick: input streamed over the frame period, then the last message (counted as the Step)."""
        streamed = 0
        last = None
        async for message in request_iterator:
            if last is not None:
                streamed += sum(len(s.audio_pcm16) for s in last.sessions)
            last = message
        return await self.Step(last, context, streamed)

    async def Step(self, request, context, streamed: int = 0):
        t = time.monotonic()
        outputs = [pb.SessionOutput(sid=s.sid, tokens=[1], text=".") for s in request.sessions]
        response = pb.StepResponse(outputs=outputs, gpu_ms=0.0, in_flight=len(self.sessions))
        if self.stats is not None:
            audio = streamed + sum(len(s.audio_pcm16) for s in request.sessions)
            self.stats.write(json.dumps({"t": t, "tick": request.tick, "sessions": len(request.sessions),
                                         "audio_bytes": audio, "t_done": time.monotonic()}) + "\n")
        return response


async def serve(host: str, port: int, budget_ms: float, stats: str | None) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", -1),
                                      ("grpc.max_send_message_length", -1)])
    pb_grpc.add_WorkerServicer_to_server(NoopWorker(budget_ms, stats), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    print(f"PORT {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=type(
        "Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument("--port", type=int, default=0, help="0: an ephemeral port (printed as 'PORT <n>')")
    p.add_argument("--budget-ms", type=float, default=1000.0, help="reported in Health only")
    p.add_argument("--stats", default=None, help="append one JSON line per Step to this file")
    args = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(serve(args.host, args.port, args.budget_ms, args.stats))


if __name__ == "__main__":
    main()
