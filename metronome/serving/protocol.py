"""Wire schemas: the OpenAI-Realtime subset clients speak to the gateway (msgspec, decoded in one pass).

Client → server events accepted (unknown fields are ignored, as OpenAI clients send many)::

    {"type": "session.update", "session": {"type": "realtime", "instructions": "...",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}},
        "output_modalities": ["audio"], "max_output_tokens": 200, "mode": "turn"}}
    (the beta shape too: "input_audio_format": "pcm16", "turn_detection", "max_response_output_tokens")
    {"type": "input_audio_buffer.append", "audio": "<base64 PCM16 mono little-endian>"}
    {"type": "input_audio_buffer.commit"}     {"type": "input_audio_buffer.clear"}
    {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                   "content": [{"type": "input_text", "text": "hi"}]}}
    {"type": "response.create", "response": {"max_output_tokens": 50}}     {"type": "response.cancel"}

>>> decode_client_event(b'{"type": "input_audio_buffer.commit"}')
InputAudioBufferCommit(event_id=None)
>>> decode_client_event(b'{"type": "nope"}')
Traceback (most recent call last):
...
metronome.serving.protocol.ProtocolError: unknown_event: unknown event type 'nope'
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

SUPPORTED_SAMPLE_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
# Arrays and objects nested deeper than this are refused before any parse: the decoders recurse, and a
# message of 100k brackets would otherwise end in a RecursionError. Realtime events nest 4-5 levels.
MAX_NESTING = 32
ECHO_TEXT_CHARS = 1024  # conversation.item.created echoes at most this much of a user message's text
DEFAULT_SAMPLE_RATE = 24000   # the Realtime API's PCM16 rate when the session names none
INPUT_AUDIO_FORMATS = ("pcm16", "audio/pcm")   # beta and GA names of little-endian PCM16 mono
MAX_OUTPUT_TOKENS = 4096      # the largest answer cap a client may ask for (the adapter caps it further)
MAX_TURN_DETECTION_MS = 10_000


class ProtocolError(ValueError):
    """A client event that cannot be accepted; ``code`` goes into the error event."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class AudioRate(msgspec.Struct):
    rate: int | None = None
    type: str | None = None


