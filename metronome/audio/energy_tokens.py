"""The energy adapter: a deterministic stand-in for a speech front end until the real ones land.

Every ``frame_ms`` of 16 kHz audio becomes ONE token: the digit naming the frame's loudness bucket.
Buckets split ``[floor_dbfs, 0]`` dBFS evenly (default ``[-60, 0]`` in 10 buckets of 6 dB); quieter
frames are bucket 0, louder than the top are bucket 9. Digits are looked up in the tokenizer
(``"0"``..``"9"``, single tokens in SmolLM2's vocabulary: ids 32..41), so the input is ordinary text
to the model and the same audio always gives the same tokens.

Worked example (defaults, SmolLM2 tokenizer): a 2 s tick at 16 kHz is 32 000 samples = 25 frames of
1 280 samples (the paper's prototype feeds 26 tokens per 2 s tick). A 440 Hz tone of amplitude 0.1
has RMS 0.0707 = -23.0 dBFS → bucket floor((-23.0 + 60) / 6) = 6 → token "6" (id 38), 25 times.
Silence is -120 dBFS → bucket 0 → "0" (id 32). 1 000 samples leave 1 000 in the carry (no token);
the next tick's first 280 samples complete that frame. The carry is per session, < one frame.

Sessions and modes (the chat framing comes from the tokenizer's template, see ``audio/chat.py``):

* First tick of every session: the system turn (``instructions``, or the template's default) comes
  first. Those are the tokens the attention sinks pin.
* ``"free_running"`` (the paper's sessions; full duplex): audio tokens stream straight into the
  context and the session decodes ``max_tokens`` every tick, hearing its own output. Typed ``text``
  is inserted as a complete user turn plus the generation prompt. ``new_turn``/``cancel`` do nothing.
* ``"turn"`` (default; request/response like the OpenAI Realtime API): audio opens a user turn
  (``<|im_start|>user\\n 6 6 7 ...``); nothing is decoded. ``new_turn`` closes it and adds the
  generation prompt: a *response* is active from then on and decodes ``max_tokens`` per tick until
  the model's stop token (``finished=True``); the next tick closes the assistant turn. ``text`` is a
  complete user turn that starts a response too. ``cancel`` ends the active response (the assistant
  turn is closed, nothing more decodes). Starting a response while one is active ends the old one
  first (barge-in). Audio that arrives while a response is active is held (at most
  ``max_held_tokens`` tokens, the oldest dropped) and opens the next user turn once it ends.

One tick of a turn-mode session, as tokens (SmolLM2)::

    tick 1: audio 0.16 s loud, no commit     -> header + [<|im_start|>, "user", "\\n", "9", "9"]  decode 0
    tick 2: audio 0.08 s quiet, new_turn      -> ["0", <|im_end|>, "\\n", <|im_start|>, "assistant", "\\n"]
                                                 decode max_tokens ... until <|im_end|>: finished
    tick n+1: (no audio)                      -> ["\\n"]  (closes the answer after its <|im_end|>)  decode 0
"""

from __future__ import annotations

import copy
import logging
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from metronome.audio.adapter import AdapterContext, InteractionAdapter, PreparedInput, TickAudio
from metronome.audio.chat import ChatTemplate
from metronome.audio.detokenize import IncrementalDetokenizer
from metronome.audio.turns import answer_close, default_stop_tokens, session_header
from metronome.errors import ConfigError

log = logging.getLogger(__name__)

MODES = ("turn", "free_running")


@dataclass
class _Session:
    mode: str
    header: list[int]                    # emitted on the first tick, then cleared
    detok: IncrementalDetokenizer
    held: deque[int]                     # turn mode: audio heard while a response is active
    carry: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # < one frame
    user_open: bool = False              # turn mode: a spoken user turn is open
    responding: bool = False             # turn mode: a response is active
    close_next: list[int] = field(default_factory=list)  # closes the answer that ended last tick


