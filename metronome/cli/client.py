"""``metronome client``: stream an audio file through a realtime session, print what was heard and said.

    metronome client question.wav                          # any rate, any common format (WAV, FLAC, OGG, MP3)
    metronome client question.flac --save-audio answer.wav # also keep the answer's speech
    metronome client q.wav --url ws://host:8000/v1/realtime --api-key-file key.txt

The file is decoded, mixed to mono and resampled to the session rate, then sent in 20-ms PCM16 chunks in real
time, then committed. The client ends when the last answer's ``response.done`` arrives (exit 0: after the audio,
or, when the server's VAD answered before the audio's end, once the commit has settled for a few ticks with no
new answer), on the first ``error`` event
(exit 1), when the server refuses the session (exit 2), or ``--timeout-s`` after the audio ends: exit 0 if an
answer was still streaming (a free-running model never finishes one), 1 if none came.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from metronome.cli.help import HelpFormatter

CHUNK_MS = 20
SESSION_RATE = 24_000          # the Realtime API's PCM16 rate
EXIT_OK, EXIT_ERROR, EXIT_REFUSED = 0, 1, 2
# Ticks after the server acknowledged the final commit by which an answer to it has begun, if one will: the tick
# that carries the commit, one for a transcription that lands a tick late, one to spare.
SETTLE_TICKS = 3


def add_parser(sub) -> None:
    p = sub.add_parser("client", help="stream an audio file through a realtime session", description=__doc__,
                       formatter_class=HelpFormatter)
    p.add_argument("audio", type=Path, help="audio file to send (WAV, FLAC, OGG or MP3; any sample rate)")
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime", help="the gateway's realtime endpoint")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="file holding the API key (or set METRONOME_API_KEY)")
    p.add_argument("--rate", type=int, default=SESSION_RATE, help="session sample rate the audio is sent at")
    p.add_argument("--mode", choices=["turn", "free_running"], default=None,
                   help="the session's mode (None: the server's, turn)")
    p.add_argument("--text", default=None, help="also send this text as a user message before the audio")
    p.add_argument("--save-audio", type=Path, default=None, help="write the answers' speech to this WAV file")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="stop listening this long after the audio ends if the answer has not finished")
    p.add_argument("--no-pace", action="store_true", help="send as fast as possible instead of in real time")
    p.add_argument("--ticks", action="store_true", help="print every metronome.tick event")
    p.set_defaults(run=run)


def read_audio(path: Path, rate: int) -> bytes:
    """``path`` decoded (soundfile), mixed to mono and resampled (soxr) to PCM16 at ``rate``."""
    import soundfile
    import soxr

    try:
        samples, file_rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, OSError) as exc:
        raise SystemExit(f"{path}: cannot read audio: {exc}") from None
    mono = samples.mean(axis=1)
    if file_rate != rate:
        mono = soxr.resample(mono, file_rate, rate)
    return (np.clip(mono, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is not None:
        return args.api_key_file.read_text().strip()
    return os.environ.get("METRONOME_API_KEY") or None


@dataclass
class Transcript:
    """What the session said back: counts of responses and the answer's audio."""

    created: int = 0
    done: int = 0
    done_after_audio: int = 0
    audio: list[bytes] = field(default_factory=list)
    audio_rate: int = SESSION_RATE
    exit_code: int | None = None
    ticks_since_commit: int | None = None   # None until the server acknowledged the commit after the audio

    @property
    def answering(self) -> bool:
        return self.created > self.done


def handle(event: dict, out: Transcript, audio_sent: bool, show_ticks: bool) -> None:
    kind = event.get("type")
    if kind == "conversation.item.input_audio_transcription.completed":
        print(f"[heard] {event.get('transcript', '')}", flush=True)
    elif kind == "input_audio_buffer.committed" and audio_sent and out.ticks_since_commit is None:
        out.ticks_since_commit = 0
    elif kind == "response.created":
        out.created += 1
    elif kind == "response.output_text.delta":
        print(event["delta"], end="", flush=True)
    elif kind in ("response.output_audio.delta", "response.audio.delta"):
        out.audio.append(base64.b64decode(event["delta"]))
        out.audio_rate = int(event.get("sample_rate", out.audio_rate))
    elif kind == "response.done":
        out.done += 1
        out.done_after_audio += audio_sent
        print(flush=True)
    elif kind == "error":
        error = event.get("error", {})
        print(f"\n[error] {error.get('code') or error.get('type')}: {error.get('message')}", file=sys.stderr)
        out.exit_code = EXIT_REFUSED if error.get("type") == "server_overloaded" else EXIT_ERROR
    elif kind == "metronome.tick" and out.ticks_since_commit is not None:
        out.ticks_since_commit += 1
    if kind == "metronome.tick" and show_ticks:
        print(f"[tick {event['tick']}] {event['latency_ms']:.1f} ms of {event['budget_ms']:.0f}, "
              f"batch {event['batch']}", file=sys.stderr)


