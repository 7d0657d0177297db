"""One WebSocket client's state at the gateway: input buffered until the next tick, and its way out.

Everything here is touched only from the gateway's event loop, so no locks are needed. Outgoing
events go to a ``Connection`` (the WebSocket transport, ``ws_picows`` or ``ws_aiohttp``): it writes
at once and keeps at most ``send_queue_events`` events waiting while the client does not read;
``send`` returning False means that bound was hit, and the session ends as ``slow_consumer``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.gateway.response import Response, ResponseRequest
from metronome.serving.protocol import DEFAULT_SAMPLE_RATE, TurnDetectionConfig, encode


@dataclass(slots=True)
class TokenBucket:
    """Sustained ``rate`` events/s with bursts of ``burst``; ``take()`` is False when over the limit.

    Called for every client event, so it is kept to one clock read and a few float operations.
    """

    rate: float
    burst: float
    tokens: float = -1.0  # -1: start full
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.burst

    def take(self, n: float = 1.0) -> bool:
        now = time.monotonic()
        tokens = self.tokens + (now - self.stamp) * self.rate
        if tokens > self.burst:
            tokens = self.burst
        self.stamp = now
        if tokens >= n:
            self.tokens = tokens - n
            return True
        self.tokens = tokens
        return False

    def has(self, n: float) -> bool:
        """Whether ``take(n)`` would succeed now (nothing is taken)."""
        return min(self.burst, self.tokens + (time.monotonic() - self.stamp) * self.rate) >= n


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def step_request_wire(entries: list[list[bytes]], tokens_per_tick: int, tick: int, *,
                      speech_ahead: bool = False) -> bytes:
    """A serialised ``StepRequest`` from ``take_tick_wire`` entries (send it with an identity serializer)."""
    parts = [part for entry in entries for part in entry]
    if tokens_per_tick:
        parts += [b"\x10", _varint(tokens_per_tick)]
    if tick:
        parts += [b"\x18", _varint(tick)]
    if speech_ahead:
        parts.append(b"\x20\x01")
    return b"".join(parts)


class Connection(Protocol):
    """What a session needs from its WebSocket: write a text frame, close with a code."""

    def send(self, data: bytes) -> bool:
        """Write one text frame now or queue it; False: the bounded queue is full (a slow reader)."""
        ...

    def send_many(self, data: list[bytes]) -> bool:
        """``send`` for several frames, in order, written at once; False as for ``send``."""
        ...

    def close(self, code: int, reason: str) -> None:
        """Send a close frame with ``code`` and end the connection (idempotent)."""
        ...


# Close codes by close reason; any other reason closes with 1000. 1008 (policy violation): the client's
# fault. 1012 (service restart, RFC 6455's IANA registry): the worker serving the session went away and is
# being restarted; the registry says a client may reconnect after a randomised 5-30 s, and reconnecting
# WebSocket clients treat 1012 (and 1011, 1013) as retryable where 1000 means "done".
CLOSE_CODES = {"slow_consumer": 1008, "flood": 1008, "abuse": 1008, "worker_unavailable": 1012,
               "worker_draining": 1012, "server_draining": 1001}


def turn_detection_message(turn: TurnDetectionConfig | None) -> pb.TurnDetection:
    """``SessionInput.turn_detection`` for the client's setting; None: no server VAD (commits end turns)."""
    if turn is None:
        return pb.TurnDetection(server_vad=False, create_response=True, interrupt_response=True)
    return pb.TurnDetection(server_vad=True, threshold=turn.threshold, prefix_padding_ms=turn.prefix_padding_ms,
                            silence_duration_ms=turn.silence_duration_ms,
                            create_response=turn.create_response is not False,
                            interrupt_response=turn.interrupt_response is not False)


def turn_detection_wire(turn: TurnDetectionConfig | None) -> bytes:
    """``turn_detection_message`` as its wire field (10, length-delimited) of a ``SessionInput``."""
    body = turn_detection_message(turn).SerializeToString()
    return b"\x52" + _varint(len(body)) + body


