"""``session.update``: what of a Realtime session a client may set, checked, applied, and shown back.

A session starts with the GA defaults: PCM16 at 24 kHz in, server VAD on (the worker adapter's own
threshold and timings), audio out, no answer cap beyond the worker's. The client may change the input
format and rate, ``turn_detection`` (server VAD parameters, or null: only ``input_audio_buffer.commit``
ends a turn), ``output_modalities`` and ``max_output_tokens``, in the GA shape or the beta one
(``protocol.SessionConfig``). Mode and instructions shape the worker session's pinned header: changing
them re-opens it (``Gateway._reopen``) and is allowed only before the first input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from metronome.serving.gateway.client_session import ClientSession
from metronome.serving.protocol import (
    DEFAULT_SAMPLE_RATE, INPUT_AUDIO_FORMATS, SUPPORTED_SAMPLE_RATES, ProtocolError, SessionConfig, TurnDetectionConfig)

@dataclass(frozen=True)
class SessionChange:
    """A checked ``session.update``: each field None (or UNSET for turn detection) where it changes nothing."""

    mode: str
    instructions: str
    rate: int | None = None
    turn_detection: TurnDetectionConfig | None | msgspec.UnsetType = msgspec.UNSET
    max_output_tokens: int | None = None
    output_modalities: tuple[str, ...] | None = None


def read_update(session: ClientSession, cfg: SessionConfig, max_instruction_bytes: int) -> SessionChange:
    """``cfg`` checked against what this server supports; ``ProtocolError`` (nothing applied) if it is not."""
    if cfg.type not in (None, "realtime"):
        raise ProtocolError("unsupported_session_type", f"session.type {cfg.type!r}; only 'realtime' is served")
    fmt = cfg.audio_format()
    if fmt not in (None, *INPUT_AUDIO_FORMATS):
        raise ProtocolError("unsupported_audio_format", f"input audio format {fmt!r}; only PCM16 ('audio/pcm', "
                            "beta 'pcm16': little-endian, mono) is supported")
    rate = cfg.sample_rate()
    if rate is not None and rate not in SUPPORTED_SAMPLE_RATES:
        raise ProtocolError("unsupported_sample_rate",
                            f"sample rate {rate} Hz; supported: {', '.join(map(str, SUPPORTED_SAMPLE_RATES))}")
    if cfg.mode not in (None, "turn", "free_running"):
        raise ProtocolError("invalid_mode", f"mode {cfg.mode!r}; use 'turn' or 'free_running'")
    turn = cfg.turn_detection_given()
    if isinstance(turn, TurnDetectionConfig):
        turn.check()
    instructions = session.instructions if cfg.instructions is None else cfg.instructions
    size = len(instructions.encode("utf-8", "surrogatepass"))
    if size > max_instruction_bytes:   # the worker counts tokens; this bounds its counting
        raise ProtocolError("instructions_too_large", f"instructions of {size} bytes > limit "
                            f"{max_instruction_bytes}; the session is unchanged")
    return SessionChange(mode=session.mode if cfg.mode is None else cfg.mode, instructions=instructions, rate=rate,
                         turn_detection=turn, max_output_tokens=cfg.output_tokens(),
                         output_modalities=cfg.modalities_given())


def apply_update(session: ClientSession, change: SessionChange) -> None:
    """Apply what a checked update sets besides mode and instructions (the re-open's)."""
    if change.rate is not None and change.rate != session.sample_rate:
        session.discard_audio()  # buffered and streamed audio was at the old rate
        session.sample_rate = change.rate
    if change.turn_detection is not msgspec.UNSET and change.turn_detection != session.turn_detection:
        session.turn_detection = change.turn_detection
        session.turn_detection_changed = True   # the worker hears of it with the next tick
    if change.max_output_tokens is not None:
        session.max_output_tokens = change.max_output_tokens
    if change.output_modalities is not None:
        session.output_modalities = change.output_modalities


def turn_detection_view(turn: TurnDetectionConfig | None) -> dict[str, Any] | None:
    if turn is None:
        return None
    return {"type": "server_vad", "threshold": turn.threshold, "prefix_padding_ms": turn.prefix_padding_ms,
            "silence_duration_ms": turn.silence_duration_ms, "create_response": turn.create_response is not False,
            "interrupt_response": turn.interrupt_response is not False}


def session_view(session: ClientSession, *, model: str, budget_ms: float, tokens_per_tick: int) -> dict[str, Any]:
    """The session as ``session.created`` / ``session.updated`` show it: GA fields, the beta names of the
    same settings, and Metronome's own (rate, mode, budget). Parameters left to the worker are null."""
    turn = turn_detection_view(session.turn_detection)
    cap = session.max_output_tokens or "inf"
    return {"type": "realtime", "object": "realtime.session", "id": session.sid, "model": model,
            "output_modalities": list(session.output_modalities), "instructions": session.instructions,
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": session.sample_rate}, "turn_detection": turn},
                      "output": {"format": {"type": "audio/pcm", "rate": DEFAULT_SAMPLE_RATE}}},
            "max_output_tokens": cap,
            "input_audio_format": "pcm16", "turn_detection": turn, "max_response_output_tokens": cap,
            "input_audio_sample_rate": session.sample_rate, "mode": session.mode or "default",
            "budget_ms": budget_ms, "tokens_per_tick": tokens_per_tick}
