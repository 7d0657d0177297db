"""The cascade adapter (Silero VAD → Whisper tiny.en → SmolLM2 chat turns) with the real engine, ticked directly.

Speech is synthesised with espeak-ng; every component is the real one. Each tick first waits until the
speech front end has done the earlier ticks' audio (as if Whisper kept up within a tick), so a transcript
joins the tick after the one whose audio ended its utterance (``test_frontend.py`` covers the timing). The worker's threading and the
gateway are left out here (``tests/serving/test_cascade_gateway.py`` covers them).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from metronome import Engine, EngineConfig, KVPolicy, SamplingParams, StepInput
from metronome.audio.adapter import TickAudio
from metronome.audio.cascade import CascadeAdapter, clean_transcript
from tests.audio.speech import silence, synth, trim

pytestmark = pytest.mark.slow

RATE = 16000
TICK_S = 2.0
TOKENS = 8
FRANCE = "What is the capital of France?"
GERMANY = "What is the capital of Germany?"
JAPAN = "What is the capital of Japan?"


@pytest.fixture(scope="module")
def engine():
    # A small window so that a long session really slides it (the reservation stays 2 + 64/16 + chunk blocks).
    return Engine(EngineConfig(model="smollm2-135m", policy=KVPolicy(sinks=16, window=64, block_size=16),
                               num_blocks=200, max_chunk_tokens=256))


@pytest.fixture(scope="module")
def adapter(engine):
    adapter = CascadeAdapter(engine.tokenizer, asr_threads=2)
    yield adapter
    adapter.shutdown()


class Conversation:
    """One adapter session + its engine session, ticked with ``TICK_S`` of audio at a time."""

    def __init__(self, engine, adapter, sid, mode="turn", tokens=TOKENS):
        self.engine, self.adapter, self.sid, self.tokens = engine, adapter, sid, tokens
        adapter.open_session(sid, mode, "")
        self.eid = engine.open_session()
        self.heard: list[str] = []
        self.said = ""
        self.answers: list[str] = []
        self.decoded_per_tick: list[int] = []
        self.finished = 0
        self.cancelled = 0

    def tick(self, pcm=None, **kw):
        pcm = np.zeros(0, np.float32) if pcm is None else pcm
        assert self.adapter.frontend.wait_idle(60)
        prepared, = self.adapter.prepare([TickAudio(self.sid, pcm, max_tokens=self.tokens, **kw)])
        assert prepared.error is None, prepared.error
        if prepared.transcript:
            self.heard.append(prepared.transcript)
            self.answers.append("")
        out, = self.engine.step([StepInput(self.eid, token_ids=prepared.token_ids,
                                           max_new_tokens=prepared.max_new_tokens,
                                           sampling=SamplingParams(stop_token_ids=prepared.stop_token_ids))])
        assert out.error is None, out.error
        # As the worker does: an answer that reaches the adapter's cap ends with this tick.
        out.finished = out.finished or (prepared.ends_response and len(out.token_ids) >= prepared.max_new_tokens)
        text = self.adapter.on_output(self.sid, list(out.token_ids), out.finished)
        self.said += text
        if self.answers:
            self.answers[-1] += text
        self.decoded_per_tick.append(len(out.token_ids))
        self.finished += out.finished
        self.cancelled += prepared.cancelled
        return prepared, out

    def stream(self, audio, tick_s=TICK_S):
        n = int(tick_s * RATE)
        for i in range(0, len(audio), n):
            self.tick(audio[i:i + n])

    def close(self):
        self.adapter.close_session(self.sid)
        self.engine.close_session(self.eid)


@pytest.fixture
def conv(engine, adapter, request):
    made = []

    def make(mode="turn", tokens=TOKENS):
        c = Conversation(engine, adapter, f"{request.node.name}-{len(made)}", mode, tokens)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
    assert adapter.sessions == 0


def noise(seconds, dbfs=-50.0, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(int(seconds * RATE)) * 10 ** (dbfs / 20)).astype(np.float32)


def question(text, pad_s=1.0):
    return np.concatenate([silence(0.3), trim(synth(text)), silence(pad_s)])


def test_clean_transcript_drops_non_speech_tags():
    assert clean_transcript(" [BLANK_AUDIO] (wind blowing) ") == ""
    assert clean_transcript("  Hello   there. ") == "Hello there."


def test_a_spoken_question_is_answered_and_the_answer_stops(conv):
    c = conv()
    c.stream(np.concatenate([question(FRANCE), silence(6.0)]))
    assert len(c.heard) == 1 and "France" in c.heard[0], c.heard
    assert "Paris" in c.said, c.said
    assert c.finished == 1
    # After the answer: no more decoding (no runaway in turn mode), the turn is closed.
    last = len(c.decoded_per_tick) - 1 - c.decoded_per_tick[::-1].index(next(d for d in reversed(c.decoded_per_tick) if d))
    assert all(d == 0 for d in c.decoded_per_tick[last + 1:])
    assert not c.adapter.session_state(c.sid)["responding"]


def test_silence_noise_and_a_session_that_never_speaks_decode_nothing(conv):
    quiet, noisy = conv(), conv()
    for k in range(5):
        pq, oq = quiet.tick(silence(TICK_S))
        pn, on = noisy.tick(noise(TICK_S, seed=k))
        for p, o in ((pq, oq), (pn, on)):
            assert p.max_new_tokens == 0 and not o.token_ids and not p.transcript
            assert (p.token_ids is None) == (k > 0)    # only the first tick carries the system header
    never = conv()
    p, o = never.tick()                                # no audio at all
    assert p.max_new_tokens == 0 and not o.token_ids
    p, o = never.tick(new_turn=True)                   # a commit with nothing heard starts nothing
    assert p.token_ids is None and p.max_new_tokens == 0 and not p.transcript
    assert not quiet.heard and not noisy.heard and not never.heard


def test_clipped_speech_is_still_understood(conv):
    c = conv()
    loud = np.clip(question(GERMANY) * 8.0, -1.0, 1.0)   # heavily clipped, as from a hot microphone
    assert np.mean(np.abs(loud) >= 1.0) > 0.05
    c.stream(np.concatenate([loud, silence(4.0)]))
    assert len(c.heard) == 1, c.heard
    assert "Berlin" in c.said or "Germany" in c.heard[0], (c.heard, c.said)


def test_commit_flushes_the_utterance_without_waiting_for_silence(conv):
    c = conv()
    speech = np.concatenate([silence(0.3), trim(synth(JAPAN))])
    c.stream(speech)                                   # no trailing silence: the VAD is still in the utterance
    c.tick()
    assert not c.heard
    c.tick(new_turn=True)
    p, o = c.tick()                                    # the flushed utterance, transcribed beside the tick
    assert p.transcript and "Japan" in p.transcript, p.transcript
    assert p.max_new_tokens == TOKENS and o.token_ids
    for _ in range(4):
        c.tick()
    assert "Tokyo" in c.said, c.said


def test_a_new_utterance_barges_in_and_gets_its_own_answer(conv):
    c = conv(tokens=1)                                  # one token per tick: the first answer is slow
    c.stream(question(FRANCE, pad_s=0.8), tick_s=0.5)
    assert c.adapter.session_state(c.sid)["responding"] and c.finished == 0
    # Ask the next question while the first answer is still streaming.
    c.stream(np.concatenate([question(GERMANY), silence(6.0)]), tick_s=0.5)
    assert len(c.heard) == 2, c.heard
    # The first answer was cut when the second question began (before its words were known); the second
    # ran to its end.
    assert c.cancelled == 1 and c.finished == 2
    assert "Berlin" in c.answers[1] and "Berlin" not in c.answers[0], c.answers
    assert not c.adapter.session_state(c.sid)["responding"]


def test_free_running_decodes_every_tick_and_inserts_user_turns(conv):
    c = conv(mode="free_running")
    for _ in range(2):
        p, o = c.tick(silence(0.5))
        assert p.max_new_tokens == TOKENS and len(o.token_ids) == TOKENS and p.stop_token_ids == ()
    c.stream(np.concatenate([question(FRANCE), silence(1.0)]), tick_s=0.5)
    assert len(c.heard) == 1 and all(d == TOKENS for d in c.decoded_per_tick)
    assert "Paris" in c.answers[0], c.answers


def test_unknown_session_gets_an_error(adapter):
    p, = adapter.prepare([TickAudio("nobody", silence(0.1), max_tokens=4)])
    assert p.error and "not open" in p.error


def test_thirty_minutes_of_audio_keep_kv_bounded_and_a_fresh_question_is_answered(conv, engine):
    """30 minutes in accelerated time: mostly low noise and silence, a question every few minutes."""
    c = conv()
    reservation = engine.session_stats(c.eid).reservation
    spoken = [question(q, pad_s=1.5) for q in (GERMANY, JAPAN, FRANCE)]
    n = int(TICK_S * RATE)
    ticks = int(30 * 60 / TICK_S)
    peak = 0
    for k in range(ticks):
        if k % 150 == 75:                              # every 5 minutes, one of the questions
            audio = spoken[(k // 150) % len(spoken)]
            for i in range(0, len(audio), n):
                c.tick(audio[i:i + n])
        else:
            c.tick(noise(TICK_S, dbfs=-55.0, seed=k) if k % 2 else silence(TICK_S))
        peak = max(peak, engine.session_stats(c.eid).kv_blocks)
    assert len(c.heard) == 6, c.heard
    stats = engine.session_stats(c.eid)
    assert stats.num_tokens > 64 + 16, stats            # the window has slid
    assert peak <= reservation and stats.kv_blocks <= reservation
    c.stream(np.concatenate([question(GERMANY), silence(3.0)]))
    assert "Berlin" in c.answers[-1], c.answers


def test_an_answer_is_capped_and_typed_text_is_a_turn_too(engine, adapter):
    capped = CascadeAdapter(engine.tokenizer, vad=adapter.vad, asr=adapter.asr, max_response_tokens=3)
    c = Conversation(engine, capped, "capped", tokens=2)
    try:
        p, o = c.tick(text="Tell me a long story about a dragon.", new_turn=True)   # item + response.create
        assert p.max_new_tokens == 2 and len(o.token_ids) == 2
        assert not p.ends_response and not o.finished
        p, o = c.tick()
        assert p.max_new_tokens == 1 and p.ends_response  # 3 - 2 left: this tick ends the answer
        assert o.finished and not capped.session_state("capped")["responding"]
        p, o = c.tick()                                 # the cap: the adapter closes the answer itself
        assert p.token_ids == capped.chat.assistant_suffix and p.max_new_tokens == 0 and not o.token_ids
        for _ in range(3):
            p, o = c.tick(silence(0.5))
            assert p.token_ids is None and p.max_new_tokens == 0
        assert not capped.session_state("capped")["responding"]
    finally:
        c.close()
        capped.shutdown()


@pytest.mark.parametrize("spoken", [False, True])
def test_a_spoken_answers_first_tick_decodes_its_first_speech_piece_whole(engine, adapter, spoken):
    """Two tokens a tick (B = 250 ms): the first tick of a spoken answer decodes the first piece's three words
    and the token after them; later ticks, and text-only answers, keep the cap. The worker is told when speech
    is ready between ticks."""
    from metronome.audio.tts import SpeechSynthesizer, load_voice

    speech = SpeechSynthesizer(load_voice("espeak")) if spoken else None
    paced = CascadeAdapter(engine.tokenizer, vad=adapter.vad, asr=adapter.asr, speech=speech, max_tokens_per_tick=2)
    ready = threading.Event()
    paced.on_speech_ready(ready.set)   # the worker's hook: speech finished between ticks goes out at once
    c = Conversation(engine, paced, f"paced-{spoken}", tokens=25)
    try:
        first = speech.policy.first_words + 1 if spoken else 2
        p, o = c.tick(text="Tell me a long story about a dragon.", new_turn=True)
        assert p.max_new_tokens == first and len(o.token_ids) == first
        for _ in range(2):
            p, o = c.tick()
            assert p.max_new_tokens == 2 and len(o.token_ids) == 2
        if spoken:   # the synthesis thread said when the first piece was ready; it is there to take
            assert ready.wait(30) and paced.take_spoken(c.sid)[0]
    finally:
        c.close()
        paced.shutdown()
        if speech is not None:
            speech.close()


@pytest.mark.parametrize("interrupts", [True, False], ids=["interrupt_response", "no_interrupt"])
def test_speech_ready_between_ticks_while_the_user_speaks_over_the_answer(engine, adapter, interrupts):
    """The VAD heard the user start speaking during a spoken answer. With ``interrupt_response`` its ready speech
    is no longer handed out and the next tick cuts the answer (barge-in) with none of it sent; without, the
    speech goes on between ticks and the answer is not cut."""
    from metronome.audio.adapter import TurnDetection
    from metronome.audio.tts import SpeechSynthesizer, load_voice

    speech = SpeechSynthesizer(load_voice("espeak"))
    paced = CascadeAdapter(engine.tokenizer, vad=adapter.vad, asr=adapter.asr, speech=speech, max_tokens_per_tick=2)
    ready = threading.Event()
    paced.on_speech_ready(ready.set)
    c = Conversation(engine, paced, "talked-over", tokens=25)
    try:
        assert paced.set_turn_detection(c.sid, TurnDetection(interrupt_response=interrupts)) is None
        c.tick(text="Tell me a long story about a dragon.", new_turn=True)
        assert ready.wait(30) and paced.speaking(c.sid)
        paced.hear(c.sid, trim(synth("Wait, wait, stop there please.")))   # no pause after it: no turn yet
        assert paced.frontend.wait_idle(60) and paced.frontend.speech_started(c.sid)
        between = paced.take_spoken(c.sid)
        prepared, _ = c.tick()
        if interrupts:
            assert between == (b"", "")
            assert prepared.cancelled and not paced.speaking(c.sid) and paced.take_spoken(c.sid)[0] == b""
        else:
            assert between[0] and not prepared.cancelled and paced.speaking(c.sid)
    finally:
        c.close()
        paced.shutdown()
        speech.close()


def test_typed_text_waits_for_response_create(conv):
    """conversation.item.create adds a user turn; as in OpenAI's API only response.create answers it."""
    c = conv(tokens=2)
    p, o = c.tick(text="My name is Ada.")
    assert p.token_ids and p.max_new_tokens == 0 and not o.token_ids     # in the conversation, unanswered
    p, o = c.tick(text="What is my name?")
    assert p.max_new_tokens == 0 and not o.token_ids
    p, o = c.tick(new_turn=True)                                          # response.create
    assert p.max_new_tokens == 2 and len(o.token_ids) == 2


