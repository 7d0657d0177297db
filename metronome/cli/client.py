"""``metronome client``: stream a WAV file through a session in real time and print the text as it arrives.

    metronome client speech.wav --url ws://127.0.0.1:8000/v1/realtime
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
import wave

import aiohttp

CHUNK_MS = 20


def add_parser(sub) -> None:
    p = sub.add_parser("client", help="stream a WAV file through a realtime session", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wav", help="PCM16 mono WAV file (any sample rate the gateway supports)")
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime")
    p.add_argument("--api-key", default=None)
    p.add_argument("--mode", choices=["turn", "free_running"], default=None)
    p.add_argument("--text", default=None, help="also send this text as a user message")
    p.add_argument("--tail-s", type=float, default=6.0, help="keep listening this long after the audio ends")
    p.add_argument("--no-pace", action="store_true", help="send as fast as possible instead of in real time")
    p.add_argument("--ticks", action="store_true", help="print every metronome.tick event")
    p.set_defaults(run=run)


def read_wav(path: str) -> tuple[bytes, int]:
    with wave.open(path, "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise SystemExit(f"{path}: need 16-bit mono PCM, got {w.getnchannels()} channels x {8 * w.getsampwidth()} bit")
        return w.readframes(w.getnframes()), w.getframerate()


async def stream(args: argparse.Namespace) -> int:
    pcm, rate = read_wav(args.wav)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    chunk = rate * 2 * CHUNK_MS // 1000
    async with aiohttp.ClientSession() as http, http.ws_connect(args.url, headers=headers) as ws:
        first = json.loads((await ws.receive()).data)
        if first["type"] == "error":
            print(f"refused: {first['error']['message']}", file=sys.stderr)
            return 2
        update = {"input_audio_sample_rate": rate, **({"mode": args.mode} if args.mode else {})}
        await ws.send_json({"type": "session.update", "session": update})
        if args.text:
            await ws.send_json({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": args.text}]}})

        async def sender() -> None:
            start = time.monotonic()
            for i, offset in enumerate(range(0, len(pcm), chunk)):
                await ws.send_json({"type": "input_audio_buffer.append",
                                    "audio": base64.b64encode(pcm[offset:offset + chunk]).decode()})
                if not args.no_pace:
                    await asyncio.sleep(max(0.0, start + (i + 1) * CHUNK_MS / 1000 - time.monotonic()))
            await ws.send_json({"type": "input_audio_buffer.commit"})

        send_task = asyncio.create_task(sender())
        deadline = None
        while True:
            if send_task.done() and deadline is None:
                deadline = time.monotonic() + args.tail_s
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                msg = await asyncio.wait_for(ws.receive(), timeout=timeout if timeout is not None else 1.0)
            except asyncio.TimeoutError:
                if deadline is not None:
                    break
                continue
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            event = json.loads(msg.data)
            kind = event["type"]
            if kind == "response.output_text.delta":
                print(event["delta"], end="", flush=True)
            elif kind == "response.done":
                print()
            elif kind == "conversation.item.input_audio_transcription.delta":
                print(f"\n[heard] {event['delta']}", flush=True)
            elif kind == "error":
                print(f"\n[error] {event['error']['code']}: {event['error']['message']}", file=sys.stderr)
            elif kind == "metronome.tick" and args.ticks:
                print(f"\n[tick {event['tick']}] {event['latency_ms']:.1f} ms of {event['budget_ms']:.0f}, "
                      f"batch {event['batch']}", file=sys.stderr)
        send_task.cancel()
    print()
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(stream(args))