class EnergyTokenAdapter(InteractionAdapter):
    """Loudness-bucket tokens per ``frame_ms`` of audio; chat turns from the tokenizer's template.

    ``max_input_tokens`` bounds one session's input per tick: a tick that would exceed it (long
    typed text, a huge audio backlog) is refused with an error and leaves the session as it was.
    ``stop_token_ids`` default to the tokenizer's EOS and the token that ends an assistant turn.
    """

    name = "energy"
    modes = MODES

    @classmethod
    def from_context(cls, context: AdapterContext) -> "EnergyTokenAdapter":
        return cls(context.tokenizer, max_input_tokens=context.max_input_tokens)

    def __init__(self, tokenizer, *, frame_ms: float = 80.0, sample_rate: int = 16000, buckets: int = 10,
                 floor_dbfs: float = -60.0, max_input_tokens: int = 1024, max_held_tokens: int = 128,
                 stop_token_ids: tuple[int, ...] | None = None, default_mode: str = "turn") -> None:
        if not 1 <= buckets <= 10:
            raise ConfigError(f"buckets must be in [1, 10] (one digit token each), got {buckets}")
        if floor_dbfs >= 0:
            raise ConfigError(f"floor_dbfs must be < 0, got {floor_dbfs}")
        self.frame_samples = int(round(sample_rate * frame_ms / 1000.0))
        if self.frame_samples < 1:
            raise ConfigError(f"frame_ms={frame_ms} is shorter than one sample at {sample_rate} Hz")
        if default_mode not in MODES:
            raise ConfigError(f"default_mode must be one of {MODES}, got {default_mode!r}")
        self.tokenizer = tokenizer
        self.sample_rate = sample_rate
        self.frame_ms = frame_ms
        self.buckets = buckets
        self.floor_dbfs = floor_dbfs
        self.max_input_tokens = max_input_tokens
        self.max_held_tokens = max_held_tokens
        self.default_mode = default_mode
        self.chat = ChatTemplate(tokenizer)
        self.bucket_tokens = np.array([_digit_token(tokenizer, d) for d in range(buckets)], dtype=np.int64)
        if stop_token_ids is None:
            stop_token_ids = default_stop_tokens(tokenizer, self.chat)
        self.stop_token_ids = tuple(stop_token_ids)
        self._sessions: dict[str, _Session] = {}

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, mode: str, instructions: str) -> None:
        mode = self.resolve_mode(mode)
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already open")
        header = session_header(self.chat, instructions, self.max_input_tokens)
        self._sessions[session_id] = _Session(mode, header, IncrementalDetokenizer(self.tokenizer),
                                              deque(maxlen=self.max_held_tokens))

    def close_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def input_tokens_per_tick(self, budget_ms: float) -> int:
        audio = math.ceil(budget_ms / self.frame_ms) + 1  # +1: the carry can complete one more frame
        chat = self.chat
        framing = (len(chat.user_prefix) + len(chat.user_suffix) + len(chat.generation_prompt)
                   + len(chat.assistant_suffix))
        return audio + framing

    # ------------------------------------------------------------------ audio
    def frame_tokens(self, frames: np.ndarray) -> np.ndarray:
        """[n, frame_samples] float32 → n token ids (the frames' loudness buckets)."""
        if frames.shape[0] == 0:
            return np.zeros(0, np.int64)
        rms = np.sqrt(np.einsum("ij,ij->i", frames, frames) / frames.shape[1])   # no squared copy
        db = 20.0 * np.log10(np.maximum(rms, 1e-12))
        width = -self.floor_dbfs / self.buckets
        index = np.clip(np.floor((db - self.floor_dbfs) / width), 0, self.buckets - 1).astype(np.int64)
        return self.bucket_tokens[index]

    def _audio_tokens(self, state: _Session, pcm: np.ndarray) -> list[int]:
        """Whole frames of carry + pcm → tokens; the remainder becomes the new carry."""
        samples = np.concatenate([state.carry, np.asarray(pcm, dtype=np.float32)]) if state.carry.size else \
            np.asarray(pcm, dtype=np.float32)
        n = samples.size // self.frame_samples
        state.carry = samples[n * self.frame_samples:].copy()
        return self.frame_tokens(samples[:n * self.frame_samples].reshape(n, self.frame_samples)).tolist()

    # ------------------------------------------------------------------ ticks
    def prepare(self, batch: list[TickAudio]) -> list[PreparedInput]:
        out = []
        for tick in batch:
            state = self._sessions.get(tick.session_id)
            if state is None:
                out.append(PreparedInput(error=f"session {tick.session_id!r} is not open in the {self.name} adapter"))
                continue
            # Build on a copy so that a refused tick leaves the session exactly as it was.
            new = copy.copy(state)
            new.held = deque(state.held, maxlen=state.held.maxlen)
            tokens = self._advance(new, tick)
            if len(tokens) > self.max_input_tokens:
                out.append(PreparedInput(error=f"this tick's input is {len(tokens)} tokens; at most "
                                               f"{self.max_input_tokens} fit in one tick (send shorter text)"))
                continue
            self._sessions[tick.session_id] = new
            max_new = max(0, tick.max_tokens) if new.mode == "free_running" or new.responding else 0
            out.append(PreparedInput(token_ids=tokens or None, max_new_tokens=max_new,
                                     stop_token_ids=self.stop_token_ids if new.mode == "turn" else ()))
        return out

    def _advance(self, s: _Session, tick: TickAudio) -> list[int]:
        chat = self.chat
        tokens = s.header + s.close_next
        s.header, s.close_next = [], []
        audio = self._audio_tokens(s, tick.pcm)
        if s.mode == "free_running":
            tokens += audio
            if tick.text:
                tokens += chat.user_turn(tick.text, respond=True)
            return tokens

        starting = bool(tick.text) or tick.new_turn
        if s.responding and (tick.cancel or starting):
            tokens += chat.assistant_suffix  # the answer stops here (its last token was sent already)
            s.responding = False
            s.detok = IncrementalDetokenizer(self.tokenizer)
        if s.responding:
            if len(s.held) + len(audio) > self.max_held_tokens:
                log.info("session %s: %d audio tokens heard during a response dropped (hold limit %d)",
                         tick.session_id, len(s.held) + len(audio) - self.max_held_tokens, self.max_held_tokens)
            s.held.extend(audio)
        else:
            heard = list(s.held) + audio
            s.held.clear()
            if heard:
                if not s.user_open:
                    tokens += chat.user_prefix
                    s.user_open = True
                tokens += heard
        if tick.text:
            if s.user_open:
                tokens += chat.user_suffix
                s.user_open = False
            tokens += chat.user_turn(tick.text, respond=True)
            s.responding = True
        elif tick.new_turn:
            tokens += (chat.user_suffix if s.user_open else []) + chat.generation_prompt
            s.user_open = False
            s.responding = True
        return tokens

    def on_output(self, session_id: str, token_ids: list[int], finished: bool) -> str:
        state = self._sessions.get(session_id)
        if state is None:
            return ""
        text = state.detok.push(token_ids)
        if finished:
            text += state.detok.flush()
            if state.mode == "turn" and state.responding:
                state.responding = False
                state.close_next = answer_close(self.chat, token_ids)
        return text

    # ------------------------------------------------------------------ introspection (tests, metrics)
    def session_state(self, session_id: str) -> dict:
        s = self._sessions[session_id]
        return {"mode": s.mode, "carry_samples": int(s.carry.size), "responding": s.responding,
                "user_open": s.user_open, "held_tokens": len(s.held), "detok_held": s.detok.held}

    @property
    def sessions(self) -> int:
        return len(self._sessions)


def _digit_token(tokenizer, digit: int) -> int:
    """The single token id spelling ``digit`` ("7", else " 7"); deterministic for a given tokenizer."""
    for text in (str(digit), f" {digit}"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            return int(ids[0])
    raise ConfigError(f"the tokenizer has no single token for the digit {digit}; the energy adapter needs one")
