"""``metronome serve | worker | gateway``: run the serving parts together or apart.

    metronome serve                              # worker(s) + gateway: talk to the embedded speech assistant
    metronome serve --adapter energy             # the deterministic loudness-token stand-in instead
    metronome serve --model ~/ckpt/Qwen2.5-Omni-7B --device cuda --dtype bfloat16
                                                 # an omni checkpoint: its own audio path at its own
                                                 # frame budget B, picked from config.json
    metronome worker --port 50051                # one gRPC worker
    metronome gateway --workers 127.0.0.1:50051  # the WebSocket gateway in front of workers
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import grpc

from metronome.audio.registry import ADAPTERS, resolve_adapter
from metronome.config import AimdConfig, EngineConfig, GatewayConfig, KVPolicy

log = logging.getLogger(__name__)


def _policy(args: argparse.Namespace) -> KVPolicy:
    window = None if args.window <= 0 else args.window
    return KVPolicy(sinks=args.sinks if window else 0, window=window, block_size=args.block_size)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="packaged model name or HF checkpoint directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 (E4M3) decoder weights")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: E4M3 KV pages")
    p.add_argument("--sinks", type=int, default=16, help="pinned attention-sink tokens (S)")
    p.add_argument("--window", type=int, default=1024, help="KV window in tokens (W); 0 = unbounded baseline")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: from free memory)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--adapter", default="auto", choices=["auto", *ADAPTERS],
                   help="audio front end. 'auto' (default): the omni model's own audio path for an omni "
                        "checkpoint (by config.json's model_type), else 'cascade'; "
                        "'cascade' = VAD + Whisper tiny.en into the chat model; "
                        "'energy' = deterministic loudness tokens (a stand-in for tests and benchmarks); "
                        "the others are the interaction models' own audio encoders (use with their checkpoint)")


def _budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget-ms", type=float, default=None,
                   help="frame budget B per tick (default: the adapter's own; a gateway adopts its workers')")


def _gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tokens-per-tick", type=int, default=25)
    p.add_argument("--max-sessions", type=int, default=None, help="static session cap (with the controller's)")
    p.add_argument("--api-key", default=os.environ.get("METRONOME_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $METRONOME_API_KEY)")
    p.add_argument("--target", type=float, default=0.3, help="AIMD latency target as a fraction of B")
    p.add_argument("--initial-cap", type=int, default=4)


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="worker(s) + gateway on one machine", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _engine_args(p)
    _budget_args(p)
    _gateway_args(p)
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--worker-port", type=int, default=50051, help="first worker's gRPC port")
    p.set_defaults(run=run_serve)

    p = sub.add_parser("worker", help="one gRPC worker")
    _engine_args(p)
    _budget_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.set_defaults(run=run_worker_cmd)

    p = sub.add_parser("gateway", help="the WebSocket gateway")
    _budget_args(p)
    _gateway_args(p)
    p.add_argument("--workers", default="127.0.0.1:50051", help="comma-separated worker addresses")
    p.add_argument("--model-name", default="metronome")
    p.set_defaults(run=run_gateway_cmd)


def _gateway_config(args: argparse.Namespace, workers: tuple[str, ...], model_name: str) -> GatewayConfig:
    return GatewayConfig(workers=workers, host=args.host, port=args.port, budget_ms=args.budget_ms,
                         tokens_per_tick=args.tokens_per_tick, max_sessions=args.max_sessions,
                         api_key=args.api_key or None, model_name=model_name,
                         aimd=AimdConfig(target_fraction=args.target, initial_cap=args.initial_cap))


def _resolve(args: argparse.Namespace) -> None:
    """Fill in ``args.adapter`` ('auto') from the checkpoint; ``args.budget_ms`` stays None unless given
    (the worker takes its adapter's B, the gateway the workers')."""
    args.adapter, _ = resolve_adapter(args.model, args.adapter, args.budget_ms)


def run_worker_cmd(args: argparse.Namespace) -> int:
    import torch

    _resolve(args)
    from metronome.serving.worker import WorkerConfig, run_worker

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, policy=_policy(args),
                          num_blocks=args.num_blocks, quantization=args.quantization,
                          kv_cache_dtype=args.kv_cache_dtype)
    run_worker(WorkerConfig(engine, budget_ms=args.budget_ms, adapter=args.adapter, host=args.host, port=args.port))
    return 0


def run_gateway_cmd(args: argparse.Namespace) -> int:
    from metronome.serving.gateway import run_gateway

    workers = tuple(w.strip() for w in args.workers.split(",") if w.strip())
    config = _gateway_config(args, workers, args.model_name)
    print(f"gateway on ws://{config.host}:{config.port}/v1/realtime -> workers {', '.join(workers)}", flush=True)
    run_gateway(config)
    return 0


async def _wait_ready(address: str, proc: subprocess.Popen, timeout_s: float) -> None:
    from metronome.serving.proto import worker_pb2 as pb
    from metronome.serving.proto import worker_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"worker {address} exited with code {proc.returncode} while starting")
            try:
                if (await stub.Health(pb.HealthRequest(), timeout=1.0)).ready:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"worker {address} not ready after {timeout_s:.0f} s")


def run_serve(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    _resolve(args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    procs, addresses = [], []
    for i in range(args.workers):
        port = args.worker_port + i
        address = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "metronome", "--log-level", args.log_level, "worker",
               "--model", args.model, "--device", args.device, "--dtype", args.dtype, "--sinks", str(args.sinks),
               "--window", str(args.window), "--block-size", str(args.block_size),
               "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads), "--adapter", args.adapter,
               "--kv-cache-dtype", args.kv_cache_dtype]
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        if args.budget_ms is not None:
            cmd += ["--budget-ms", str(args.budget_ms)]
        if args.num_blocks:
            cmd += ["--num-blocks", str(args.num_blocks)]
        procs.append(subprocess.Popen(cmd))
        addresses.append(address)
    try:
        print(f"starting {args.workers} worker(s) with {args.model}, adapter {args.adapter} "
              "(the first run converts the packaged model)...",
              flush=True)
        for address, proc in zip(addresses, procs):
            asyncio.run(_wait_ready(address, proc, timeout_s=600))
        from metronome.serving.gateway import run_gateway

        config = _gateway_config(args, tuple(addresses), args.model)
        key = " (API key required)" if config.api_key else ""
        print(f"metronome serving {args.model}: connect to ws://{config.host}:{config.port}/v1/realtime{key}\n"
              f"  health  http://{config.host}:{config.port}/health   metrics http://{config.host}:{config.port}/metrics\n"
              f"  try     metronome client some.wav --url ws://{config.host}:{config.port}/v1/realtime", flush=True)
        run_gateway(config)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0