async def stream(args: argparse.Namespace) -> int:
    import aiohttp

    pcm = read_audio(args.audio, args.rate)
    key = api_key(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    chunk = args.rate * 2 * CHUNK_MS // 1000
    out = Transcript()
    try:
        async with aiohttp.ClientSession() as http, http.ws_connect(args.url, headers=headers) as ws:
            session = {"audio": {"input": {"format": {"type": "audio/pcm", "rate": args.rate}}},
                       **({"mode": args.mode} if args.mode else {})}
            await ws.send_json({"type": "session.update", "session": session})
            if args.text:
                await ws.send_json({"type": "conversation.item.create", "item": {
                    "type": "message", "role": "user", "content": [{"type": "input_text", "text": args.text}]}})
            sent = asyncio.Event()

            async def sender() -> None:
                start = time.monotonic()
                for i, offset in enumerate(range(0, len(pcm), chunk)):
                    await ws.send_json({"type": "input_audio_buffer.append",
                                        "audio": base64.b64encode(pcm[offset:offset + chunk]).decode()})
                    if not args.no_pace:
                        await asyncio.sleep(max(0.0, start + (i + 1) * CHUNK_MS / 1000 - time.monotonic()))
                await ws.send_json({"type": "input_audio_buffer.commit"})
                sent.set()

            send_task = asyncio.create_task(sender())
            try:
                code = await receive(ws, out, sent, args)
            finally:
                send_task.cancel()
    except aiohttp.ClientConnectorError as exc:
        print(f"no server answers at {args.url} ({exc.os_error.strerror or exc})", file=sys.stderr)
        return EXIT_REFUSED
    except aiohttp.WSServerHandshakeError as exc:
        print(f"{args.url} refused the WebSocket: HTTP {exc.status} {exc.message}", file=sys.stderr)
        return EXIT_REFUSED
    if args.save_audio is not None:
        save_audio(args.save_audio, out)
    return code


async def receive(ws, out: Transcript, sent: asyncio.Event, args: argparse.Namespace) -> int:
    """Events until the last answer is done (or an error, a close, the timeout); returns the exit code."""
    import aiohttp

    deadline = None
    while True:
        if sent.is_set() and deadline is None:
            deadline = time.monotonic() + args.timeout_s
        # Done: an answer ended after the audio did, or (the server's VAD answered before the audio's end) one
        # ended and the final commit has settled without starting another.
        settled = out.done and (out.ticks_since_commit or 0) >= SETTLE_TICKS
        if deadline is not None and not out.answering and (out.done_after_audio or settled):
            return EXIT_OK
        if deadline is not None and time.monotonic() > deadline:   # checked every event: ticks keep coming
            if out.created:     # a free-running model streams on; what it said has been printed
                print(f"\n(still answering {args.timeout_s:g} s after the audio's end; stopping)", file=sys.stderr)
                return EXIT_OK
            print(f"no answer within {args.timeout_s:g} s of the audio's end", file=sys.stderr)
            return EXIT_ERROR
        try:
            msg = await ws.receive(timeout=0.25)
        except asyncio.TimeoutError:
            continue
        if msg.type != aiohttp.WSMsgType.TEXT:
            reason = f" ({ws.close_code}{': ' + msg.extra if isinstance(msg.extra, str) and msg.extra else ''})"
            print(f"the server closed the session{reason if ws.close_code else ''}", file=sys.stderr)
            return EXIT_ERROR if out.exit_code is None else out.exit_code
        handle(json.loads(msg.data), out, sent.is_set(), args.ticks)
        if out.exit_code is not None:
            return out.exit_code


def save_audio(path: Path, out: Transcript) -> None:
    import soundfile

    pcm = np.frombuffer(b"".join(out.audio), dtype="<i2")
    soundfile.write(str(path), pcm, out.audio_rate, subtype="PCM_16")
    print(f"wrote {len(pcm) / out.audio_rate:.1f} s of the answer's speech to {path}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(stream(args))
