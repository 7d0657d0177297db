"""The MiniCPM-o 4.5 adapter: 1-s audio chunks → Whisper-medium → projection → pooling → spliced embeddings.

Everything here follows OpenBMB's published code for MiniCPM-o 4.5 (``modeling_minicpmo.py``,
``processing_minicpmo.py``, ``configuration_minicpmo.py``); it is not part of transformers.

**Audio path**: ``minicpm_o_audio.py`` (log-mel, Whisper-medium, projection, pooling): one second of audio
is 10 LLM positions. The prompt places them like the processor's chunked
placeholder (``get_audio_placeholder(chunk_input=True)``): one ``<|audio_start|>`` + 10 ``<unk>`` +
``<|audio_end|>`` per 1-s chunk; the ``<unk>`` rows are replaced by the audio embeddings
(``get_omni_embedding``), so a tick of audio is 12 positions.

**Chat layout** (``MiniCPMO.streaming_prefill`` / ``streaming_generate``, text output only)::

    header      <|im_start|>system\\n{instructions}<|im_end|>\\n      (what the attention sinks pin)
    user turn   <|im_start|>user\\n [audio chunk][audio chunk]... {typed text}
    respond     <|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n
    answer      ... <|im_end|>   (stop tokens: <|im_end|>, <|tts_eos|>, <|endoftext|>)
    close       \\n              (the <|im_end|> the model emitted is fed back by the engine)

The default instructions are the published default system prompt. ``<|tts_bos|>`` is left out of
the assistant prefix: this path produces text, not speech.

Modes (as the cascade and energy adapters):

* ``"free_running"`` (the paper's sessions): the first tick is header + user turn with the first
  audio + ``instruction`` + the assistant prefix; from then on every tick appends its audio chunks to
  the context (the model keeps hearing) and decodes ``max_tokens``. Typed ``text`` closes what the model
  was saying and becomes a user turn (with that tick's audio) followed by the assistant prefix.
* ``"turn"`` (default): audio opens/extends a user turn and decodes nothing; ``new_turn`` closes the
  turn (a trailing part-second of audio is zero-padded to a whole chunk) and starts the response,
  decoded ``max_tokens`` per tick until a stop token; the next tick closes the answer. ``text`` is a
  user turn that starts a response too; ``new_turn``/``text``/``cancel`` during a response end it
  first (barge-in). Audio heard while a response runs is held (at most ``max_held_chunks`` chunks of
  embeddings, oldest dropped) and opens the next user turn.

**Bounded state.** Per session: < 1 s of PCM carry, the held chunks (turn mode), a detokeniser and a
few flags. Each chunk is encoded on its own (Whisper positions 0..49, attention within the chunk),
batched across every session's chunks in one encoder call per tick. The published *streaming* path
instead keeps a per-session Whisper KV cache of up to 30 s (reset when full) and computes the mel over
a growing 30-s buffer; that history is deliberately not kept here, so a multi-second utterance's
later chunks do not see the earlier ones inside the encoder (the LLM still sees them all). For a
single 1-s clip the two are the same computation.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from metronome.audio.adapter import AdapterContext, TickAudio
from metronome.audio.detokenize import IncrementalDetokenizer
from metronome.audio.omni.chat_session import ChatSession, ChatSessionAdapter
from metronome.audio.omni.minicpm_o_audio import SAMPLE_RATE, AudioSpec, AudioTower, LogMel  # noqa: F401 (AudioSpec: importable here)
from metronome.audio.turns import fitting_header
from metronome.device_copy import embed_lists
from metronome.errors import ConfigError

log = logging.getLogger(__name__)

MODES = ("turn", "free_running")
DEFAULT_SYSTEM = "You are a helpful assistant. You can accept audio and text input and output voice and text."
THINK_OFF = "<think>\n\n</think>\n\n"   # MiniCPMO.think_str: Qwen3's "thinking disabled" prefix
STOP_TOKENS = ("<|im_end|>", "<|tts_eos|>", "<|endoftext|>")


# ------------------------------------------------------------------------------------------ prompt pieces
@dataclass(frozen=True)
class Layout:
    """Token ids of the prompt pieces (module docstring), resolved once from the tokenizer."""

    audio_start: int
    audio_end: int
    placeholder: int             # <unk>: the rows the audio replaces
    user_prefix: list[int]       # <|im_start|>user\n
    respond: list[int]           # <|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n
    close: list[int]             # <|im_end|>\n   (closes an assistant turn)
    stop_token_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "Layout":
        def one(token: str) -> int:
            ids = tokenizer.encode(token, add_special_tokens=False)
            if len(ids) != 1:
                raise ConfigError(f"the tokenizer has no single token {token!r}; the minicpm_o adapter needs "
                                  "MiniCPM-o's tokenizer")
            return int(ids[0])

        def enc(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        for token in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
            one(token)
        stops = tuple(one(t) for t in STOP_TOKENS if len(tokenizer.encode(t, add_special_tokens=False)) == 1)
        return cls(one("<|audio_start|>"), one("<|audio_end|>"), one("<unk>"), enc("<|im_start|>user\n"),
                   enc("<|im_end|>\n<|im_start|>assistant\n" + THINK_OFF), enc("<|im_end|>\n"), stops)

    def header(self, tokenizer, instructions: str) -> list[int]:
        return list(tokenizer.encode(f"<|im_start|>system\n{instructions or DEFAULT_SYSTEM}<|im_end|>\n",
                                     add_special_tokens=False))

    def close_after(self, decoded: list[int]) -> list[int]:
        """Closes an assistant turn whose last decoded token is ``decoded[-1]`` (the engine feeds that one)."""
        close = list(self.close)
        return close[1:] if decoded and decoded[-1] == close[0] else close


# ------------------------------------------------------------------------------------------ sessions
@dataclass(frozen=True)
class _Audio:
    """One audio unit in a tick's input: ``<|audio_start|>`` + a chunk's rows + ``<|audio_end|>``.

    ``held=None``: the tick's next fresh chunk; else the index of a chunk held during a response."""

    held: int | None = None


