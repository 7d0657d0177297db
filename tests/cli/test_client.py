"""`metronome client` on its own: audio files of any rate and format, a server that is not there, its help."""

from __future__ import annotations

import socket
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from metronome.cli.client import read_audio


def tone(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return np.stack([mono] * channels, axis=1) if channels > 1 else mono


@pytest.mark.parametrize("fmt,rate,channels", [("WAV", 11025, 1), ("FLAC", 44100, 2), ("OGG", 48000, 1),
                                               ("WAV", 24000, 1)])
def test_any_file_becomes_even_pcm16_at_the_session_rate(tmp_path, fmt, rate, channels):
    path = tmp_path / f"a.{fmt.lower()}"
    soundfile.write(str(path), tone(1.5, rate, channels), rate, format=fmt)
    pcm = read_audio(path, 24000)
    samples = np.frombuffer(pcm, dtype="<i2")
    assert len(pcm) % 2 == 0 and abs(len(samples) - 1.5 * 24000) <= 24   # 1.5 s at 24 kHz, within a millisecond
    spectrum = np.abs(np.fft.rfft(samples.astype(np.float64)))
    assert abs(np.argmax(spectrum) * 24000 / len(samples) - 440) < 2      # the tone survives resampling


def test_unreadable_file_is_one_clear_line(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("not audio")
    with pytest.raises(SystemExit, match="cannot read audio"):
        read_audio(bad, 24000)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metronome", *args], capture_output=True, text=True, timeout=120)


def test_no_server_listening_is_one_line_and_a_non_zero_exit(tmp_path):
    with socket.socket() as s:                  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wav = tmp_path / "q.wav"
    soundfile.write(str(wav), tone(0.2, 16000), 16000)
    result = run_cli("client", str(wav), "--url", f"ws://127.0.0.1:{port}/v1/realtime")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("no server answers at") and len(result.stderr.strip().splitlines()) == 1


def test_version_and_every_flag_shows_its_default():
    from metronome.cli.main import build_parser

    assert run_cli("--version").stdout.startswith("metronome ")
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices      # the registered subcommands
    for name, sub in commands.items():
        text = sub.format_help()
        for action in sub._actions:
            if action.option_strings and action.help != "show this help message and exit":
                assert action.help, f"metronome {name} {action.option_strings[0]} has no help"
        assert "(default:" in text, name


class ScriptedSocket:
    """A socket that hands out scripted server events, and records how many were read."""

    def __init__(self, events: list[dict], sent, send_at: int):
        self.events, self.sent, self.send_at, self.read = events, sent, send_at, 0

    async def receive(self, timeout=None):
        import json

        import aiohttp

        if self.read == self.send_at:
            self.sent.set()          # the audio and the commit went out here
        event = self.events[self.read]
        self.read += 1
        return aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, json.dumps(event), None)


def test_an_answer_the_vad_gave_before_the_audio_ended_ends_the_client_once_the_commit_settles():
    import argparse
    import asyncio

    from metronome.cli.client import SETTLE_TICKS, Transcript, receive

    tick = {"type": "metronome.tick", "tick": 0, "latency_ms": 1.0, "budget_ms": 500.0, "batch": 1}
    answered = [{"type": "response.created"}, {"type": "response.output_text.delta", "delta": "Paris."},
                {"type": "response.done"}, tick]
    settle = [{"type": "input_audio_buffer.committed"}] + [tick] * (SETTLE_TICKS + 5)

    async def run(script, send_at):
        sent = asyncio.Event()
        ws = ScriptedSocket(script, sent, send_at)
        args = argparse.Namespace(timeout_s=60.0, ticks=False)
        return await receive(ws, Transcript(), sent, args), ws.read

    code, read = asyncio.run(run(answered + settle, send_at=len(answered)))
    assert code == 0 and read == len(answered) + 1 + SETTLE_TICKS      # not the 60-s timeout
    # An answer to the commit itself (the last words had no pause after them) is waited for.
    late = [{"type": "input_audio_buffer.committed"}, tick, {"type": "response.created"}] + [tick] * 4 + \
        [{"type": "response.done"}, tick]
    code, read = asyncio.run(run(answered + late, send_at=len(answered)))
    assert code == 0 and read == len(answered) + len(late) - 1
