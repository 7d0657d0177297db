"""The cascade's speech front end beside the tick: the real Silero VAD on espeak-ng speech, Whisper faked
where its timing matters (a gate the test opens), so every wait is an event, never a clock."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from metronome.audio.adapter import TickAudio
from metronome.audio.cascade import CascadeAdapter
from metronome.audio.frontend import SpeechFrontend
from metronome.audio.sentences import CutPolicy
from metronome.audio.tts import SpeechSynthesizer
from metronome.audio.vad import SileroVad, VadConfig
from metronome.cpu import PLAN_ENV, ThreadPlan, thread_nice
from tests.audio.speech import silence, synth, trim
from tests.audio.test_tts import ScriptedVoice
from tests.test_cpu import needs_thread_nice

QUESTION = "What is the capital of France?"
TOKENS = 4


class GatedAsr:
    """Whisper's stand-in: each call records its batch and thread, then waits for ``gate``."""

    def __init__(self, text: str = QUESTION, fail_loud: bool = False) -> None:
        self.text, self.fail_loud = text, fail_loud
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.batches: list[int] = []
        self.threads: set[int] = set()
        self.nice: set[int | None] = set()    # the calling threads' nice values

    def transcribe_batch(self, utterances, sample_rate=16000):
        self.threads.add(threading.get_ident())
        self.nice.add(thread_nice())
        self.batches.append(len(utterances))
        self.entered.set()
        assert self.gate.wait(30)
        if self.fail_loud and any(np.max(np.abs(u)) > 0.99 for u in utterances):
            raise RuntimeError("the decoder choked")
        return [f" {self.text} " for _ in utterances]


@pytest.fixture(scope="module")
def vad():
    return SileroVad()


@pytest.fixture(scope="module")
def spoken():
    return np.concatenate([silence(0.3), trim(synth(QUESTION)), silence(0.6)])


@pytest.fixture
def make(smollm2_tokenizer, vad):
    made = []

    def build(asr, **kw):
        adapter = CascadeAdapter(smollm2_tokenizer, vad=vad, asr=asr, **kw)
        made.append(adapter)
        return adapter

    yield build
    for adapter in made:
        adapter.shutdown()


def tick(adapter, sid="a", pcm=None, **kw):
    pcm = np.zeros(0, np.float32) if pcm is None else pcm
    prepared, = adapter.prepare([TickAudio(sid, pcm, max_tokens=TOKENS, **kw)])
    return prepared


def test_a_transcript_made_beside_the_tick_joins_a_later_tick(make, spoken):
    asr = GatedAsr()
    adapter = make(asr)
    adapter.open_session("a", "turn", "")
    asr.gate.clear()
    first = tick(adapter, pcm=spoken)                  # the utterance ends in this audio
    assert not first.transcript and first.max_new_tokens == 0
    assert asr.entered.wait(30)                        # Whisper has it, and is held there
    held = tick(adapter, pcm=silence(0.5))             # the tick goes on without it
    assert not held.transcript and held.token_ids is None and held.max_new_tokens == 0
    asr.gate.set()
    assert adapter.frontend.wait_idle(30)
    joined = tick(adapter, pcm=silence(0.5))
    assert joined.transcript == QUESTION and joined.max_new_tokens == TOKENS
    assert joined.token_ids[-len(adapter.chat.generation_prompt):] == adapter.chat.generation_prompt
    assert threading.get_ident() not in asr.threads    # Whisper never ran on the tick's thread
    assert adapter.frontend.stats.utterances == 1


def test_utterances_that_end_in_one_tick_are_one_whisper_batch(make, spoken):
    asr = GatedAsr()
    adapter = make(asr)
    sids = ["a", "b", "c"]
    for sid in sids:
        adapter.open_session(sid, "turn", "")
    adapter.prepare([TickAudio(sid, spoken, max_tokens=TOKENS) for sid in sids])
    assert adapter.frontend.wait_idle(30)
    prepared = adapter.prepare([TickAudio(sid, silence(0.1), max_tokens=TOKENS) for sid in sids])
    assert asr.batches == [3]
    assert [p.transcript for p in prepared] == [QUESTION] * 3


def test_closing_a_session_while_whisper_has_its_utterance_drops_the_result(make, spoken):
    asr = GatedAsr()
    adapter = make(asr)
    adapter.open_session("a", "turn", "")
    asr.gate.clear()
    tick(adapter, pcm=spoken)
    assert asr.entered.wait(30)
    adapter.close_session("a")
    adapter.open_session("a", "turn", "")              # the same id, a new session
    asr.gate.set()
    assert adapter.frontend.wait_idle(30)
    assert adapter.frontend.take(["a"]) == {}
    later = tick(adapter, pcm=silence(0.2))
    assert not later.transcript and later.max_new_tokens == 0 and later.error is None


