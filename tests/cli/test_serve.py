"""`metronome serve` starts worker + gateway in one command; `metronome client` streams a WAV through it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import wave

import numpy as np


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


def test_serve_then_client(chat_checkpoint, tmp_path):
    port, worker_port = free_port(), free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "metronome.cli.main", "serve", "--model", chat_checkpoint, "--port", str(port),
         "--worker-port", str(worker_port), "--budget-ms", "200", "--tokens-per-tick", "4", "--window", "64",
         "--sinks", "4", "--num-blocks", "300", "--api-key", "k", "--adapter", "energy"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = ""
        deadline = time.monotonic() + 120
        while "connect to" not in banner:
            line = serve.stdout.readline()
            assert line or serve.poll() is None, f"serve exited: {banner}"
            banner += line
            assert time.monotonic() < deadline, banner
        assert f"ws://127.0.0.1:{port}/v1/realtime" in banner
        health = None
        while health is None and time.monotonic() < deadline:
            try:
                health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2))
            except OSError:
                time.sleep(0.2)
        assert health["status"] == "ok" and health["workers"][0]["healthy"]
        wav = tmp_path / "tone.wav"
        write_wav(wav)
        client = subprocess.run(
            [sys.executable, "-m", "metronome.cli.main", "client", str(wav), "--url",
             f"ws://127.0.0.1:{port}/v1/realtime", "--no-pace", "--timeout-s", "2", "--ticks"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "METRONOME_API_KEY": "k"})
        assert client.returncode == 0, client.stderr
        assert "[tick" in client.stderr  # metronome.tick events arrived
        assert client.stdout.strip(), "no text came back"
        refused = subprocess.run(
            [sys.executable, "-m", "metronome.cli.main", "client", str(wav), "--url",
             f"ws://127.0.0.1:{port}/v1/realtime", "--no-pace"], capture_output=True, text=True, timeout=60,
            env={k: v for k, v in os.environ.items() if k != "METRONOME_API_KEY"})
        assert refused.returncode == 2, refused.stderr      # no API key: refused, one line, no traceback
        assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    finally:
        serve.terminate()
        serve.wait(timeout=30)
