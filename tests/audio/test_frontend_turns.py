"""The client's turn detection through the cascade's front end: manual turns, a reconfigured silence, speech
marks, and whether speech over an answer cuts it. Real Silero VAD on espeak-ng speech; Whisper faked (a gate
the test opens), so every wait is an event, never a clock."""

from __future__ import annotations

import numpy as np

from metronome.audio.adapter import TickAudio, TurnDetection
from metronome.audio.sentences import CutPolicy
from metronome.audio.tts import SpeechSynthesizer
from metronome.audio.frontend import SpeechFrontend
from metronome.audio.vad import SAMPLE_RATE, VadConfig
from tests.audio.speech import silence, synth, trim
from tests.audio.test_frontend import QUESTION, TOKENS, GatedAsr, make, spoken, tick, vad  # noqa: F401 (fixtures)
from tests.audio.test_tts import ScriptedVoice


class SizedAsr(GatedAsr):
    """``GatedAsr`` that also records how many samples each utterance it hears has."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.sizes: list[int] = []

    def transcribe_batch(self, utterances, sample_rate=16000):
        self.sizes += [u.size for u in utterances]
        return super().transcribe_batch(utterances, sample_rate)


def tick_audio(sid, pcm, **kw):
    return TickAudio(sid, pcm, max_tokens=TOKENS, **kw)


def settled(adapter, sid="a", pcm=None, **kw):
    """A tick after the front end has done every earlier tick's audio."""
    assert adapter.frontend.wait_idle(30)
    return tick(adapter, sid, pcm, **kw)


def test_without_server_vad_two_utterances_and_one_commit_are_one_transcript(make):
    asr = SizedAsr()
    adapter = make(asr)
    adapter.open_session("a", "turn", "")
    said = trim(synth(QUESTION))
    tick(adapter, pcm=silence(0.3), turn_detection=TurnDetection(server_vad=False))
    for _ in range(2):                                 # two utterances, each ended by a pause the VAD hears
        assert settled(adapter, pcm=np.concatenate([said, silence(1.0)])).transcript == ""
    waiting = settled(adapter, pcm=silence(0.2))
    assert not waiting.transcript and waiting.max_new_tokens == 0 and asr.batches == []   # held for the commit
    settled(adapter, new_turn=True)
    turn = settled(adapter)
    assert turn.transcript == QUESTION and turn.max_new_tokens == TOKENS
    assert asr.batches == [1] and len(asr.sizes) == 1
    assert asr.sizes[0] > 1.5 * said.size              # both utterances, in one piece


def test_a_longer_silence_duration_keeps_a_pause_inside_the_turn(make):
    adapter = make(GatedAsr())
    for sid in ("patient", "default"):
        adapter.open_session(sid, "turn", "")
    question = np.concatenate([silence(0.3), trim(synth(QUESTION)), silence(0.7)])
    patient, default = adapter.prepare([
        tick_audio("patient", question, turn_detection=TurnDetection(silence_duration_ms=1200)),
        tick_audio("default", question)])
    assert patient.error is None and default.error is None
    assert adapter.frontend.wait_idle(30)
    patient, default = adapter.prepare([tick_audio("patient", silence(0.7)), tick_audio("default", silence(0.7))])
    assert default.transcript == QUESTION               # 700 ms of silence ended the default turn ...
    assert not patient.transcript                       # ... but not the one that waits 1200 ms
    assert settled(adapter, "patient").transcript == QUESTION   # 1400 ms did


def test_speech_marks_are_ms_of_the_sessions_input_and_a_commit_stops_the_speech(make):
    adapter = make(GatedAsr())
    adapter.open_session("a", "turn", "")
    said = trim(synth(QUESTION))
    lead_ms, said_ms = 1000, said.size * 1000 // SAMPLE_RATE
    assert tick(adapter, pcm=silence(lead_ms / 1000)).speech_started_ms is None
    talking = settled(adapter, pcm=said)                # the speech has not ended in this audio
    assert talking.speech_started_ms is None            # the front end has not heard it yet at this tick
    started = settled(adapter, new_turn=True)
    assert started.speech_started_ms is not None and abs(started.speech_started_ms - lead_ms) < 250
    assert started.speech_stopped_ms is None
    stopped = settled(adapter)                          # the commit ended the speech where the audio ended
    assert stopped.speech_started_ms is None
    assert stopped.speech_stopped_ms is not None and abs(stopped.speech_stopped_ms - (lead_ms + said_ms)) < 100
    assert stopped.transcript == QUESTION