class ClientSession:
    def __init__(self, sid: str, worker_name: str, conn: Connection, *, max_buffered_audio_s: float,
                 max_messages_per_s: float, max_text_bytes: int = 32 << 10, audio_realtime_factor: float = 2.0,
                 abuse_strikes: int = 3, abuse_window_s: float = 10.0) -> None:
        self.sid = sid
        self.worker_name = worker_name
        self.conn = conn
        self.max_buffered_audio_s = max_buffered_audio_s
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.mode = ""
        self.instructions = ""
        self.audio: list[bytes] = []   # the chunks since the last tick, joined once per tick (one copy)
        self.audio_bytes = 0
        self.streamed_audio_bytes = 0  # already sent this tick (StreamStep): still counted by the bounds
        self.streamed_text_bytes = 0
        self.audio_discarded = False   # the client cleared its audio: the next entry says clear_audio
        self.clear_streamed = False    # this tick's clear went out on the stream (sent again if the stream is lost)
        self.commit_mark: int | None = None   # chunks of ``audio`` before this tick's commit (None: no commit)
        self.new_turn = False
        self.texts: list[str] = []
        self.text_bytes = 0            # UTF-8 bytes in ``texts``: at most ``max_text_bytes`` per tick
        self.max_text_bytes = max_text_bytes
        self.cancel = False
        # Realtime settings (``session_update.py`` applies the client's; the worker hears of a change once).
        self.turn_detection: TurnDetectionConfig | None = TurnDetectionConfig()
        self.turn_detection_changed = False
        self.max_output_tokens = 0            # the session's answer cap; 0: the worker's own
        self.output_modalities: tuple[str, ...] = ("audio",)
        # The response being streamed (``responses.py``), and the cap and modalities response.create set for the next.
        self.response: Response | None = None
        self.next_response: ResponseRequest | None = None
        self.cancelling = False               # a cancel is on its way to the worker: its answer's output is dropped
        self.input_item_id: str | None = None  # the user turn the VAD is hearing (speech_started .. its commit)
        # The user turn committed last, until its transcript comes (Whisper works beside the worker's tick, so
        # the next turn may have started by then).
        self.committed_item_id: str | None = None
        self.input_tokens = 0                 # tokens the worker took in since the last response ended (usage)
        self.rate = TokenBucket(rate=max_messages_per_s, burst=2 * max_messages_per_s)
        self.strikes = 0  # consecutive events over the rate limit (a flood closes the session)
        # Seconds of audio: real time times the factor, after a burst of a whole buffer.
        self.audio_rate = TokenBucket(rate=audio_realtime_factor, burst=max_buffered_audio_s)
        # Refused oversized input: the abuse_strikes-th within abuse_window_s of the others closes the session.
        self.refusals = TokenBucket(rate=1.0 / abuse_window_s, burst=abuse_strikes - 1)
        self.closed = False
        self.close_reason: str | None = None
        self._events = 0                       # server events sent (their event_id)
        self.logged_codes: set[str] = set()   # error codes already logged for this session (each once)
        # Ticked only once the client sent input: until then session.update may still change the
        # mode and instructions (the worker session is re-opened with them).
        self.started = False
        # A session.update re-opening the worker session is in flight: the gateway's release waits for it.
        self.reopening = False

    # ------------------------------------------------------------------ input
    @property
    def sample_rate(self) -> int:
        return self._sample_rate

    @sample_rate.setter
    def sample_rate(self, rate: int) -> None:
        self._sample_rate = rate
        self.max_audio_bytes = int(self.max_buffered_audio_s * rate) * 2

    @property
    def idle_s(self) -> float:
        """Seconds since the client's last event (the rate limiter's clock reads once per event)."""
        return time.monotonic() - self.rate.stamp

    def strike(self) -> bool:
        """Count one refusal of oversized input; True when it is one too many (the client is abusing)."""
        return not self.refusals.take()

    def audio_too_fast(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more PCM16 would run over the session's real-time audio budget."""
        return not self.audio_rate.take(nbytes / (2 * self._sample_rate))

    def append_audio(self, pcm16: bytes) -> bool:
        """Buffer audio for the next tick; False (nothing buffered) when the buffer would overflow."""
        size = self.audio_bytes + len(pcm16)
        if self.streamed_audio_bytes + size > self.max_audio_bytes:
            return False
        self.audio.append(pcm16)
        self.audio_bytes = size
        self.started = True
        return True

    def clear_audio(self) -> None:
        self.audio.clear()
        self.audio_bytes = 0

    def commit(self) -> None:
        """The client committed its audio (``input_audio_buffer.commit``): its turn ends with this tick."""
        self.new_turn = self.started = True
        self.commit_mark = len(self.audio)

    def discard_audio(self) -> None:
        """Drop the session's uncommitted audio (a clear, a rate change): the tick's so far, what was already
        streamed to the worker, and what the worker's VAD holds (the next entry says clear_audio).

        After a commit in this tick only the audio that came after the commit goes (the worker flushes the
        rest as the committed turn); audio streamed since the commit stays with it."""
        if self.commit_mark is not None:
            del self.audio[self.commit_mark:]
            self.audio_bytes = sum(map(len, self.audio))
            return
        self.clear_audio()
        self.audio_discarded = True
        self.streamed_audio_bytes = 0

    @property
    def has_unsent_input(self) -> bool:
        """Audio, text or a clear that the worker has not been sent yet this tick."""
        return bool(self.audio_bytes or self.texts or self.audio_discarded)

    @property
    def streamed(self) -> bool:
        """Input of this tick is already on the worker's stream (or must be cleared there)."""
        return bool(self.streamed_audio_bytes or self.streamed_text_bytes or self.audio_discarded)

    def append_text(self, text: str) -> bool:
        """Buffer user text for the next tick; False (nothing buffered) when the tick's text would overflow.

        Why a bound: text is otherwise limited only per message, and a client sending many 1 MiB items in
        one tick would make the Step bigger than the worker accepts (and fail every session on it).
        """
        size = self.text_bytes + len(text.encode("utf-8", "surrogatepass"))
        if self.streamed_text_bytes + size > self.max_text_bytes:
            return False
        self.texts.append(text)
        self.text_bytes = size
        self.started = True
        return True

    def clear_text(self) -> None:
        self.texts.clear()
        self.text_bytes = 0

    @property
    def tick_bytes(self) -> int:
        """About how many bytes this session adds to the next Step (its input plus framing)."""
        return self.audio_bytes + self.text_bytes + 64

    def take_stream_wire(self) -> list[bytes] | None:
        """The audio and text buffered since the last take, as a ``StepRequest.sessions`` entry of a StreamStep
        message before the tick's last (commit, cancel and the answer cap go with the last; a change of turn
        detection with the first entry after it, ahead of that entry's audio); None when nothing is buffered.

        The tick's input bounds count what was streamed, so streaming does not lift them.
        """
        if not self.has_unsent_input:
            return None
        if self.commit_mark is not None:
            self.commit_mark = 0   # what was committed and what followed go out together
        self.streamed_audio_bytes += self.audio_bytes
        self.streamed_text_bytes += self.text_bytes
        return self._take_wire(controls=False)

    def take_name_wire(self) -> list[bytes]:
        """An entry naming the session in a tick's last message with none of its buffered input (which waits
        for a later tick), so that what it streamed this tick is used rather than dropped."""
        parts = self._entry_wire([], 0, b"", controls=False)
        self.forget_streamed()
        return parts

    def forget_streamed(self, lost: bool = False) -> None:
        """The tick's streamed input is used or ``lost``: the bounds count from zero again. A clear lost with
        the stream goes again with the next entry (the worker's VAD may still hold audio it drops)."""
        self.streamed_audio_bytes = self.streamed_text_bytes = 0
        if lost and self.clear_streamed:
            self.audio_discarded = True
        self.clear_streamed = False

    def take_tick_wire(self) -> list[bytes]:
        """``take_tick_input``, already in protobuf wire format: one ``StepRequest.sessions`` entry, in parts.

        For ``step_request_wire``: the audio chunks go into the request as they are, so a whole Step is
        one ``b"".join`` instead of a message per session, a copy into the request and a serialisation
        (about half the build + send time of a large tick; docs/benchmarks/gateway.md).
        """
        parts = self._take_wire(controls=True)
        self.forget_streamed()
        return parts

    def _take_wire(self, controls: bool) -> list[bytes]:
        parts = self._entry_wire(self.audio, self.audio_bytes, "".join(self.texts).encode(), controls)
        self.clear_audio()
        self.clear_text()
        if controls:
            self.new_turn = self.cancel = False
            self.commit_mark = None
        return parts

    def _entry_wire(self, audio: list[bytes], audio_bytes: int, text: bytes, controls: bool) -> list[bytes]:
        sid = self.sid.encode()
        head = [b"\x0a", _varint(len(sid)), sid]
        if controls and self.new_turn:
            head.append(b"\x10\x01")
        if audio_bytes:
            head += [b"\x1a", _varint(audio_bytes)]
        tail = [b"\x20", _varint(self.sample_rate)]
        if text:
            tail += [b"\x2a", _varint(len(text)), text]
        if controls and self.cancel:
            tail.append(b"\x30\x01")
        if controls:
            cap = self.answer_cap
            if cap:
                tail += [b"\x48", _varint(cap)]
        if self.turn_detection_changed:   # streamed too: a worker that hears audio as it comes applies it in order
            tail.append(turn_detection_wire(self.turn_detection))
            self.turn_detection_changed = False
        if self.audio_discarded:
            tail.append(b"\x40\x01")
            self.audio_discarded = False
            self.clear_streamed = not controls
        head_b, tail_b = b"".join(head), b"".join(tail)
        return [b"\x0a" + _varint(len(head_b) + audio_bytes + len(tail_b)) + head_b, *audio, tail_b]

    @property
    def answer_cap(self) -> int:
        """The cap on the answer in progress (or the next): response.create's, else the session's; 0: none."""
        if self.response is not None and self.response.max_output_tokens:
            return self.response.max_output_tokens
        if self.next_response is not None and self.next_response.max_output_tokens:
            return self.next_response.max_output_tokens
        return self.max_output_tokens

    def take_tick_input(self) -> pb.SessionInput:
        """Everything buffered since the last tick, as one SessionInput; the buffers start empty again."""
        inp = pb.SessionInput(sid=self.sid, new_turn=self.new_turn, audio_pcm16=b"".join(self.audio),
                              sample_rate=self.sample_rate, text="".join(self.texts), cancel=self.cancel,
                              clear_audio=self.audio_discarded, max_output_tokens=self.answer_cap)
        if self.turn_detection_changed:
            inp.turn_detection.CopyFrom(turn_detection_message(self.turn_detection))
            self.turn_detection_changed = False
        self.audio_discarded = False
        self.forget_streamed()
        self.clear_audio()
        self.clear_text()
        self.new_turn = self.cancel = False
        self.commit_mark = None
        return inp

    # ------------------------------------------------------------------ output
    def _stamped(self, event: dict[str, Any]) -> bytes:
        """``event`` encoded with its server ``event_id`` (every Realtime server event has one)."""
        if event.get("event_id") is None:
            self._events += 1
            event["event_id"] = f"event_{self._events}"
        return encode(event)

    def send(self, event: dict[str, Any]) -> bool:
        """Send an event; a client whose send queue is full is not reading: it gets disconnected."""
        if self.closed:
            return False
        if self.conn.send(self._stamped(event)):
            return True
        self.close("slow_consumer")
        return False

    def send_all(self, events: list[dict[str, Any]]) -> bool:
        """Send a tick's events together: one socket write for all of them (the fan-out's cost is writes)."""
        if self.closed:
            return False
        if self.conn.send_many([self._stamped(e) for e in events]):
            return True
        self.close("slow_consumer")
        return False

    def close(self, reason: str) -> None:
        """End the session: nothing more is sent after the close frame (its code: ``CLOSE_CODES``)."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self.conn.close(CLOSE_CODES.get(reason, 1000), reason)

    def disconnected(self) -> None:
        """The socket is gone (the client left, or our close completed): mark closed, send nothing."""
        if not self.closed:
            self.closed = True
            self.close_reason = "client_closed"
