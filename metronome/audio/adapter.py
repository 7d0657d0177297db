"""The interface between the worker and whatever turns audio into model input.

An *interaction adapter* owns everything model-specific about a session's input and output: how
a tick of audio becomes tokens or embeddings (an energy quantiser today; an ASR cascade or an omni
model's audio encoder later), how chat turns are framed, when the model should speak, and how its
tokens become text. The worker owns the transport, resampling and the engine; it calls, per tick::

    prepared = adapter.prepare([TickAudio(...), ...])          # one call for the whole batch
    outputs  = engine.step([StepInput(eid, p.token_ids, p.embeds, p.max_new_tokens, ...)])
    text     = adapter.on_output(sid, out.token_ids, out.finished)   # per session

``prepare`` is batched on purpose: an ASR or audio encoder runs once over every session's chunk.
All methods are called from one thread (the worker's engine thread), so adapters need no locks.

Every adapter keeps per-session state bounded (carried partial frames, detokeniser tail) and frees
it in ``close_session``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch


@dataclass(frozen=True)
class AdapterContext:
    """What an adapter may use of the worker's engine (the audio layer never imports the engine).

    ``embed`` maps token ids [n] (long, on ``device``) to the decoder's input embeddings [n, hidden],
    so adapters can splice audio-encoder outputs between embedded text tokens. ``compute_logits`` maps
    final hidden states [n, hidden] to the decoder's vocabulary logits (adapters that run their own
    heads, like Moshi's, share it instead of loading a second copy). ``checkpoint`` is the model's
    directory (omni adapters load their audio encoders from it); ``None`` for models built in memory.
    ``quantization``: the engine's (``EngineConfig.quantization``); with ``"fp8"`` the omni adapters hold their
    audio towers' linear layers in FP8 too (``omni/tower_fp8.py``).
    """

    tokenizer: Any
    checkpoint: Path | None
    embed: Callable[[torch.Tensor], torch.Tensor]
    device: torch.device
    dtype: torch.dtype
    max_input_tokens: int
    budget_ms: float
    compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
    voice: str = "auto"     # speech out for adapters that speak text answers ("none": text only)
    quantization: str | None = None


@dataclass(frozen=True)
class TurnDetection:
    """How a session's user turns end (the Realtime API's ``turn_detection``); None fields: the adapter's default.

    ``server_vad`` False: only ``TickAudio.new_turn`` (the client's commit) ends a turn; the VAD still
    reports where speech starts and stops. ``create_response`` False: a turn the VAD ended joins the
    conversation unanswered until ``new_turn``. ``interrupt_response``: speech during an answer ends it.
    """

    server_vad: bool = True
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None
    create_response: bool = True
    interrupt_response: bool = True


@dataclass
class TickAudio:
    """One session's input for one tick.

    ``pcm`` is float32 mono at ``adapter.sample_rate`` (the worker has decoded and resampled it),
    possibly empty. ``max_tokens`` is how many tokens the session may decode this tick.
    """

    session_id: str
    pcm: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    new_turn: bool = False   # the user finished speaking / asked for a response
    text: str = ""           # a typed user message, if any
    cancel: bool = False     # stop the current response
    clear_buffer: bool = False   # the client cleared its input audio before this tick's ``pcm``: drop the rest
    max_tokens: int = 0
    max_output_tokens: int = 0   # cap on the answer in progress (0: the adapter's own)
    turn_detection: TurnDetection | None = None   # set on the tick the client changed it; kept until the next


@dataclass
class PreparedInput:
    """What the adapter wants the engine to do for one session this tick.

    At most one of ``token_ids`` / ``embeds`` ([n, hidden]) is set; both ``None`` means no new input
    (the session only decodes, or idles when ``max_new_tokens`` is 0). ``error`` set means the
    adapter refused this session's input for this tick (the worker reports it and skips the engine);
    the adapter must leave the session usable for later ticks.
    """

    token_ids: list[int] | None = None
    embeds: torch.Tensor | None = None
    max_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    transcript: str = ""     # input transcription delta (empty for adapters without ASR)
    error: str | None = None
    # The response ends after this tick's decode even without a stop token (the adapter's length cap):
    # the worker reports it as finished, so clients get their response.done.
    ends_response: bool = False
    # The response was cut short (barge-in: the user started speaking over it); its untaken audio is dropped.
    cancelled: bool = False
    # Ask the engine for the last input position's hidden state (``InteractionAdapter.on_hidden``):
    # for models whose own output heads run in the adapter, e.g. Moshi's depth transformer.
    return_hidden: bool = False
    # ``embeds`` are finite by construction, made from no client-supplied floats (``StepInput.embeds_finite``:
    # the engine does not check them, and a NaN let through ruins the session's cache).
    embeds_finite: bool = False
    # Where the VAD heard the user's speech start / stop this tick (ms into the session's input audio).
    speech_started_ms: int | None = None
    speech_stopped_ms: int | None = None

    @property
    def num_tokens(self) -> int:
        if self.token_ids is not None:
            return len(self.token_ids)
        if self.embeds is not None:
            return int(self.embeds.shape[0])
        return 0


class InteractionAdapter(ABC):
    """Turns a session's audio/text into engine input and the engine's tokens into text.

    Class attributes every adapter sets: ``name`` (what ``WorkerConfig.adapter`` selects),
    ``sample_rate`` (the rate ``TickAudio.pcm`` arrives at), ``modes`` (the interaction modes it
    supports, e.g. ``("turn", "free_running")``) and ``default_mode`` (used when a session asks for "").
    """

    name: str
    sample_rate: int
    modes: tuple[str, ...]
    default_mode: str

    @abstractmethod
    def open_session(self, session_id: str, mode: str, instructions: str) -> None:
        """Create the session's state. Raises ``ValueError`` (with a message for the client) for an
        unsupported mode or instructions that cannot fit; nothing is kept then."""

    @abstractmethod
    def close_session(self, session_id: str) -> None:
        """Free the session's state. Unknown ids are ignored (closing is idempotent)."""

    @abstractmethod
    def prepare(self, batch: list[TickAudio]) -> list[PreparedInput]:
        """One ``PreparedInput`` per ``TickAudio``, in order. Unknown sessions get an ``error``."""

    @abstractmethod
    def on_output(self, session_id: str, token_ids: list[int], finished: bool) -> str:
        """Record the tokens decoded for a session this tick; return the new text (a UTF-8-safe delta:
        a character split across tokens is held back until it is complete)."""

    @abstractmethod
    def input_tokens_per_tick(self, budget_ms: float) -> int:
        """Tokens one tick of steady audio produces (audio plus turn framing; not the first tick's
        system prompt or typed text). The worker checks that the engine's ``max_chunk_tokens`` covers it."""

    # Sample rate of the audio the adapter speaks (``take_audio``); 0: text only.
    output_sample_rate: int = 0
    # The adapter takes a session's audio as it streams in (``hear``), not in ``TickAudio.pcm`` at the tick: its
    # speech front end works beside the tick, so audio heard sooner is answered sooner.
    hears_early: bool = False
    # Speech is made beside the tick and may be ready between ticks (``on_speech_ready``): the worker sends it then.
    speaks_between_ticks: bool = False

    def hear(self, session_id: str, pcm: np.ndarray, *, clear: bool = False,
             turn_detection: TurnDetection | None = None) -> str | None:
        """Adapters with ``hears_early``: one streamed piece of the session's input, in the order the client sent
        it: ``turn_detection`` applies from this piece's audio on, ``clear`` drops the uncommitted audio before it,
        then ``pcm`` (at ``sample_rate``, may be empty). Returns a message for the client when the turn detection
        is refused (the piece's audio is still heard). The tick's ``TickAudio`` then carries no audio, clear or
        turn detection of its own."""
        raise NotImplementedError(f"the {self.name} adapter takes its audio at the tick")

    def on_hidden(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Hidden states ([hidden]) of the sessions whose ``PreparedInput.return_hidden`` was set, one
        call per tick, before their ``on_output``. Adapters that never ask for them need not override."""
        raise NotImplementedError(f"the {self.name} adapter does not take hidden states")

    def take_audio(self, session_id: str) -> bytes:
        """PCM16 mono at ``output_sample_rate`` produced for the session this tick (b"" if none)."""
        return b""

    def take_spoken(self, session_id: str) -> tuple[bytes, str]:
        """``take_audio`` and the text that audio says ("" where the adapter does not know it)."""
        return self.take_audio(session_id), ""

    def speaking(self, session_id: str) -> bool:
        """Is the session's answer still being spoken? Its response stays open until the speech ends."""
        return False

    def on_speech_ready(self, notify: Callable[[], None]) -> None:
        """Call ``notify`` (from any thread; it must not block) whenever a session's speech becomes ready
        between ticks, so the worker can send it at once (``take_spoken`` on the engine thread). Adapters whose
        audio is made in the tick itself ignore it."""

    def resolve_mode(self, mode: str) -> str:
        """``mode`` or the default; ``ValueError`` if this adapter does not support it."""
        mode = mode or self.default_mode
        if mode not in self.modes:
            raise ValueError(f"mode {mode!r} is not supported by the {self.name} adapter; use one of {self.modes}")
        return mode