def spoken_over(adapter, voice, smollm2_tokenizer, **kw):
    """An answer is streaming and being spoken; the user starts to talk. The tick after the VAD heard it."""
    adapter.open_session("a", "turn", "")
    assert tick(adapter, text="Tell me a story.", new_turn=True, **kw).max_new_tokens == TOKENS
    voice.gate.clear()                                  # the story is not spoken yet when the user starts talking
    adapter.on_output("a", smollm2_tokenizer.encode("Once upon a time. There was a king. He",
                                                    add_special_tokens=False), False)
    assert not tick(adapter, pcm=trim(synth("Stop, please stop"))[:SAMPLE_RATE // 2]).cancelled
    return settled(adapter, pcm=silence(0.02))


def test_speech_over_an_answer_cuts_it_and_says_so(make, smollm2_tokenizer):
    voice = ScriptedVoice()
    with SpeechSynthesizer(voice, policy=CutPolicy(first_clause_chars=0)) as speech:
        adapter = make(GatedAsr(text="Stop."), speech=speech)
        cut = spoken_over(adapter, voice, smollm2_tokenizer)
        voice.gate.set()
        assert cut.cancelled and cut.ends_response and cut.max_new_tokens == 0
        assert cut.speech_started_ms is not None        # the onset that cut it is reported with it
        assert not adapter.session_state("a")["responding"] and not adapter.speaking("a")


def test_with_interrupt_response_off_speech_leaves_the_answer_running(make, smollm2_tokenizer):
    voice = ScriptedVoice()
    with SpeechSynthesizer(voice, policy=CutPolicy(first_clause_chars=0)) as speech:
        adapter = make(GatedAsr(text="Stop."), speech=speech)
        kept = spoken_over(adapter, voice, smollm2_tokenizer, turn_detection=TurnDetection(interrupt_response=False))
        voice.gate.set()
        assert not kept.cancelled and not kept.ends_response and kept.max_new_tokens == TOKENS
        assert kept.speech_started_ms is not None       # heard, and reported, but not an interruption
        assert adapter.session_state("a")["responding"] and adapter.speaking("a")


def test_response_create_before_whisper_is_done_answers_the_turn_when_it_comes(make, spoken):
    asr = GatedAsr()
    adapter = make(asr)
    adapter.open_session("a", "turn", "")
    asr.gate.clear()
    tick(adapter, pcm=spoken, turn_detection=TurnDetection(create_response=False))
    assert asr.entered.wait(30)                         # the VAD ended the turn; Whisper holds it
    create = tick(adapter, new_turn=True)               # response.create, before the transcript exists
    assert not create.transcript and create.max_new_tokens == 0
    asr.gate.set()
    answered = settled(adapter)
    assert answered.transcript == QUESTION and answered.max_new_tokens == TOKENS
    nothing = settled(adapter, new_turn=True)           # a commit with nothing in flight waits for nothing
    assert nothing.error is None
    adapter.on_output("a", [adapter.stop_token_ids[0]], True)
    settled(adapter)
    tick(adapter, pcm=spoken)                           # the next turn the VAD ends waits for its own create
    later = settled(adapter)
    assert later.transcript == QUESTION and later.max_new_tokens == 0


def test_utterances_held_for_a_commit_are_transcribed_when_server_vad_is_back(make):
    asr = GatedAsr()
    adapter = make(asr)
    adapter.open_session("a", "turn", "")
    tick(adapter, pcm=silence(0.3), turn_detection=TurnDetection(server_vad=False))
    assert settled(adapter, pcm=np.concatenate([trim(synth(QUESTION)), silence(1.0)])).transcript == ""
    assert settled(adapter, turn_detection=TurnDetection()).transcript == ""     # held until now: no commit came
    back = settled(adapter)
    assert back.transcript == QUESTION and back.max_new_tokens == TOKENS and asr.batches == [1]


def test_held_utterances_stay_within_max_utterance_s_the_oldest_dropped(vad):
    asr = SizedAsr()
    config = VadConfig(min_silence_ms=300, max_utterance_s=4.0)
    front = SpeechFrontend(vad, asr, vad_config=config)
    try:
        front.open("a")
        front.configure("a", config, manual=True)
        said = trim(synth(QUESTION))
        for _ in range(4):                             # about twice what may be held
            front.submit([("a", np.concatenate([said, silence(0.8)]), False)])
        front.submit([("a", np.zeros(0, np.float32), True)])
        assert front.wait_idle(30)
        assert front.take(["a"])["a"].transcripts == [QUESTION]
        assert len(asr.sizes) == 1 and said.size <= asr.sizes[0] <= 4.0 * SAMPLE_RATE
    finally:
        front.shutdown()


def test_a_clear_drops_the_utterance_in_progress_and_keeps_what_follows(make):
    """input_audio_buffer.clear while the VAD holds an open utterance: nothing of it is transcribed; speech
    after the clear is its own turn, without the cleared audio."""
    asr = SizedAsr()
    adapter = make(asr)
    adapter.open_session("a", "turn", "")
    said = trim(synth(QUESTION))
    tick(adapter, pcm=silence(0.3))
    assert settled(adapter, pcm=said).transcript == ""     # speaking: the utterance is open
    assert settled(adapter, pcm=silence(1.0), clear_buffer=True).transcript == ""
    assert settled(adapter).transcript == "" and asr.batches == []
    settled(adapter, pcm=np.concatenate([said, silence(1.0)]))
    assert settled(adapter).transcript == QUESTION
    assert asr.sizes and asr.sizes[0] < 1.5 * said.size    # the cleared speech is not in it


def test_a_clear_drops_the_turns_held_for_a_commit(make):
    asr = GatedAsr()
    adapter = make(asr)
    adapter.open_session("a", "turn", "")
    tick(adapter, pcm=silence(0.3), turn_detection=TurnDetection(server_vad=False))
    settled(adapter, pcm=np.concatenate([trim(synth(QUESTION)), silence(1.0)]))   # ended, held for the commit
    settled(adapter, clear_buffer=True)
    settled(adapter, new_turn=True)
    assert not settled(adapter).transcript and asr.batches == []