@dataclass(frozen=True)
class _Hold:
    """The tick's ``count`` fresh chunks go to the session's held audio (turn mode, during a response)."""

    count: int


Piece = int | _Audio | _Hold   # a tick's input before assembly: token ids and audio units


@dataclass
class _Session(ChatSession):
    held: deque = field(default_factory=deque)   # turn mode: chunk embeddings heard during a response
    carry: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # < one chunk of PCM


@dataclass
class _Plan:
    """One session's tick before encoding: its pieces and the fresh chunks of PCM they refer to."""

    pieces: list[Piece]
    chunks: list[np.ndarray]


@dataclass
class MiniCpmoTiming:
    """What the last ``prepare`` spent on the host (benchmarks, logs): on a GPU the features are queued, not waited
    for, so their device time lands in ``encoder_ms``."""

    sessions: int = 0
    chunks: int = 0
    mel_ms: float = 0.0
    encoder_ms: float = 0.0


class MiniCpmoAdapter(ChatSessionAdapter):
    """MiniCPM-o 4.5's speech understanding on the engine (see the module docstring).

    ``instruction``: text after the first tick's audio in free-running sessions (the paper's layout:
    header, first audio, instruction, assistant prefix). ``max_input_tokens`` bounds a session's input
    per tick; a tick beyond it is refused (``PreparedInput.error``) and the session is left as it was.
    """

    name = "minicpm_o"
    modes = MODES
    sample_rate = SAMPLE_RATE

    def __init__(self, tokenizer, tower: AudioTower, embed, *, max_input_tokens: int = 1024,
                 instruction: str = "", max_response_tokens: int = 256, max_held_chunks: int = 8,
                 max_chunks_per_tick: int = 4, default_mode: str = "turn") -> None:
        self._init_sessions(tokenizer, default_mode, max_input_tokens)
        if max_response_tokens < 1 or max_held_chunks < 0 or max_chunks_per_tick < 1:
            raise ConfigError("max_response_tokens and max_chunks_per_tick must be >= 1, max_held_chunks >= 0")
        self.tower = tower
        self.embed = embed
        self.spec = tower.spec
        self.layout = Layout.from_tokenizer(tokenizer)
        self.unit_tokens = self.spec.tokens_per_chunk + 2   # with its audio-start/end markers
        self.mel = LogMel(int(tower.apm.config.num_mel_bins), tower.apm.conv1.weight.device)
        self.instruction_ids = list(tokenizer.encode(instruction, add_special_tokens=False)) if instruction else []
        self.max_response_tokens = max_response_tokens
        self.max_held_chunks = max_held_chunks
        self.max_chunks_per_tick = max_chunks_per_tick
        self.stop_token_ids = self.layout.stop_token_ids
        self.last_timing = MiniCpmoTiming()

    @classmethod
    def from_context(cls, context: AdapterContext, **kwargs) -> "MiniCpmoAdapter":
        if context.checkpoint is None:
            raise ConfigError("the minicpm_o adapter loads its audio encoder from the checkpoint directory")
        from metronome.models.weights import read_config

        tower = AudioTower.from_checkpoint(context.checkpoint, read_config(context.checkpoint), context.dtype,
                                           context.device, quantization=context.quantization)
        return cls(context.tokenizer, tower, context.embed, max_input_tokens=context.max_input_tokens, **kwargs)

    # ------------------------------------------------------------------ sessions
    def _new_session(self, mode: str, instructions: str) -> _Session:
        header = fitting_header(self.layout.header(self.tokenizer, instructions), self.max_input_tokens)
        return _Session(mode, header, IncrementalDetokenizer(self.tokenizer), held=deque(maxlen=self.max_held_chunks))

    def _copy_session(self, s: _Session) -> _Session:
        new = copy.copy(s)
        new.held = deque(s.held, maxlen=s.held.maxlen)
        return new

    def input_tokens_per_tick(self, budget_ms: float) -> int:
        # The carry can complete one more chunk than the tick's own audio.
        chunks = math.ceil(budget_ms / 1000.0 / self.spec.chunk_s) + 1
        lay = self.layout
        framing = len(lay.close) + len(lay.user_prefix) + len(lay.respond) + len(self.instruction_ids)
        return chunks * self.unit_tokens + framing

    # ------------------------------------------------------------------ ticks
    def _plan(self, s: _Session, tick: TickAudio) -> _Plan | str:
        pcm = np.asarray(tick.pcm, dtype=np.float32)
        chunks = self._chunks(s, pcm, flush=tick.new_turn and s.mode == "turn")
        if len(chunks) > self.max_chunks_per_tick:
            return (f"this tick holds {len(chunks)} s of audio; at most {self.max_chunks_per_tick} chunks are "
                    "encoded per tick")
        return _Plan(self._advance(s, tick, len(chunks)), chunks)

    def _plan_tokens(self, plan: _Plan) -> int:
        return sum(self.unit_tokens if isinstance(p, _Audio) else isinstance(p, int) for p in plan.pieces)

    def _realise(self, planned: list[tuple[_Session, _Plan]]
                 ) -> list[tuple[list[int] | None, torch.Tensor | None]]:
        audio = self._encode([c for _, plan in planned for c in plan.chunks], len(planned))
        laid_out, k = [], 0
        for state, plan in planned:
            rows = list(audio[k:k + len(plan.chunks)]) if plan.chunks else []
            k += len(plan.chunks)
            laid_out.append(self._lay_out(state, plan.pieces, rows))
        # Every session's marker and text ids in one lookup: a lookup a piece waited on the device each.
        text_only = [all(isinstance(seg, list) for seg in segments) for segments in laid_out]
        lists = [seg for segments, text in zip(laid_out, text_only) if not text
                 for seg in segments if isinstance(seg, list)]
        device = next((seg.device for segments in laid_out for seg in segments if isinstance(seg, torch.Tensor)),
                      None)
        with torch.inference_mode():
            embedded = iter(embed_lists(self.embed, lists, device) if lists else [])
            out: list[tuple[list[int] | None, torch.Tensor | None]] = []
            for segments, text in zip(laid_out, text_only):
                if text:
                    out.append(([t for seg in segments for t in seg] or None, None))
                    continue
                parts = [next(embedded) if isinstance(seg, list) else seg for seg in segments]
                out.append((None, torch.cat([part.to(parts[0].dtype) for part in parts])))
        return out

    def _close_after(self, token_ids: list[int]) -> list[int]:
        return self.layout.close_after([int(t) for t in token_ids])

    def _chunks(self, s: _Session, pcm: np.ndarray, flush: bool) -> list[np.ndarray]:
        """Whole chunks of carry + pcm; the rest becomes the carry (zero-padded out on ``flush``)."""
        samples = np.concatenate([s.carry, pcm]) if s.carry.size else pcm
        size = self.spec.chunk_samples
        n = samples.size // size
        chunks = [samples[j * size:(j + 1) * size] for j in range(n)]
        rest = samples[n * size:]
        if flush and rest.size:
            chunks.append(np.concatenate([rest, np.zeros(size - rest.size, np.float32)]))
            rest = rest[:0]
        s.carry = rest.copy()
        return chunks

    def _encode(self, chunks: list[np.ndarray], sessions: int) -> torch.Tensor | None:
        """Every session's chunks in one mel + encoder call → [chunks, tokens_per_chunk, hidden]."""
        timing = MiniCpmoTiming(sessions=sessions, chunks=len(chunks))
        self.last_timing = timing
        if not chunks:
            return None
        t0 = time.perf_counter()
        mel = self.mel(chunks)
        t1 = time.perf_counter()
        with torch.inference_mode():
            rows = self.tower(mel)
        timing.mel_ms, timing.encoder_ms = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        return rows

    def _advance(self, s: _Session, tick: TickAudio, chunks: int) -> list[Piece]:
        """This tick's input as token ids and audio units (the state machine of the module docstring)."""
        lay = self.layout
        pieces: list[Piece] = s.take_prefix()
        heard: list[Piece] = [_Audio()] * chunks
        text = list(self.tokenizer.encode(tick.text, add_special_tokens=False)) if tick.text.strip() else []

        if s.mode == "free_running":
            if not s.started:
                if not heard and not text:
                    return pieces   # nothing heard yet: the header alone
                s.started = True
                return pieces + lay.user_prefix + heard + text + self.instruction_ids + lay.respond
            if text:   # close what the model was saying; this tick's audio joins the user's turn
                pieces += lay.close_after(s.last_decoded) + lay.user_prefix + heard + text + lay.respond
            else:
                pieces += heard
            if pieces:
                s.last_decoded = []   # what was decoded is no longer the end of the context
            return pieces

        starting = bool(text) or tick.new_turn
        if s.responding and (tick.cancel or starting):
            pieces += lay.close   # the answer stops here (barge-in or cancel)
            s.cut_answer(self.tokenizer)
        if s.responding:
            if len(s.held) + chunks > self.max_held_chunks:
                log.info("%d s of audio heard during a response dropped (hold limit %d chunks)",
                         len(s.held) + chunks - self.max_held_chunks, self.max_held_chunks)
            pieces.append(_Hold(chunks))
            return pieces
        audio = [_Audio(held=j) for j in range(len(s.held))] + heard
        if audio or text:
            if not s.user_open:
                pieces += lay.user_prefix
                s.user_open = True
            pieces += audio + text
        if starting and s.user_open:
            pieces += lay.respond
            s.user_open = False
            s.responding = True
            s.response_tokens = 0
        return pieces

    def _lay_out(self, s: _Session, pieces: list[Piece], rows: list[torch.Tensor]
                 ) -> list[torch.Tensor | list[int]]:
        """Token ids and audio units in prompt order: runs of ids (lists) and encoder rows (tensors)."""
        held = list(s.held)
        fresh = iter(rows)
        segments: list[torch.Tensor | list[int]] = []
        for p in pieces:
            if isinstance(p, _Hold):
                s.held.extend(next(fresh) for _ in range(p.count))   # the deque drops the oldest
            elif isinstance(p, _Audio):
                row = next(fresh) if p.held is None else held[p.held]
                segments += [[self.layout.audio_start], row, [self.layout.audio_end]]
            elif segments and isinstance(segments[-1], list):
                segments[-1].append(p)
            else:
                segments.append([p])
        if any(isinstance(p, _Audio) and p.held is not None for p in pieces):
            s.held.clear()
        return segments

    def on_output(self, session_id: str, token_ids: list[int], finished: bool) -> str:
        text = super().on_output(session_id, token_ids, finished)
        state = self._sessions.get(session_id)
        if (state is not None and state.mode == "turn" and not finished and state.responding
                and state.response_tokens >= self.max_response_tokens):
            # The answer reached max_response_tokens without a stop token: it ends here.
            text += state.detok.flush()
            state.responding = False
            state.close_next = list(self.layout.close)
        return text

    # ------------------------------------------------------------------ introspection (tests, metrics)
    def session_state(self, session_id: str) -> dict:
        s = self._sessions[session_id]
        return {**super().session_state(session_id), "carry_samples": int(s.carry.size), "held_chunks": len(s.held),
                "detok_held": s.detok.held}


def build_adapter(context: AdapterContext) -> MiniCpmoAdapter:
    """The registry's entry point: the audio tower from ``context.checkpoint``, on the engine's device."""
    return MiniCpmoAdapter.from_context(context)
