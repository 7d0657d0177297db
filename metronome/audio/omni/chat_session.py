"""What the omni adapters that frame audio as chat turns share (Qwen2.5-Omni, Qwen3-Omni, MiniCPM-o).

Each of them keeps, per session, a system header, a detokeniser and the flags of one state machine with
two modes:

* ``"free_running"`` (the paper's full-duplex sessions): once the session has heard audio it decodes
  ``max_tokens`` every tick and keeps hearing; typed ``text`` closes what the model was saying and
  enters as a user turn.
* ``"turn"``: audio opens a user turn; ``new_turn`` (commit) or ``text`` closes it and starts an answer,
  decoded ``max_tokens`` per tick until a stop token or ``max_response_tokens``; the next tick closes the
  assistant turn. ``new_turn``, ``text`` or ``cancel`` during an answer end it (barge-in).

``ChatSessionAdapter`` owns what does not depend on the model: the session registry, the per-session
refusal of bad input (unknown session, audio that is not 1-D or not finite, a tick beyond
``max_input_tokens``; the session is left exactly as it was, since every tick is planned on a copy),
the decode budget and the detokenised output (``metronome/audio/turns.py``). A model's adapter says how
a tick becomes a *plan* (``_plan``: token ids plus the audio to encode, mutating the session copy),
how many input tokens a plan is, and how a tick's plans become engine input (``_realise``: one batched
encoder call for every session).
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from metronome.audio.adapter import InteractionAdapter, PreparedInput, TickAudio
from metronome.audio.detokenize import IncrementalDetokenizer
from metronome.audio.turns import decode_budget, record_output
from metronome.errors import ConfigError


def pcm_problem(pcm) -> str | None:
    """Why ``pcm`` cannot be heard (a message for the client), or None.

    >>> pcm_problem(np.zeros((2, 10))) is not None, pcm_problem(np.zeros(10)) is None
    (True, True)
    """
    a = np.asarray(pcm, np.float32)
    if a.ndim != 1:
        return f"audio must be mono samples (1-D), got shape {a.shape}"
    if a.size and not np.isfinite(a).all():
        return "audio contains NaN or infinite samples"
    return None


@dataclass
class ChatSession:
    """The state every chat-turn omni session has (models add their held audio in a subclass)."""

    mode: str
    header: list[int]                     # emitted on the first tick, then cleared
    detok: IncrementalDetokenizer
    started: bool = False                 # the first user turn (with the instruction) was emitted
    user_open: bool = False               # turn mode: a user turn is open
    responding: bool = False              # turn mode: an answer is being decoded
    response_tokens: int = 0
    close_next: list[int] = field(default_factory=list)   # turn mode: closes the answer that ended
    last_decoded: list[int] = field(default_factory=list)  # free running: the model's last token

    def take_prefix(self) -> list[int]:
        """What the tick starts with whatever it holds: the header (first tick) and the close of an
        answer that ended last tick. Both are emitted once."""
        tokens = self.header + self.close_next
        self.header, self.close_next = [], []
        return tokens

    def cut_answer(self, tokenizer) -> None:
        """End a turn-mode answer early (barge-in or cancel); the caller appends its close tokens."""
        self.responding = False
        self.detok = IncrementalDetokenizer(tokenizer)


class ChatSessionAdapter(InteractionAdapter):
    """The model-independent part of a chat-turn omni adapter (module docstring).

    Subclasses call ``_init_sessions`` from their ``__init__`` and implement ``_new_session``,
    ``_plan``, ``_plan_tokens``, ``_realise`` and ``_close_after``.
    """

    tokenizer: Any
    max_input_tokens: int
    max_response_tokens: int
    stop_token_ids: tuple[int, ...]

    def _init_sessions(self, tokenizer, default_mode: str, max_input_tokens: int) -> None:
        if default_mode not in self.modes:
            raise ConfigError(f"default_mode must be one of {self.modes}, got {default_mode!r}")
        self.tokenizer = tokenizer
        self.default_mode = default_mode
        self.max_input_tokens = max_input_tokens
        self._sessions: dict[str, ChatSession] = {}

    # ------------------------------------------------------------------ what a model supplies
    @abstractmethod
    def _new_session(self, mode: str, instructions: str) -> ChatSession:
        """A fresh session (``ValueError`` when the instructions cannot fit)."""

    @abstractmethod
    def _plan(self, s: ChatSession, tick: TickAudio) -> Any:
        """Advance ``s`` (a copy of the session) by one tick; the tick's plan, or an error message (str)."""

    @abstractmethod
    def _plan_tokens(self, plan: Any) -> int:
        """Input tokens the plan adds to the context (what ``max_input_tokens`` bounds)."""

    @abstractmethod
    def _realise(self, planned: list[tuple[ChatSession, Any]]) -> list[tuple[list[int] | None, torch.Tensor | None]]:
        """Every accepted plan of the tick → (token_ids, embeds), encoding all their audio at once."""

    @abstractmethod
    def _close_after(self, token_ids: list[int]) -> list[int]:
        """Tokens that close an assistant turn whose last decoded tokens were ``token_ids``."""

    def _live(self, s: ChatSession) -> bool:
        """Whether a free-running session decodes this tick (models that wait for their first audio say no)."""
        return True

    def _copy_session(self, s: ChatSession) -> ChatSession:
        """A copy ``_plan`` may change without touching ``s`` (override when the session holds mutable containers
        that ``_plan`` changes in place)."""
        return copy.copy(s)

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, mode: str, instructions: str) -> None:
        mode = self.resolve_mode(mode)
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already open")
        self._sessions[session_id] = self._new_session(mode, instructions)

    def close_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    # ------------------------------------------------------------------ ticks
    def prepare(self, batch: list[TickAudio]) -> list[PreparedInput]:
        out: list[PreparedInput | None] = [None] * len(batch)
        planned: list[tuple[int, ChatSession, Any]] = []
        for i, tick in enumerate(batch):
            state = self._sessions.get(tick.session_id)
            if state is None:
                out[i] = PreparedInput(error=f"session {tick.session_id!r} is not open in the {self.name} adapter")
                continue
            problem = pcm_problem(tick.pcm)
            if problem:
                out[i] = PreparedInput(error=problem)
                continue
            new = self._copy_session(state)   # a refused tick leaves the session exactly as it was
            plan = self._plan(new, tick)
            if isinstance(plan, str):
                out[i] = PreparedInput(error=plan)
                continue
            n = self._plan_tokens(plan)
            if n > self.max_input_tokens:
                out[i] = PreparedInput(error=f"this tick's input is {n} tokens; at most {self.max_input_tokens} "
                                             "fit in one tick (send shorter text)")
                continue
            self._sessions[tick.session_id] = new
            planned.append((i, new, plan))

        inputs = self._realise([(state, plan) for _, state, plan in planned])
        for (i, state, _), (token_ids, embeds) in zip(planned, inputs):
            max_new, stops, ends = decode_budget(state, batch[i].max_tokens, self.max_response_tokens,
                                                 self.stop_token_ids, live=self._live(state))
            out[i] = PreparedInput(token_ids=token_ids, embeds=embeds, max_new_tokens=max_new, stop_token_ids=stops,
                                   ends_response=ends)
        return out  # type: ignore[return-value]

    def on_output(self, session_id: str, token_ids: list[int], finished: bool) -> str:
        state = self._sessions.get(session_id)
        if state is None:
            return ""
        return record_output(state, token_ids, finished, self._close_after)

    # ------------------------------------------------------------------ introspection (tests, metrics)
    def session_state(self, session_id: str) -> dict:
        s = self._sessions[session_id]
        return {"mode": s.mode, "started": s.started, "user_open": s.user_open, "responding": s.responding}
