"""`metronome serve` starts worker + gateway in one command, keeps its workers running and its secrets off
command lines; `metronome client` streams a WAV through it."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import wave

import grpc
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_wav(path, seconds=1.0, rate=16000):
    t = np.arange(int(seconds * rate)) / rate
    pcm = (np.sin(2 * np.pi * 300 * t) * 0.3 * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def start_serve(checkpoint: str, port: int, worker_port: int, env: dict[str, str] | None = None):
    """`metronome serve` on the tiny model; returns (process, banner) once it prints where to connect."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "metronome.cli.main", "serve", "--model", checkpoint, "--port", str(port),
         "--worker-port", str(worker_port), "--budget-ms", "200", "--tokens-per-tick", "4", "--window", "64",
         "--sinks", "4", "--num-blocks", "300", "--adapter", "energy"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    banner = ""
    deadline = time.monotonic() + 120
    while "try " not in banner:
        line = serve.stdout.readline()
        assert line or serve.poll() is None, f"serve exited: {banner}"
        banner += line
        assert time.monotonic() < deadline, banner
    while True:   # the banner comes just before the gateway listens
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return serve, banner
        except OSError:
            assert time.monotonic() < deadline and serve.poll() is None, banner
            time.sleep(0.2)


def drain(ws, timeout=30.0) -> tuple[list[dict], int]:
    """Every event until the server closes the socket, and its close code."""
    events = []
    try:
        while True:
            events.append(json.loads(ws.recv(timeout=timeout)))
    except ConnectionClosed as closed:
        return events, closed.rcvd.code


def events_until(ws, predicate, timeout=30.0):
    seen = []
    deadline = time.monotonic() + timeout
    while not seen or not predicate(seen[-1]):
        seen.append(json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic()))))
    return seen


def test_serve_then_client_then_a_dead_worker_is_restarted(chat_checkpoint, tmp_path):
    """One `serve` run (starting one is most of this test's time): a client, secrets, supervision."""
    port, worker_port = free_port(), free_port()
    # The key comes from the environment, not a flag: command lines are visible to every user in ps.
    serve, banner = start_serve(chat_checkpoint, port, worker_port, env={"METRONOME_API_KEY": "k"})
    url, auth = f"ws://127.0.0.1:{port}/v1/realtime", {"Authorization": "Bearer k"}
    try:
        assert url in banner and "API key required" in banner
        # The public name of the model, never the checkpoint's path.
        assert f"serving {os.path.basename(chat_checkpoint)}:" in banner
        health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2))
        assert health["status"] == "ok" and health["workers"][0]["model"] == os.path.basename(chat_checkpoint)
        worker_pid = int(re.search(r"pid (\d+)", banner).group(1))
        with open(f"/proc/{worker_pid}/environ", "rb") as f:
            token = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)[b"METRONOME_WORKER_TOKEN"]
        for pid in (serve.pid, worker_pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            assert b"k" not in args and not any(token in a for a in args)

        wav = tmp_path / "tone.wav"
        write_wav(wav)
        client = subprocess.run(
            [sys.executable, "-m", "metronome.cli.main", "client", str(wav), "--url", url, "--no-pace",
             "--timeout-s", "2", "--ticks"], capture_output=True, text=True, timeout=120,
            env={**os.environ, "METRONOME_API_KEY": "k"})
        assert client.returncode == 0, client.stderr
        assert "[tick" in client.stderr  # metronome.tick events arrived
        assert client.stdout.strip(), "no text came back"
        refused = subprocess.run([sys.executable, "-m", "metronome.cli.main", "client", str(wav), "--url", url,
                                  "--no-pace"], capture_output=True, text=True, timeout=60,
                                 env={k: v for k, v in os.environ.items() if k != "METRONOME_API_KEY"})
        assert refused.returncode == 2, refused.stderr      # no API key: refused, one line, no traceback
        assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1

        async def direct_open():   # a local process that found the worker's port, without the run's token
            async with grpc.aio.insecure_channel(f"127.0.0.1:{worker_port}") as channel:
                await worker_pb2_grpc.WorkerStub(channel).OpenSession(pb.OpenSessionRequest(sid="intruder"))

        with pytest.raises(grpc.aio.AioRpcError) as intruder:
            asyncio.run(direct_open())
        assert intruder.value.code() == grpc.StatusCode.UNAUTHENTICATED

        chunk = base64.b64encode(b"\x10\x00" * 320).decode()
        with connect(url, additional_headers=auth) as ws:
            events_until(ws, lambda e: e["type"] == "session.created")
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            events_until(ws, lambda e: e["type"] == "metronome.tick")
            os.kill(worker_pid, signal.SIGKILL)
            events, code = drain(ws)
            assert code == 1012   # service restart: clients may reconnect
            error = [e["error"] for e in events if e["type"] == "error"][-1]
            assert error["code"] == "worker_unavailable" and "restarted" in error["message"]
        with connect(url, additional_headers=auth) as ws:   # while the worker is down, new sessions hear why
            events, code = drain(ws)
            assert code == 1012 and events[-1]["error"]["code"] == "worker_restarting"
            assert "worker restarting" in events[-1]["error"]["message"]
        deadline = time.monotonic() + 120
        while True:   # the worker comes back (a new process) and sessions are admitted again
            assert time.monotonic() < deadline, "no session admitted after the worker's restart"
            with connect(url, additional_headers=auth) as ws:
                first = json.loads(ws.recv(timeout=30))
                if first["type"] == "session.created":
                    ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
                    events_until(ws, lambda e: e["type"] == "metronome.tick")
                    break
                assert first["error"]["code"] == "worker_restarting", first
            time.sleep(0.5)
        assert serve.poll() is None
    finally:
        serve.terminate()
        serve.wait(timeout=30)


@pytest.mark.slow
def test_ctrl_c_stops_serve_cleanly_with_a_session_open(tmp_path):
    """Ctrl-C in a terminal sends SIGINT to the whole foreground group (serve and its workers): serve exits 0,
    with no traceback, no nanobind leak report and no warning about the session closed in the race. The
    default speech assistant (its VAD, Whisper and voice loaded), as a person runs it."""
    port, worker_port = free_port(), free_port()
    log_path = tmp_path / "stderr.txt"
    with open(log_path, "w") as log_file:
        serve = subprocess.Popen(
            [sys.executable, "-m", "metronome", "serve", "--port", str(port), "--worker-port", str(worker_port),
             "--budget-ms", "500", "--window", "256", "--num-blocks", "200"],
            stdout=subprocess.PIPE, stderr=log_file, text=True, start_new_session=True)
    try:
        banner, deadline = "", time.monotonic() + 300
        while "connect to" not in banner:
            line = serve.stdout.readline()
            assert line or serve.poll() is None, f"serve exited: {banner}{log_path.read_text()}"
            banner += line
            assert time.monotonic() < deadline, banner
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        while True:   # the banner comes just before the gateway listens
            try:
                ws = connect(url)
                break
            except OSError:
                assert time.monotonic() < deadline and serve.poll() is None, banner
                time.sleep(0.2)
        with ws:
            events_until(ws, lambda e: e["type"] == "session.created")
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(b"\x10\x00" * 4800).decode()}))
            events_until(ws, lambda e: e["type"] == "metronome.tick")
            os.killpg(serve.pid, signal.SIGINT)     # as the terminal does on Ctrl-C
            events, code = drain(ws)
            assert code == 1001                     # going away: the server is shutting down
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    stderr = log_path.read_text()
    for bad in ("Traceback", "leaked", "unknown session", "KeyboardInterrupt"):
        assert bad not in stderr, stderr
