"""One WebSocket client's state at the gateway: buffered input until the next tick, outgoing queue.

Everything here is touched only from the gateway's event loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.protocol import DEFAULT_SAMPLE_RATE, encode


@dataclass
class TokenBucket:
    """Sustained ``rate`` events/s with bursts of ``burst``; ``take()`` is False when over the limit."""

    rate: float
    burst: float
    tokens: float = -1.0
    stamp: float = field(default_factory=time.monotonic)

    def take(self) -> bool:
        now = time.monotonic()
        if self.tokens < 0:
            self.tokens = self.burst
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class ClientSession:
    _response_ids = itertools.count(1)

    def __init__(self, sid: str, worker_name: str, *, max_buffered_audio_s: float,
                 send_queue_events: int, max_messages_per_s: float) -> None:
        self.sid = sid
        self.worker_name = worker_name
        self.max_buffered_audio_s = max_buffered_audio_s
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.mode = ""
        self.instructions = ""
        self.audio = bytearray()
        self.new_turn = False
        self.texts: list[str] = []
        self.cancel = False
        self.response_id: str | None = None
        self.outbox: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=send_queue_events)
        self.rate = TokenBucket(rate=max_messages_per_s, burst=2 * max_messages_per_s)
        self.closed = False
        self.close_reason: str | None = None
        # Ticked only once the client sent input: until then session.update may still change the
        # mode and instructions (the worker session is re-opened with them).
        self.started = False

    # ------------------------------------------------------------------ input
    @property
    def sample_rate(self) -> int:
        return self._sample_rate

    @sample_rate.setter
    def sample_rate(self, rate: int) -> None:
        self._sample_rate = rate
        self.max_audio_bytes = int(self.max_buffered_audio_s * rate) * 2

    def append_audio(self, pcm16: bytes) -> bool:
        """Buffer audio for the next tick; False (nothing buffered) when the buffer would overflow."""
        if len(self.audio) + len(pcm16) > self.max_audio_bytes:
            return False
        self.audio += pcm16
        self.started = True
        return True

    def take_tick_input(self) -> pb.SessionInput:
        """Everything buffered since the last tick, as one SessionInput; the buffers start empty again."""
        inp = pb.SessionInput(sid=self.sid, new_turn=self.new_turn, audio_pcm16=bytes(self.audio),
                              sample_rate=self.sample_rate, text="".join(self.texts), cancel=self.cancel)
        self.audio.clear()
        self.texts.clear()
        self.new_turn = self.cancel = False
        return inp

    # ------------------------------------------------------------------ output
    def send(self, event: dict[str, Any]) -> bool:
        """Queue an event; a client whose queue is full is not reading: it gets disconnected."""
        if self.closed:
            return False
        try:
            self.outbox.put_nowait(encode(event))
            return True
        except asyncio.QueueFull:
            self.close("slow_consumer")
            return False

    def close(self, reason: str) -> None:
        """Ask the writer to finish: it drains nothing more and closes the socket."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        while True:  # make room for the sentinel even when the queue is full
            try:
                self.outbox.put_nowait(None)
                return
            except asyncio.QueueFull:
                self.outbox.get_nowait()

    def start_response(self) -> str:
        self.response_id = f"resp_{next(self._response_ids)}"
        return self.response_id