def test_text_typed_during_an_answer_joins_after_it(conv):
    """OpenAI lets an answer run when an item is added; the message joins the conversation once it ends."""
    c = conv(tokens=2)
    p, o = c.tick(text="Tell me a long story about a dragon.", new_turn=True)
    assert p.max_new_tokens == 2
    p, o = c.tick(text="Also, my name is Ada.")
    assert p.max_new_tokens == 2 and not p.token_ids               # the story goes on, nothing inserted into it
    assert c.adapter.session_state(c.sid)["responding"]
    p, o = c.tick(cancel=True)                                     # the story ends (response.cancel) ...
    suffix = c.adapter.chat.assistant_suffix
    assert p.token_ids[:len(suffix)] == suffix
    assert "Ada" in c.adapter.tokenizer.decode(p.token_ids)        # ... and the typed message joins, unanswered
    assert p.max_new_tokens == 0
    p, o = c.tick(new_turn=True)                                   # response.create answers it
    assert p.max_new_tokens == 2


def test_a_client_cap_on_the_answer_ends_it_within_the_adapters(conv):
    c = conv(tokens=2)
    p, o = c.tick(text="Tell me a long story about a dragon.", new_turn=True, max_output_tokens=3)
    assert p.max_new_tokens == 2 and not p.ends_response
    p, o = c.tick(max_output_tokens=3)
    assert p.max_new_tokens == 1 and p.ends_response and o.finished   # the client's 3, not the adapter's 256
    p, o = c.tick(text="And another one.", new_turn=True, max_output_tokens=10_000)   # above the adapter's cap: the adapter's holds
    assert p.max_new_tokens == 2 and not p.ends_response


