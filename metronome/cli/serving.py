"""``metronome serve | worker | gateway``: run the serving parts together or apart.

    metronome serve                              # worker(s) + gateway: talk to the embedded speech assistant
    metronome serve --adapter energy             # the deterministic loudness-token stand-in instead
    metronome serve --model ~/ckpt/Qwen2.5-Omni-7B --device cuda --dtype bfloat16
                                                 # an omni checkpoint: its own audio path at its own
                                                 # frame budget B, picked from config.json
    metronome worker --port 50051                # one gRPC worker
    metronome gateway --workers 127.0.0.1:50051  # the WebSocket gateway in front of workers
    metronome gateway --workers dns:metronome-workers:50051
                                                 # every address the name resolves to (a Kubernetes
                                                 # headless Service), resolved again every few seconds

Secrets stay off command lines (``ps`` shows those to every user): the API key comes from
--api-key-file or $METRONOME_API_KEY, the worker token from --worker-token-file or
$METRONOME_WORKER_TOKEN; ``serve`` makes a fresh worker token per run and hands it to its workers
in their environment. ``serve`` restarts a worker that exits (with backoff).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import replace

from metronome.audio.registry import ADAPTERS, resolve_adapter
from metronome.cli.help import HelpFormatter
from metronome.config import AimdConfig, EngineConfig, GatewayConfig, KVPolicy
from metronome.cpu import PLAN_ENV, ThreadPlan, startup_line, usable_cores
from metronome.serving.auth import API_KEY_ENV, TOKEN_ENV, new_token, read_secret

log = logging.getLogger(__name__)


def _policy(args: argparse.Namespace) -> KVPolicy:
    window = None if args.window <= 0 else args.window
    return KVPolicy(sinks=args.sinks if window else 0, window=window, block_size=args.block_size)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="packaged model name or HF checkpoint directory")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto: bfloat16 on a CPU that runs it natively (AMX, AVX512-BF16), else float32")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 (E4M3) decoder and audio tower weights")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: E4M3 KV pages")
    p.add_argument("--cpu-linear", default="auto", choices=["auto", "packed", "kernel", "aten"],
                   help="products on the CPU: bf16 weights packed for oneDNN, float32 through the C kernel, or "
                        "aten (auto: packed for bf16, the kernel for float32 where a C compiler builds it)")
    p.add_argument("--cpu-attention", default="auto", choices=["auto", "kernel", "sdpa"],
                   help="decode rounds on the CPU: the C kernel built for this CPU, or torch's SDPA "
                        "(auto: the kernel where a C compiler builds it)")
    p.add_argument("--cpu-elementwise", default="auto", choices=["auto", "kernel", "torch"],
                   help="norms, rotary embedding and activation on the CPU: one call each of the C kernels built "
                        "for this CPU, or torch's operators (auto: the kernels where a C compiler builds them)")
    p.add_argument("--sinks", type=int, default=16, help="pinned attention-sink tokens (S)")
    p.add_argument("--window", type=int, default=1024, help="KV window in tokens (W); 0 = unbounded baseline")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (None: sized from free memory)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (None: the engine's share of the cores in the thread plan)")
    p.add_argument("--adapter", default="auto", choices=["auto", *ADAPTERS],
                   help="audio front end. 'auto': the omni model's own audio path for an omni "
                        "checkpoint (by config.json's model_type), else 'cascade'; "
                        "'cascade' = VAD + Whisper tiny.en into the chat model; "
                        "'energy' = deterministic loudness tokens (a stand-in for tests and benchmarks); "
                        "the others are the interaction models' own audio encoders (use with their checkpoint)")


def _voice_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--voice", default="auto", choices=["auto", "piper", "espeak", "none"],
                   help="the cascade's spoken answers: auto = the packaged Piper voice, else espeak-ng's; "
                        "none = text only")


def _budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget-ms", type=float, default=None,
                   help="frame budget B per tick (None: the adapter's own on this engine; a gateway adopts its "
                        "workers')")


def _gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    p.add_argument("--port", type=int, default=8000, help="the gateway's port (WebSocket and HTTP)")
    p.add_argument("--tokens-per-tick", type=int, default=25, help="decode tokens per session per tick")
    p.add_argument("--max-sessions", type=int, default=None, help="static session cap (with the controller's)")
    p.add_argument("--api-key-file", default=None,
                   help=f"require 'Authorization: Bearer KEY', KEY the file's first line (None: ${API_KEY_ENV} if set)")
    p.add_argument("--api-key", default=None,
                   help=f"the key itself: visible in ps; use --api-key-file or ${API_KEY_ENV}")
    p.add_argument("--idle-timeout-s", type=float, default=120.0,
                   help="close a session that sends no event for this long (audio, silence included, counts; 0: never)")
    _admission_args(p)
    p.add_argument("--admission", default="worker", choices=["worker", "gateway"],
                   help="worker: each worker admits by its own controller (gateways can share workers); "
                        "gateway: this gateway's own controller per worker (the paper's arrangement)")
    _drain_args(p)


def _admission_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=float, default=0.3, help="AIMD latency target as a fraction of B")
    p.add_argument("--initial-cap", type=int, default=4, help="the admission cap a worker starts with")


def _drain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drain-grace-s", type=float, default=30.0,
                   help="on SIGTERM: admit nothing more, let live sessions run this long, then close the rest")


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="worker(s) + gateway on one machine", description=__doc__,
                       formatter_class=HelpFormatter)
    _engine_args(p)
    _voice_args(p)
    _budget_args(p)
    _gateway_args(p)
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument("--worker-port", type=int, default=50051, help="first worker's gRPC port")
    p.set_defaults(run=run_serve)

    p = sub.add_parser("worker", help="one gRPC worker", formatter_class=HelpFormatter)
    _engine_args(p)
    _voice_args(p)
    _budget_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address the worker listens on")
    p.add_argument("--port", type=int, default=50051, help="the worker's gRPC port")
    p.add_argument("--max-sessions", type=int, default=None, help="static session cap (with the controller's)")
    _admission_args(p)
    _drain_args(p)
    _token_args(p)
    p.set_defaults(run=run_worker_cmd)

    p = sub.add_parser("gateway", help="the WebSocket gateway", formatter_class=HelpFormatter)
    _budget_args(p)
    _gateway_args(p)
    p.add_argument("--workers", default="127.0.0.1:50051",
                   help="comma-separated host:port and dns:NAME:PORT entries (NAME: every address it resolves to)")
    p.add_argument("--discovery-interval-s", type=float, default=5.0, help="how often dns: names are resolved again")
    p.add_argument("--model-name", default="metronome", help="the model name /v1/models and /health show")
    _token_args(p)
    p.set_defaults(run=run_gateway_cmd)


def _token_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker-token-file", default=None,
                   help=f"the token gateways send and workers require (None: ${TOKEN_ENV} if set, else no check)")


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key:
        log.warning("--api-key shows the key to every user in ps; use --api-key-file or $%s", API_KEY_ENV)
        return args.api_key
    return read_secret(args.api_key_file, API_KEY_ENV)


def _gateway_config(args: argparse.Namespace, workers: tuple[str, ...], model_name: str,
                    worker_token: str | None, api_key: str | None) -> GatewayConfig:
    return GatewayConfig(workers=workers, host=args.host, port=args.port, budget_ms=args.budget_ms,
                         tokens_per_tick=args.tokens_per_tick, max_sessions=args.max_sessions,
                         api_key=api_key, model_name=model_name, worker_token=worker_token,
                         idle_timeout_s=args.idle_timeout_s, admission=args.admission,
                         drain_grace_s=args.drain_grace_s,
                         discovery_interval_s=getattr(args, "discovery_interval_s", 5.0),
                         aimd=AimdConfig(target_fraction=args.target, initial_cap=args.initial_cap))


def _resolve(args: argparse.Namespace) -> None:
    """Fill in ``args.adapter`` ('auto') from the checkpoint; ``args.budget_ms`` stays None unless given
    (the worker takes its adapter's B, the gateway the workers')."""
    args.adapter = resolve_adapter(args.model, args.adapter)


def run_worker_cmd(args: argparse.Namespace) -> int:
    _resolve(args)
    from metronome.serving.worker import WorkerConfig, run_worker

    plan = ThreadPlan.for_this_process(speech=args.adapter == "cascade")
    if args.threads:
        plan = replace(plan, worker=args.threads)
    plan.apply_to_torch()
    log.info("%s", startup_line(args.device, args.dtype, plan))
    engine = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, policy=_policy(args),
                          num_blocks=args.num_blocks, quantization=args.quantization,
                          kv_cache_dtype=args.kv_cache_dtype, cpu_attention=args.cpu_attention,
                          cpu_linear=args.cpu_linear, cpu_elementwise=args.cpu_elementwise)
    run_worker(WorkerConfig(engine, budget_ms=args.budget_ms, adapter=args.adapter, host=args.host, port=args.port,
                            auth_token=read_secret(args.worker_token_file, TOKEN_ENV), voice=args.voice,
                            aimd=AimdConfig(target_fraction=args.target, initial_cap=args.initial_cap),
                            max_sessions=args.max_sessions, drain_grace_s=args.drain_grace_s))
    return 0


def run_gateway_cmd(args: argparse.Namespace) -> int:
    from metronome.serving.gateway import run_gateway

    workers = tuple(w.strip() for w in args.workers.split(",") if w.strip())
    config = _gateway_config(args, workers, args.model_name, read_secret(args.worker_token_file, TOKEN_ENV),
                             _api_key(args))
    print(f"gateway on ws://{config.host}:{config.port}/v1/realtime -> workers {', '.join(workers)}", flush=True)
    run_gateway(config)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from metronome.serving.supervisor import WorkerSupervisor, worker_env
    from metronome.serving.worker.config import model_name

    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    _resolve(args)
    api_key = _api_key(args)   # read now: a missing key file stops serve before any worker starts
    plan = ThreadPlan.for_box(usable_cores(), speech=args.adapter == "cascade", workers=args.workers)
    threads = args.threads or plan.worker
    print(startup_line(args.device, args.dtype, plan), flush=True)
    commands = {}
    for i in range(args.workers):
        port = args.worker_port + i
        cmd = [sys.executable, "-m", "metronome", "--log-level", args.log_level, "worker",
               "--model", args.model, "--device", args.device, "--dtype", args.dtype, "--sinks", str(args.sinks),
               "--window", str(args.window), "--block-size", str(args.block_size),
               "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads), "--adapter", args.adapter,
               "--voice", args.voice, "--kv-cache-dtype", args.kv_cache_dtype,
               "--cpu-attention", args.cpu_attention, "--cpu-linear", args.cpu_linear,
               "--cpu-elementwise", args.cpu_elementwise, "--target", str(args.target),
               "--initial-cap", str(args.initial_cap), "--drain-grace-s", str(args.drain_grace_s)]
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        if args.budget_ms is not None:
            cmd += ["--budget-ms", str(args.budget_ms)]
        if args.num_blocks:
            cmd += ["--num-blocks", str(args.num_blocks)]
        commands[f"127.0.0.1:{port}"] = cmd
    token = new_token()   # only this run's gateway can open sessions on its workers
    supervisor = WorkerSupervisor(commands, {**worker_env(token), PLAN_ENV: plan.to_env()}, token)
    supervisor.start()
    try:
        print(f"starting {args.workers} worker(s) with {args.model}, adapter {args.adapter} "
              "(the first run converts the packaged model)...",
              flush=True)
        asyncio.run(supervisor.wait_ready(timeout_s=600))
        from metronome.serving.gateway import run_gateway

        config = _gateway_config(args, tuple(commands), model_name(args.model), token, api_key)
        key = " (API key required)" if config.api_key else ""
        pids = ", ".join(f"{w.address} (pid {w.proc.pid})" for w in supervisor.workers)
        where = f"{config.host}:{config.port}"
        print(f"metronome serving {config.model_name}: connect to ws://{where}/v1/realtime{key}\n"
              f"  workers {pids}\n"
              f"  health  http://{where}/health   metrics http://{where}/metrics\n"
              f"  try     metronome client some.wav --url ws://{where}/v1/realtime", flush=True)
        run_gateway(config, supervisor.watch)
    finally:
        supervisor.stop()
    return 0