class TurnDetectionConfig(msgspec.Struct, omit_defaults=True):
    """``turn_detection``: server VAD and its parameters (None: the server's default); null on the wire turns it off."""

    type: str = "server_vad"
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None
    create_response: bool | None = None      # None: true
    interrupt_response: bool | None = None   # None: true

    def check(self) -> None:
        if self.type not in ("server_vad", "semantic_vad"):
            raise ProtocolError("invalid_turn_detection", f"turn_detection.type {self.type!r}; use 'server_vad' or null")
        if self.threshold is not None and not 0.0 < self.threshold < 1.0:
            raise ProtocolError("invalid_turn_detection", f"threshold {self.threshold}; it must be in (0, 1)")
        for name in ("prefix_padding_ms", "silence_duration_ms"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TURN_DETECTION_MS:
                raise ProtocolError("invalid_turn_detection", f"{name} {value}; it must be in [0, {MAX_TURN_DETECTION_MS}]")


class AudioInput(msgspec.Struct):
    format: AudioRate | None = None
    turn_detection: TurnDetectionConfig | None | msgspec.UnsetType = msgspec.UNSET


class AudioConfig(msgspec.Struct):
    input: AudioInput | None = None


# ``max_output_tokens`` / ``max_response_output_tokens``: a count, or "inf" (the server's own cap).
MaxTokens = Union[int, str, None, msgspec.UnsetType]


def max_tokens(value: MaxTokens) -> int | None:
    """The cap a client asked for: a count, 0 for "inf" (the server's own), None when not given."""
    if value is msgspec.UNSET or value is None:
        return None
    if value == "inf":
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_OUTPUT_TOKENS:
        return value
    raise ProtocolError("invalid_max_output_tokens",
                        f"max_output_tokens {value!r}; use 1-{MAX_OUTPUT_TOKENS} or \"inf\"")


def modalities(value: list[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not value or any(m not in ("text", "audio") for m in value):
        raise ProtocolError("invalid_modalities", f"output modalities {value!r}; use [\"audio\"] or [\"text\"]")
    return tuple(value)


class SessionConfig(msgspec.Struct):
    """``session.update``'s session: the GA shape (``type``, ``audio.input``, ``output_modalities``,
    ``max_output_tokens``) or the beta one (``input_audio_format``, ``turn_detection``, ``modalities``,
    ``max_response_output_tokens``); where both name a setting the GA one wins."""

    type: str | None = None
    instructions: str | None = None
    input_audio_format: str | None = None
    input_audio_sample_rate: int | None = None  # Metronome extension; GA clients use audio.input.format.rate
    audio: AudioConfig | None = None
    turn_detection: TurnDetectionConfig | None | msgspec.UnsetType = msgspec.UNSET
    output_modalities: list[str] | None = None
    modalities: list[str] | None = None
    max_output_tokens: MaxTokens = msgspec.UNSET
    max_response_output_tokens: MaxTokens = msgspec.UNSET
    mode: str | None = None                     # Metronome extension: "turn" or "free_running"

    def sample_rate(self) -> int | None:
        if self.input_audio_sample_rate is not None:
            return self.input_audio_sample_rate
        if self.audio and self.audio.input and self.audio.input.format:
            return self.audio.input.format.rate
        return None

    def audio_format(self) -> str | None:
        """The input format named, as the beta string ("pcm16") or the GA type ("audio/pcm")."""
        if self.audio and self.audio.input and self.audio.input.format and self.audio.input.format.type:
            return self.audio.input.format.type
        return self.input_audio_format

    def turn_detection_given(self) -> TurnDetectionConfig | None | msgspec.UnsetType:
        if self.audio and self.audio.input and self.audio.input.turn_detection is not msgspec.UNSET:
            return self.audio.input.turn_detection
        return self.turn_detection

    def output_tokens(self) -> int | None:
        given = max_tokens(self.max_output_tokens)
        return given if given is not None else max_tokens(self.max_response_output_tokens)

    def modalities_given(self) -> tuple[str, ...] | None:
        return modalities(self.output_modalities if self.output_modalities is not None else self.modalities)


class ResponseConfig(msgspec.Struct):
    """``response.create``'s response: what of it this server applies to the one response."""

    output_modalities: list[str] | None = None
    modalities: list[str] | None = None
    max_output_tokens: MaxTokens = msgspec.UNSET
    max_response_output_tokens: MaxTokens = msgspec.UNSET

    def output_tokens(self) -> int | None:
        given = max_tokens(self.max_output_tokens)
        return given if given is not None else max_tokens(self.max_response_output_tokens)

    def modalities_given(self) -> tuple[str, ...] | None:
        return modalities(self.output_modalities if self.output_modalities is not None else self.modalities)


class _Event(msgspec.Struct, tag_field="type"):
    event_id: str | None = None


class SessionUpdate(_Event, tag="session.update"):
    session: SessionConfig = msgspec.field(default_factory=SessionConfig)


class InputAudioBufferAppend(_Event, tag="input_audio_buffer.append"):
    audio: bytes = b""  # base64 on the wire; msgspec decodes (and validates) it in the same pass


class InputAudioBufferCommit(_Event, tag="input_audio_buffer.commit"):
    pass


class InputAudioBufferClear(_Event, tag="input_audio_buffer.clear"):
    pass


class ConversationItemCreate(_Event, tag="conversation.item.create"):
    item: dict[str, Any] = msgspec.field(default_factory=dict)

    def text(self) -> str:
        """The concatenated input_text parts of a user message (the only item kind accepted)."""
        if self.item.get("type", "message") != "message" or self.item.get("role", "user") != "user":
            raise ProtocolError("unsupported_item", "only user messages can be added to the conversation")
        parts = self.item.get("content") or []
        if not isinstance(parts, list):
            raise ProtocolError("invalid_item", "item.content must be a list of content parts")
        texts = [p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") in ("input_text", "text")]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ProtocolError("unsupported_item", "a message needs at least one input_text part")
        return "".join(texts)

    def echo(self, text: str) -> dict[str, Any]:
        """The item for ``conversation.item.created``: rebuilt from its text, cut to ``ECHO_TEXT_CHARS``.

        Not the client's item as sent: that may carry up to a whole message of anything (unknown fields
        are accepted), and echoing it doubles what a client that does not read holds of server memory.
        """
        item_id = self.item.get("id")
        item: dict[str, Any] = {"type": "message", "role": "user",
                                "content": [{"type": "input_text", "text": text[:ECHO_TEXT_CHARS]}]}
        if isinstance(item_id, str) and len(item_id) <= 64:
            item["id"] = item_id
        if len(text) > ECHO_TEXT_CHARS:
            item["truncated"] = True  # Metronome extension: the worker got all of it
        return item


class ResponseCreate(_Event, tag="response.create"):
    response: ResponseConfig | None = None


class ResponseCancel(_Event, tag="response.cancel"):
    pass


ClientEvent = Union[SessionUpdate, InputAudioBufferAppend, InputAudioBufferCommit, InputAudioBufferClear,
                    ConversationItemCreate, ResponseCreate, ResponseCancel]
_KNOWN_TYPES = {cls.__struct_config__.tag for cls in ClientEvent.__args__}
_decoder = msgspec.json.Decoder(ClientEvent)


class _Typed(msgspec.Struct):
    """Just an event's ``type`` (every other field is skipped): what a refused event claimed to be."""

    type: Any = None


_type_decoder = msgspec.json.Decoder(_Typed)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_within(data: bytes, limit: int = MAX_NESTING) -> bool:
    """Whether JSON ``data`` nests arrays and objects at most ``limit`` deep (up to ``2 * limit`` may pass):
    C-speed byte operations, no recursion, brackets inside strings ignored.

    >>> nesting_within(b'{"a": [[1], "]]]]"]}', 2), nesting_within(b"[" * 100_000, 32)
    (True, False)
    """
    if data.count(b"[") + data.count(b"{") <= limit:
        return True   # the hot path: an audio append has one brace
    # Drop escaped backslashes, then escaped quotes, so the quotes left delimit strings; keep what is outside them.
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(plain.split(b'"')[0::2]).translate(None, _NOT_BRACKETS)
    for _ in range(limit):   # each pass removes at least the innermost level
        if not brackets:
            return True
        inner_gone = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if inner_gone == brackets:
            return False     # mismatched brackets: malformed, refused all the same
        brackets = inner_gone
    return not brackets


def decode_client_event(data: bytes | str) -> ClientEvent:
    """One client event; ``ProtocolError`` for anything that is not a well-formed known event."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if not nesting_within(raw):
        raise ProtocolError("nested_too_deep", f"JSON nested deeper than {MAX_NESTING} levels")
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        if isinstance(exc, msgspec.ValidationError):
            try:
                kind = _type_decoder.decode(raw).type
            except msgspec.DecodeError:
                kind = None
            if isinstance(kind, str) and kind not in _KNOWN_TYPES:
                raise ProtocolError("unknown_event", f"unknown event type {kind!r}") from None
            if kind == "input_audio_buffer.append" and "$.audio" in str(exc):
                raise ProtocolError("invalid_audio", f"audio must be base64 PCM16: {exc}") from None
            raise ProtocolError("invalid_event", str(exc)) from None
        raise ProtocolError("invalid_json", f"malformed JSON: {exc}") from None


encode = msgspec.json.Encoder().encode


def error_event(code: str, message: str, *, type: str = "invalid_request_error",
                event_id: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type, "code": code, "message": message, "event_id": event_id}}