def test_speech_start_and_stop_are_reported_in_ms_of_the_input(conv):
    c = conv()
    lead, said = 1.0, trim(synth(FRANCE))
    marks = []
    n = int(0.5 * RATE)
    audio = np.concatenate([silence(lead), said, silence(2.0)])
    for i in range(0, len(audio), n):
        p, _ = c.tick(audio[i:i + n])
        marks.append((p.speech_started_ms, p.speech_stopped_ms, bool(p.transcript)))
    started = [m[0] for m in marks if m[0] is not None]
    stopped = [(k, m[1]) for k, m in enumerate(marks) if m[1] is not None]
    assert len(started) == 1 and len(stopped) == 1, marks
    speech_ms = len(said) * 1000 // RATE
    assert abs(started[0] - lead * 1000) < 250                       # within the pre-roll and a window or two
    assert abs(stopped[0][1] - (lead * 1000 + speech_ms)) < 400      # the end pad and the VAD's hangover
    assert marks[stopped[0][0]][2]                                   # the transcript comes with the stop


def test_without_server_vad_only_the_commit_ends_the_turn(conv, adapter):
    from metronome.audio.adapter import TurnDetection

    c = conv()
    c.tick(silence(0.1), turn_detection=TurnDetection(server_vad=False))
    c.stream(np.concatenate([question(FRANCE, pad_s=2.0), silence(2.0)]))   # a long pause: not a turn's end
    assert not c.heard and c.finished == 0
    c.tick(new_turn=True)
    p, o = c.tick()                                                  # the committed turn, transcribed beside the tick
    # The whole turn, pauses included: Whisper tiny.en (int8) hears its last word as "and friends" on some CPUs
    # (AVX-512 VNNI), so the words checked are those every CPU here heard.
    assert p.transcript.startswith("What is the capital"), p.transcript
    assert p.max_new_tokens == TOKENS and o.token_ids


