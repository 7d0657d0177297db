"""``metronome serve``'s worker processes, kept running: a worker that exits is started again, with backoff.

While a worker is down its sessions are over: the gateway's next tick or health check finds it gone,
closes them with 1012 (service restart) and refuses new sessions as ``worker_restarting`` until the new
process answers Health, when the gateway takes it back. The wait before a restart doubles from
``first_s`` to ``max_s`` while restarts keep failing, and starts again from ``first_s`` once a worker
has stayed up ``reset_after_s``. Workers get the worker token in their environment, not their command
line (``auth.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from metronome.serving.auth import TOKEN_ENV, token_metadata
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

POLL_S = 0.2


@dataclass(frozen=True)
class Backoff:
    first_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0


@dataclass
class WorkerProcess:
    address: str
    command: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None   # when a dead worker is due to start again
    delay_s: float = 0.0
    restarts: int = 0
    exits: list[int] = field(default_factory=list)


class WorkerSupervisor:
    """Starts the workers, restarts any that exits (``watch``), and stops them all (``stop``)."""

    def __init__(self, commands: Mapping[str, list[str]], env: Mapping[str, str], token: str | None,
                 backoff: Backoff = Backoff()) -> None:
        self.workers = [WorkerProcess(address, list(cmd)) for address, cmd in commands.items()]
        self.env = dict(env)
        self.token = token
        self.backoff = backoff
        for worker in self.workers:
            worker.delay_s = backoff.first_s

    def start(self) -> None:
        for worker in self.workers:
            self._spawn(worker)

    def _spawn(self, worker: WorkerProcess) -> None:
        # Its own session: a terminal's Ctrl-C reaches serve, which closes the gateway's sessions first and
        # then stops the workers (``stop``), instead of every worker dying under sessions still open.
        worker.proc = subprocess.Popen(worker.command, env=self.env, start_new_session=True)
        worker.started_at = time.monotonic()
        worker.restart_at = None
        log.info("worker %s started (pid %d)", worker.address, worker.proc.pid)

    async def wait_ready(self, timeout_s: float) -> None:
        """Until every worker answers Health as ready; SystemExit if one exits or the time runs out."""
        for worker in self.workers:
            await self._wait_ready(worker, timeout_s)

    async def _wait_ready(self, worker: WorkerProcess, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            while time.monotonic() < deadline:
                if worker.proc.poll() is not None:
                    raise SystemExit(f"worker {worker.address} exited with code {worker.proc.returncode} "
                                     "while starting")
                try:
                    if (await stub.Health(pb.HealthRequest(), timeout=1.0, metadata=token_metadata(self.token))).ready:
                        return
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.5)
        raise SystemExit(f"worker {worker.address} not ready after {timeout_s:.0f} s")

    def poll(self, now: float) -> None:
        """One look at every worker: note exits, start the ones whose wait is over."""
        for worker in self.workers:
            if worker.restart_at is not None:
                if now >= worker.restart_at:
                    worker.restarts += 1
                    self._spawn(worker)
                continue
            code = worker.proc.poll()
            if code is None:
                if now - worker.started_at >= self.backoff.reset_after_s:
                    worker.delay_s = self.backoff.first_s
                continue
            worker.exits.append(code)
            worker.restart_at = now + worker.delay_s
            log.error("worker %s exited with code %d; its sessions are closed (1012); restarting it in %g s",
                      worker.address, code, worker.delay_s)
            worker.delay_s = min(2 * worker.delay_s, self.backoff.max_s)

    async def watch(self) -> None:
        """Poll until cancelled (the gateway's companion task in ``metronome serve``)."""
        while True:
            self.poll(time.monotonic())
            await asyncio.sleep(POLL_S)

    def stop(self, grace_s: float = 10.0) -> None:
        procs = [w.proc for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def worker_env(token: str | None) -> dict[str, str]:
    """The environment for worker processes: ours, plus the worker token."""
    env = dict(os.environ)
    if token:
        env[TOKEN_ENV] = token
    return env