def test_a_recognition_failure_is_reported_on_its_session_only(make, spoken):
    asr = GatedAsr(fail_loud=True)
    adapter = make(asr)
    for sid in ("loud", "fine"):
        adapter.open_session(sid, "turn", "")
    loud = np.clip(spoken * 40.0, -1.0, 1.0)
    adapter.prepare([TickAudio("loud", loud, max_tokens=TOKENS), TickAudio("fine", spoken, max_tokens=TOKENS)])
    assert adapter.frontend.wait_idle(30)
    bad, good = adapter.prepare([TickAudio("loud", max_tokens=TOKENS), TickAudio("fine", max_tokens=TOKENS)])
    assert bad.error and "speech recognition failed" in bad.error and "choked" in bad.error
    assert good.error is None and good.transcript == QUESTION and good.max_new_tokens == TOKENS
    again = tick(adapter, "loud", silence(0.2))        # the failed session goes on
    assert again.error is None


def test_speech_during_an_answer_cancels_it_before_whisper_has_the_words(make, spoken, smollm2_tokenizer):
    asr = GatedAsr(text="Stop.")
    voice = ScriptedVoice()
    with SpeechSynthesizer(voice, policy=CutPolicy(first_clause_chars=0)) as speech:
        adapter = make(asr, speech=speech)
        adapter.open_session("a", "turn", "")
        assert tick(adapter, text="Tell me a story.", new_turn=True).max_new_tokens == TOKENS
        voice.gate.clear()                             # the story is not spoken yet when the user starts talking
        story = smollm2_tokenizer.encode("Once upon a time. There was a king. He", add_special_tokens=False)
        adapter.on_output("a", story, False)
        asr.gate.clear()
        onset = trim(synth("Stop, please stop"))[: 16000 // 2]   # speech begins; no utterance has ended
        assert not tick(adapter, pcm=onset).cancelled
        assert adapter.frontend.wait_idle(30)
        cut = tick(adapter, pcm=silence(0.02))
        voice.gate.set()
        assert cut.cancelled and cut.ends_response and cut.max_new_tokens == 0 and not cut.transcript
        assert cut.token_ids == adapter.chat.assistant_suffix          # the answer's turn is closed
        assert not adapter.session_state("a")["responding"] and not adapter.speaking("a")
        assert adapter.take_audio("a") == b"" and "There was a king." not in voice.calls
        asr.gate.set()
        tick(adapter, pcm=silence(0.6))                # the rest: silence ends the utterance
        assert adapter.frontend.wait_idle(30)
        heard = tick(adapter, pcm=silence(0.02))
        assert heard.transcript == "Stop." and heard.max_new_tokens == TOKENS and not heard.cancelled


def test_speech_with_no_answer_running_cancels_nothing(make, spoken):
    adapter = make(GatedAsr())
    adapter.open_session("a", "turn", "")
    tick(adapter, pcm=spoken)
    assert adapter.frontend.wait_idle(30)
    prepared = tick(adapter, pcm=silence(0.1))
    assert not prepared.cancelled and prepared.transcript == QUESTION


def test_the_front_end_ignores_unknown_sessions_and_stops_cleanly(vad):
    front = SpeechFrontend(vad, GatedAsr())
    front.submit([("nobody", np.ones(1600, np.float32), True)])
    assert front.wait_idle(30) and front.take(["nobody"]) == {}
    front.open("x")
    with pytest.raises(ValueError, match="already open"):
        front.open("x")
    front.shutdown()


@needs_thread_nice
def test_whisper_runs_below_the_ticks_priority_by_the_plans_nice(vad, spoken, monkeypatch):
    monkeypatch.setenv(PLAN_ENV, ThreadPlan(2, 1, 1, 1, 1, 0, speech_nice=3).to_env())
    asr = GatedAsr()
    front = SpeechFrontend(vad, asr)
    try:
        front.open("a")
        front.submit([("a", spoken, False)])
        assert front.wait_idle(30) and front.take(["a"])["a"].transcripts == [QUESTION]
        assert asr.nice == {min(19, thread_nice() + 3)}
    finally:
        front.shutdown()


def test_what_a_session_does_not_take_stays_bounded(vad, spoken):
    front = SpeechFrontend(vad, GatedAsr(), max_queued=1)
    try:
        front.open("idle")
        for _ in range(2):                             # two questions, nobody takes the first transcript
            front.submit([("idle", spoken, False)])
            assert front.wait_idle(30)
        heard = front.take(["idle"])["idle"]
        assert heard.started and heard.transcripts == [QUESTION]
        assert heard.error and "not taken" in heard.error
        assert front.take(["idle"]) == {}
    finally:
        front.shutdown()


@pytest.fixture(scope="module")
def question():
    """The question and no silence after it: what a session has sent when its speaker just stopped."""
    return np.concatenate([silence(0.3), trim(synth(QUESTION))])


def front_end(vad, asr):
    return SpeechFrontend(vad, asr, vad_config=VadConfig(min_silence_ms=300, speech_pad_ms=100))


def settled(front, sid="a"):
    assert front.wait_idle(30)
    return front.take([sid]).get(sid)


@contextmanager
def guessing(vad, asr, question):
    """A front end whose session "a" has just stopped speaking: past the end pad and half the ending silence, not
    the end. Whisper has the guess (held there while ``asr.gate`` is shut)."""
    front = front_end(vad, asr)
    try:
        front.open("a")
        front.submit([("a", np.concatenate([question, silence(0.3)]), False)])
        assert asr.entered.wait(30)
        yield front
    finally:
        front.shutdown()


def test_a_guess_on_the_silence_is_the_transcript_when_the_silence_ends_the_utterance(vad, question):
    asr = GatedAsr()
    with guessing(vad, asr, question) as front:
        heard = settled(front)
        assert heard is None or not heard.transcripts    # nothing reported yet: the utterance is still open
        front.submit([("a", silence(0.4), False)])       # the silence ends the utterance as guessed
        assert settled(front).transcripts == [QUESTION]
        assert asr.batches == [1] and front.stats.guesses == 1 and front.stats.guesses_used == 1
        assert front.stats.utterances == 1


def test_an_utterance_that_ends_while_whisper_has_its_guess_waits_for_that_run(vad, question):
    asr = GatedAsr()
    asr.gate.clear()
    with guessing(vad, asr, question) as front:
        front.submit([("a", silence(0.4), False)])
        assert not front.wait_idle(0.2) and front.busy("a")   # the ended utterance waits for the guess's run
        asr.gate.set()
        assert settled(front).transcripts == [QUESTION]
        assert asr.batches == [1] and not front.busy("a")


def test_speech_that_goes_on_drops_the_guess(vad, question):
    asr = GatedAsr()
    with guessing(vad, asr, question) as front:
        assert front.wait_idle(30)
        front.submit([("a", np.concatenate([trim(synth(QUESTION)), silence(0.6)]), False)])   # a pause, then more
        heard = settled(front)
        assert heard.transcripts == [QUESTION]           # one utterance, transcribed whole once it ended
        assert asr.batches == [1, 1] and front.stats.guesses_used == 0


def test_no_guess_while_whisper_has_finished_utterances_to_transcribe(vad, question, spoken):
    asr = GatedAsr()
    front = front_end(vad, asr)
    try:
        front.open("a")
        front.open("b")
        asr.gate.clear()
        front.submit([("b", spoken, False)])             # b's question has ended: Whisper takes it
        assert asr.entered.wait(30)
        front.submit([("a", np.concatenate([question, silence(0.3)]), False)])
        front.submit([("a", silence(0.4), False)])       # a's ends without a guess before it
        deadline = time.monotonic() + 30
        while front.stats.vad_calls < 3 and time.monotonic() < deadline:   # the VAD has had all of a's audio
            time.sleep(0.001)
        assert front.stats.vad_calls == 3
        asr.gate.set()
        assert front.wait_idle(30)
        assert front.stats.guesses == 0 and sum(asr.batches) == 2
        assert front.take(["a"])["a"].transcripts == [QUESTION]
    finally:
        front.shutdown()


def test_a_guess_that_failed_gives_the_utterance_a_run_of_its_own(vad, question):
    class FailsFirst(GatedAsr):
        def transcribe_batch(self, utterances, sample_rate=16000):
            first = not self.batches
            texts = super().transcribe_batch(utterances, sample_rate)
            if first:
                raise RuntimeError("the decoder choked")
            return texts

    asr = FailsFirst()
    with guessing(vad, asr, question) as front:
        assert front.wait_idle(30)
        front.submit([("a", silence(0.4), False)])
        heard = settled(front)
        assert heard.transcripts == [QUESTION] and heard.error is None
        assert asr.batches == [1, 1]
