"""The cascade adapter: speech → VAD → Whisper → user turns of the LLM's chat template → streamed text.

The embedded default a person can talk to. The speech front end (``audio/frontend.py``) runs beside the
tick on threads of its own: per session a streaming Silero VAD cuts the incoming audio into utterances
(so words are never split at tick boundaries; ``ENDPOINT_SILENCE_MS`` of silence ends one), and the
finished utterances of ALL sessions are transcribed together by Whisper (``audio/asr.py``) whenever it is
free. In the worker the audio reaches the front end as it streams in (``hear``, between ticks); ``prepare``
hands it what the tick still brings and takes what it has finished: the tick never waits for Whisper, and a
transcript joins the first tick that starts after it is ready. Each
recognised utterance enters its session as a user turn of the model's chat template (``audio/chat.py``),
the system header first on the session's first tick, exactly as the energy adapter frames its turns.

Modes:

* ``"turn"`` (default; request/response): a recognised utterance (or typed ``text``) is a complete
  user turn plus the generation prompt; the answer is decoded ``max_tokens`` per tick over the
  following ticks until the model's stop token (``finished=True``); the next tick closes the assistant
  turn. Speech that begins while an answer is streamed or spoken barges in: on the first tick after the
  VAD hears it start (before Whisper has its words) the answer ends there (the assistant turn is closed,
  its audio not yet taken is dropped, ``PreparedInput.cancelled``), and the new question, once
  transcribed, is answered (``TurnDetection.interrupt_response`` False: speech does not cut the answer; its
  transcript, when it comes, still does). ``cancel`` ends the answer. An answer that reaches
  ``max_response_tokens``, or the client's ``max_output_tokens``, without a stop token is ended by the
  adapter (no runaway decode); at most ``max_tokens_per_tick`` of it is decoded per tick. Silence,
  noise and empty or whitespace-only transcripts add nothing and decode nothing.
* ``"free_running"`` (full duplex, as the paper's sessions): the session decodes ``max_tokens`` every
  tick and hears itself; utterances are inserted as user turns (closing whatever the model was saying
  with the assistant suffix first) followed by the generation prompt.

Speech out (optional): given a ``SpeechSynthesizer`` (``audio/tts.py``), each answer's text deltas are
also spoken, sentence by sentence on the synthesizer's threads, and ``take_audio`` hands the worker the
PCM16 that is ready (``output_sample_rate``, 24 kHz by default). Barge-in and ``cancel`` drop the audio
not yet taken; an answer cut at ``max_response_tokens`` is spoken up to where it stopped. Without a
synthesizer the adapter is text only.

``new_turn`` (the client committed its audio) flushes the VAD: the utterance in progress ends after this
tick's audio and is transcribed at once. A commit with nothing heard does nothing.

Turn detection (the Realtime API's, ``set_turn_detection``, or ``TickAudio.turn_detection``): a threshold
or timings are checked here, so a refusal is that session's error in the same tick, and applied by the
front end before the session's next audio. Without server VAD the front end holds finished utterances
until the commit, which makes them and the utterance in progress ONE user turn. ``create_response`` False:
a turn the VAD ended joins the conversation unanswered until the commit (``response.create``); a commit
that comes while the front end still has the turn's audio answers its transcript when it comes. The
front end's speech marks go out as ``speech_started_ms`` / ``speech_stopped_ms`` (ms into the session's
input audio) in the tick that takes them.

Per-session state is bounded: the front end's (the VAD stream and the utterances held for a commit, each
≤ ``max_utterance_s`` of audio, 15 s by default, and a few utterances waiting for Whisper), the detokeniser's window, and a few flags.
Transcripts enter the context truncated to ``max_transcript_tokens`` per tick. ``transcript`` of the
prepared input is the text recognised this tick (every utterance is final when it is reported; the
gateway turns it into the Realtime API's transcription ``delta`` and ``completed`` events). A failure of
the VAD or Whisper on one session's audio is that session's ``error`` for the tick it is taken in.

One conversation, as ticks (turn mode, SmolLM2, B = 2 s, 8 tokens per tick)::

    tick 1: 1.5 s silence, "What is the" ...   -> header                                  decode 0
    tick 2: "...capital of France?", 0.6 s silence -> []  (beside the tick: the VAD ends the utterance,
            Whisper hears "What is the capital of France?")                                decode 0
    tick 3: silence -> [<|im_start|>user\\n What is ... ?<|im_end|>\\n<|im_start|>assistant\\n]
                                                                                         decode 8: "The capital of France is Paris"
    tick 4: silence                              -> []                                    decode 8: "." <|im_end|>: finished
    tick 5: silence                              -> ["\\n"] (closes the answer)           decode 0
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from metronome.audio.adapter import AdapterContext, InteractionAdapter, PreparedInput, TickAudio, TurnDetection
from metronome.audio.chat import ChatTemplate
from metronome.audio.detokenize import IncrementalDetokenizer
from metronome.audio.frontend import Heard, SpeechFrontend, clean_transcript
from metronome.audio.turns import answer_close, decode_budget, default_stop_tokens, record_output, session_header
from metronome.audio.vad import SAMPLE_RATE, SileroVad, VadConfig
from metronome.errors import ConfigError

if TYPE_CHECKING:
    from metronome.audio.tts import SpeechChunk, SpeechStream, SpeechSynthesizer

log = logging.getLogger(__name__)

MODES = ("turn", "free_running")
SPEECH_TOKENS_PER_S = 6   # fast speech (~200 words/min) in SmolLM2 tokens, with margin
# Silence that ends an utterance. Every millisecond of it is in the reply's latency; 300 ms still keeps a
# question's pauses between words inside one utterance (Realtime's server VAD waits 500 ms by default).
ENDPOINT_SILENCE_MS = 300
# Answer tokens decoded per second of ticks at most, whatever a client asks per tick: twice the rate speech
# is spoken at (~15 characters, ~4 SmolLM2 tokens a second), so speech never waits for text, and a short B
# gets a short tick (at 250 ms: 2 tokens).
ANSWER_TOKENS_PER_S = 8

__all__ = ["ANSWER_TOKENS_PER_S", "CascadeAdapter", "ENDPOINT_SILENCE_MS", "clean_transcript", "speech_out"]


def speech_out(voice: str) -> SpeechSynthesizer | None:
    """The synthesizer that speaks answers in ``voice`` at the Realtime rate; None for "none", or (logged) when
    the voice cannot load here: the assistant still answers, in text."""
    if voice == "none":
        return None
    from metronome.audio.tts import SpeechSynthesizer, load_voice

    try:
        return SpeechSynthesizer(load_voice(voice))
    except RuntimeError as exc:
        log.warning("speech out is off: %s", exc)
        return None


@dataclass
class _Session:
    mode: str
    header: list[int]                     # emitted on the first tick, then cleared
    detok: IncrementalDetokenizer
    responding: bool = False              # turn mode: an answer is being decoded
    response_tokens: int = 0              # turn mode: tokens decoded for the current answer
    close_next: list[int] = field(default_factory=list)   # turn mode: closes the answer that ended
    last_decoded: list[int] = field(default_factory=list)  # free running: tail of the output since the last turn
    utterances: int = 0                   # recognised utterances (introspection)
    speech: SpeechStream | None = None    # the answer being spoken (with a synthesizer only)
    turn_detection: TurnDetection = field(default_factory=TurnDetection)
    unanswered: bool = False              # turn mode: a user turn joined without a response (create_response off)
    awaiting: bool = False                # turn mode: committed while its audio was in the front end: answer it
    typed_later: list[str] = field(default_factory=list)   # turn mode: typed during an answer; joins after it


class CascadeAdapter(InteractionAdapter):
    """Silero VAD + Whisper tiny.en in front of the engine's chat model.

    ``vad`` / ``asr``: shared model instances (built here when not given; ~1 s each), run beside the tick
    by the adapter's ``SpeechFrontend``. ``vad_config``: the per-session segmentation (by default
    ``ENDPOINT_SILENCE_MS`` of silence ends an utterance).
    ``max_input_tokens`` bounds one session's input per tick (typed text beyond it is refused with an
    error and the session is left as it was). ``max_response_tokens`` caps one turn-mode answer.
    ``speech``: a ``SpeechSynthesizer`` to speak the answers at ``speech_rate`` Hz (None: text only).
    ``max_tokens_per_tick``: at most this many answer tokens a tick, whatever the client asks (None: no
    cap; the worker builds it from B and ``ANSWER_TOKENS_PER_S``); a spoken answer's first tick may decode
    its first speech piece whole (``CutPolicy.first_words`` + 1 tokens).
    """

    name = "cascade"
    modes = MODES
    sample_rate = SAMPLE_RATE
    hears_early = True   # the VAD hears a tick's audio as it streams in, so an utterance's end is found sooner

    @classmethod
    def from_context(cls, context: AdapterContext) -> "CascadeAdapter":
        return cls(context.tokenizer, max_input_tokens=context.max_input_tokens, speech=speech_out(context.voice),
                   max_tokens_per_tick=math.ceil(context.budget_ms / 1000.0 * ANSWER_TOKENS_PER_S))

    def __init__(self, tokenizer, *, vad: SileroVad | None = None, asr=None, vad_config: VadConfig | None = None,
                 max_input_tokens: int = 1024, max_transcript_tokens: int = 128, max_response_tokens: int = 256,
                 stop_token_ids: tuple[int, ...] | None = None, default_mode: str = "turn",
                 asr_threads: int = 0, speech: SpeechSynthesizer | None = None,
                 speech_rate: int | None = None, max_tokens_per_tick: int | None = None) -> None:
        if default_mode not in MODES:
            raise ConfigError(f"default_mode must be one of {MODES}, got {default_mode!r}")
        if max_transcript_tokens < 1 or max_response_tokens < 1:
            raise ConfigError("max_transcript_tokens and max_response_tokens must be >= 1")
        self.tokenizer = tokenizer
        self.chat = ChatTemplate(tokenizer)
        self.default_mode = default_mode
        self.max_input_tokens = max_input_tokens
        self.max_transcript_tokens = max_transcript_tokens
        self.max_response_tokens = max_response_tokens
        self.max_tokens_per_tick = max_tokens_per_tick
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids is not None else \
            default_stop_tokens(tokenizer, self.chat)
        self.vad_config = vad_config or VadConfig(min_silence_ms=ENDPOINT_SILENCE_MS)
        self.vad = vad if vad is not None else SileroVad()
        if asr is None:
            from metronome.audio.asr import WhisperAsr

            asr = WhisperAsr(cpu_threads=asr_threads)
        self.asr = asr
        self.frontend = SpeechFrontend(self.vad, asr, vad_config=self.vad_config)
        self._sessions: dict[str, _Session] = {}
        self.speech = speech
        self._speech_ready: Callable[[], None] | None = None
        if speech is not None:
            self.output_sample_rate = speech_rate or speech.output_rate
            self.speaks_between_ticks = True   # the synthesis threads finish pieces while no tick runs

    def shutdown(self) -> None:
        """Stop the speech front end's threads (the adapter is not used after this)."""
        self.frontend.shutdown()

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, mode: str, instructions: str) -> None:
        mode = self.resolve_mode(mode)
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already open")
        header = session_header(self.chat, instructions, self.max_input_tokens)
        self.frontend.open(session_id)
        self._sessions[session_id] = _Session(mode, header, IncrementalDetokenizer(self.tokenizer))

    def close_session(self, session_id: str) -> None:
        self.frontend.close(session_id)
        state = self._sessions.pop(session_id, None)
        if state is not None and state.speech is not None:
            state.speech.cancel()

    def input_tokens_per_tick(self, budget_ms: float) -> int:
        # Steady speech is ~3 words/s, ~4-5 tokens/s, entering as one user turn per utterance (after closing
        # the previous answer). An utterance is a burst (up to max_transcript_tokens at once, when it ends);
        # the worker prefills bursts beyond max_chunk_tokens in pieces, up to max_input_tokens.
        chat = self.chat
        return (math.ceil(budget_ms / 1000.0 * SPEECH_TOKENS_PER_S) + len(chat.user_prefix) + len(chat.user_suffix)
                + len(chat.generation_prompt) + len(chat.assistant_suffix))

    # ------------------------------------------------------------------ ticks
    def prepare(self, batch: list[TickAudio]) -> list[PreparedInput]:
        out: list[PreparedInput | None] = [None] * len(batch)
        live: list[int] = []
        for i, tick in enumerate(batch):
            if tick.session_id not in self._sessions:
                out[i] = PreparedInput(error=f"session {tick.session_id!r} is not open in the {self.name} adapter")
            elif tick.turn_detection is not None and (refused := self.set_turn_detection(tick.session_id,
                                                                                       tick.turn_detection)):
                out[i] = PreparedInput(error=refused)
            else:
                live.append(i)
        # The front end's results that are ready now (from earlier ticks' audio); this tick's audio goes to it.
        sids = [batch[i].session_id for i in live]
        heard = self.frontend.take(sids)
        for i in live:
            if batch[i].clear_buffer:
                self.frontend.clear(batch[i].session_id)
        self.frontend.submit([(batch[i].session_id, batch[i].pcm, batch[i].new_turn) for i in live])
        states = [self._sessions[sid] for sid in sids]

        # Turns and decode budgets per session.
        for k, i in enumerate(live):
            tick, state = batch[i], states[k]
            got = heard.get(tick.session_id, Heard())
            transcript = self._bounded(" ".join(got.transcripts))
            marks = {"speech_started_ms": got.started_ms, "speech_stopped_ms": got.stopped_ms}
            if got.error:   # the front end failed on this session's audio: this tick's turn is lost, it says why
                out[i] = PreparedInput(transcript=transcript, error=got.error, **marks)
                continue
            new = copy.copy(state)
            # Speech began during an answer (and no turn of the user's ends it this tick already): cut it now.
            barge_in = got.started and not transcript and not tick.text.strip() and \
                state.turn_detection.interrupt_response and (state.responding or state.speech is not None)
            tokens = self._advance(new, tick, transcript, barge_in, self.frontend.busy(tick.session_id))
            if len(tokens) > self.max_input_tokens:
                out[i] = PreparedInput(transcript=transcript, **marks, error=(
                    f"this tick's input is {len(tokens)} tokens; at most {self.max_input_tokens} fit in one tick "
                    "(send shorter text)"))
                continue
            self._sessions[tick.session_id] = new
            if self.speech is not None:
                self._steer_speech(state, new, tick, transcript, barge_in)
            cap = self.max_tokens_per_tick
            if cap is not None and self.speech is not None and new.responding and not new.response_tokens:
                # The answer's first tick decodes the speech's first piece whole (a common word is one token: its
                # words, and the next token, which shows the last word ended): else the first audio waits a tick.
                cap = max(cap, self.speech.policy.first_words + 1)
            asked = tick.max_tokens if cap is None else min(tick.max_tokens, cap)
            max_new, stops, ends = decode_budget(new, asked, self._response_cap(tick), self.stop_token_ids)
            out[i] = PreparedInput(token_ids=tokens or None, max_new_tokens=max_new, stop_token_ids=stops,
                                   transcript=transcript, ends_response=ends or barge_in, cancelled=barge_in,
                                   **marks)
        return out  # type: ignore[return-value]

    def hear(self, session_id: str, pcm, *, clear: bool = False, turn_detection: TurnDetection | None = None
             ) -> str | None:
        if session_id not in self._sessions:
            return f"session {session_id!r} is not open in the {self.name} adapter"
        refused = self.set_turn_detection(session_id, turn_detection) if turn_detection is not None else None
        if clear:
            self.frontend.clear(session_id)
        if pcm.size:
            self.frontend.submit([(session_id, pcm, False)])
        return refused

    def _response_cap(self, tick: TickAudio) -> int:
        """Tokens the session's answer may take: the client's ``max_output_tokens`` within the adapter's cap."""
        cap = self.max_response_tokens
        return min(cap, tick.max_output_tokens) if tick.max_output_tokens else cap

    def set_turn_detection(self, session_id: str, turn: TurnDetection) -> str | None:
        """The session's VAD segments with ``turn``'s threshold and timings from its next audio on (unset: ours);
        a message for the client, and the session as it was, when the VAD cannot take them."""
        state = self._sessions[session_id]
        base, changes = self.vad_config, {}
        if turn.threshold is not None:
            changes.update(threshold=turn.threshold, neg_threshold=min(max(turn.threshold - 0.15, 0.01), turn.threshold))
        if turn.silence_duration_ms is not None:
            changes["min_silence_ms"] = turn.silence_duration_ms
        if turn.prefix_padding_ms is not None or turn.silence_duration_ms is not None:
            # Our pad is also the end pad, cut from the silence: it can be no longer than the silence.
            pad = base.speech_pad_ms if turn.prefix_padding_ms is None else turn.prefix_padding_ms
            changes["speech_pad_ms"] = min(pad, changes.get("min_silence_ms", base.min_silence_ms))
        try:
            config = dataclasses.replace(base, **changes)
        except ValueError as exc:
            return f"turn_detection refused: {exc}"
        self.frontend.configure(session_id, config, manual=not turn.server_vad)
        state.turn_detection = turn
        return None

    def _bounded(self, text: str) -> str:
        """``text`` cut to ``max_transcript_tokens`` tokens (a 15 s utterance is rarely near it)."""
        if not text:
            return ""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= self.max_transcript_tokens:
            return text
        return self.tokenizer.decode(ids[:self.max_transcript_tokens], skip_special_tokens=True).strip()

    def _advance(self, s: _Session, tick: TickAudio, transcript: str, barge_in: bool, in_flight: bool) -> list[int]:
        chat = self.chat
        tokens = s.header + s.close_next
        s.header, s.close_next = [], []
        if transcript:
            s.utterances += 1
        spoken = transcript if transcript and transcript.strip() else ""
        typed = tick.text if tick.text and tick.text.strip() else ""
        turns = [t for t in (spoken, typed) if t]

        if s.mode == "free_running":
            if turns:
                if s.last_decoded:   # close what the model was saying before the user's turn
                    tokens += answer_close(chat, s.last_decoded)
                    s.last_decoded = []
                for n, text in enumerate(turns):
                    tokens += chat.user_turn(text, respond=n == len(turns) - 1)
            return tokens

        if typed and s.responding and not (tick.new_turn or spoken or tick.cancel or barge_in):
            s.typed_later.append(typed)   # as in OpenAI's API the answer runs on; the message joins after it
            turns = []                    # (the typed message was the tick's only turn)
        if s.responding and (tick.cancel or turns or barge_in or s.response_tokens >= self._response_cap(tick)):
            if not (tick.cancel or turns or barge_in):
                log.info("session %s: answer cut at %d tokens (max_response_tokens)", tick.session_id,
                         s.response_tokens)
            tokens += chat.assistant_suffix   # the answer stops here (barge-in, cancel or the cap)
            s.responding = False
            s.detok = IncrementalDetokenizer(self.tokenizer)
        if s.typed_later and not s.responding:
            turns, s.typed_later = s.typed_later + turns, []
        # A spoken turn the VAD ended waits for the client's response.create when create_response is off; a typed
        # one always does, as in OpenAI's API. A commit can come before the transcript it answers (Whisper works
        # beside the tick): the transcript is answered when it comes.
        respond = bool(turns) and (tick.new_turn
                                   or (bool(spoken) and (s.awaiting or s.turn_detection.create_response)))
        for n, text in enumerate(turns):
            tokens += chat.user_turn(text, respond=respond and n == len(turns) - 1)
        if turns and not respond:
            s.unanswered = True
        elif tick.new_turn and s.unanswered and not s.responding:
            tokens += chat.generation_prompt
            respond = True
        if respond:
            s.unanswered = s.awaiting = False
            s.responding = True
            s.response_tokens = 0
        else:
            s.awaiting = in_flight and (s.awaiting or tick.new_turn)
        return tokens

    def on_output(self, session_id: str, token_ids: list[int], finished: bool) -> str:
        state = self._sessions.get(session_id)
        if state is None:
            return ""
        text = record_output(state, token_ids, finished, lambda ids: answer_close(self.chat, ids))
        if state.speech is not None:
            state.speech.feed(text)
            if finished:
                state.speech.finish()
        return text

    # ------------------------------------------------------------------ speech out
    def _steer_speech(self, old: _Session, new: _Session, tick: TickAudio, transcript: str, barge_in: bool) -> None:
        """After a committed tick: speech heard, a user turn or cancel silences the answer being spoken
        (barge-in); a user turn opens the next answer's stream; an answer cut at the cap is spoken to its end."""
        user_turn = any(t and t.strip() for t in (transcript, tick.text))
        if new.speech is not None and (user_turn or tick.cancel or barge_in):
            new.speech.cancel()
            new.speech = None
        elif new.speech is not None and old.responding and not new.responding:
            new.speech.finish()
        if user_turn:
            new.speech = self.speech.open(self.output_sample_rate, on_ready=self._speech_ready)

    def take_speech(self, session_id: str) -> list[SpeechChunk]:
        """The answer's pieces whose audio is ready now, in order, each with the text it says (for
        ``response.output_audio_transcript.delta``); [] without a synthesizer. Never waits."""
        state = self._sessions.get(session_id)
        if state is None or state.speech is None:
            return []
        if state.turn_detection.interrupt_response and self.frontend.speech_started(session_id):
            # Between ticks, the user spoke over the answer: none of it goes out until the next tick, whose
            # ``prepare`` takes that news first and cuts the answer (or, with no cut, ends the hold).
            return []
        chunks = state.speech.take()
        if state.speech.done:
            state.speech = None
        return chunks

    def take_audio(self, session_id: str) -> bytes:
        """The answer's PCM16 at ``output_sample_rate`` that is ready now (b"" without a synthesizer)."""
        return self.take_spoken(session_id)[0]

    def take_spoken(self, session_id: str) -> tuple[bytes, str]:
        chunks = self.take_speech(session_id)
        text = "".join((" " if chunk.piece else "") + chunk.text for chunk in chunks)   # pieces are sentences
        return b"".join(chunk.pcm16 for chunk in chunks), text

    def speaking(self, session_id: str) -> bool:
        state = self._sessions.get(session_id)
        return state is not None and state.speech is not None

    def on_speech_ready(self, notify: Callable[[], None]) -> None:
        self._speech_ready = notify   # answers opened from now on call it from the synthesis thread

    # ------------------------------------------------------------------ introspection (tests, metrics)
    def session_state(self, session_id: str) -> dict:
        s = self._sessions[session_id]
        return {"mode": s.mode, "responding": s.responding, "response_tokens": s.response_tokens,
                "utterances": s.utterances, "detok_held": s.detok.held, "speaking": s.speech is not None}

    @property
    def sessions(self) -> int:
        return len(self._sessions)