def test_turns_the_vad_ended_wait_for_response_create_when_create_response_is_off(conv):
    from metronome.audio.adapter import TurnDetection

    c = conv()
    c.tick(silence(0.1), turn_detection=TurnDetection(create_response=False, silence_duration_ms=300))
    c.stream(np.concatenate([question(GERMANY), silence(1.0)]))
    assert len(c.heard) == 1 and "Germany" in c.heard[0], c.heard
    assert not any(c.decoded_per_tick) and not c.adapter.session_state(c.sid)["responding"]
    p, o = c.tick(new_turn=True)                                     # response.create
    assert p.token_ids == c.adapter.chat.generation_prompt and p.max_new_tokens == TOKENS and o.token_ids


def test_turn_detection_the_vad_cannot_take_is_refused_on_that_session_only(engine, adapter):
    from metronome.audio.adapter import TurnDetection

    adapter.open_session("odd", "turn", "")
    adapter.open_session("fine", "turn", "")
    try:
        odd, fine = adapter.prepare([TickAudio("odd", turn_detection=TurnDetection(threshold=1.5)),
                                     TickAudio("fine", turn_detection=TurnDetection(threshold=0.005))])
        assert odd.error and "turn_detection" in odd.error
        assert fine.error is None   # a threshold near 0 still gets a valid lower hysteresis threshold
        assert adapter.set_turn_detection("odd", TurnDetection(silence_duration_ms=300)) is None  # it lives on
    finally:
        adapter.close_session("odd")
        adapter.close_session("fine")
