"""Streaming Silero VAD: segmentation of synthesised speech, chunk-size invariance, per-session state."""

from __future__ import annotations

import numpy as np
import pytest

from metronome.audio.vad import SAMPLE_RATE, SileroVad, VadConfig, silero_model_path
from tests.audio.speech import silence, synth, trim

SR = SAMPLE_RATE


@pytest.fixture(scope="module")
def vad():
    return SileroVad()


@pytest.fixture(scope="module")
def sentences():
    return (trim(synth("What is the capital of France?")), trim(synth("Please turn on the kitchen lights.")))


def run(stream, audio, chunk):
    utts, speaking = [], []
    for i in range(0, len(audio), chunk):
        ev = stream.feed(audio[i:i + chunk])
        utts += ev.utterances
        speaking.append(ev.speaking)
    return utts, speaking


def spans(utts):
    return [(u.start, u.end, u.forced) for u in utts]


def test_model_is_bundled_in_the_wheel():
    path = silero_model_path()
    assert path.is_file() and path.parent.name == "data" and path.parent.parent.name == "silero_vad"


def test_config_validation():
    with pytest.raises(ValueError):
        VadConfig(threshold=1.5)
    with pytest.raises(ValueError):
        VadConfig(min_silence_ms=50, speech_pad_ms=100)
    assert VadConfig().negative == pytest.approx(0.35)


def test_silence_gives_nothing(vad):
    s = vad.open()
    utts, speaking = run(s, silence(3.0), 320)
    assert utts == [] and not any(speaking)
    assert s.flush() is None


def test_low_level_noise_is_not_speech(vad):
    rng = np.random.default_rng(0)
    noise = (rng.standard_normal(3 * SR) * 0.003).astype(np.float32)     # about -50 dBFS white noise
    utts, speaking = run(vad.open(), noise, 320)
    assert utts == [] and not any(speaking)


def test_one_sentence_one_utterance(vad, sentences):
    speech = sentences[0]
    audio = np.concatenate([silence(1.0), speech, silence(1.0)])
    s = vad.open()
    utts, speaking = run(s, audio, 320)
    assert len(utts) == 1 and not speaking[-1] and any(speaking)
    u = utts[0]
    assert not u.forced
    np.testing.assert_array_equal(u.audio, audio[u.start:u.end])
    # covers the speech (give or take a window at each edge) plus the 100 ms pads
    assert u.start <= SR + 512 and u.end >= SR + len(speech) - 512
    assert len(speech) / SR - 0.1 <= u.duration_s <= len(speech) / SR + 0.2 + 0.15


def test_two_sentences_two_utterances(vad, sentences):
    a, b = sentences
    audio = np.concatenate([silence(0.5), a, silence(1.0), b, silence(1.0)])
    utts, _ = run(vad.open(), audio, 320)
    assert len(utts) == 2
    assert utts[0].end <= utts[1].start
    assert utts[0].end < int(0.5 * SR) + len(a) + int(0.5 * SR) < utts[1].start + int(0.5 * SR)


def test_chunk_size_does_not_change_segmentation(vad, sentences):
    a, b = sentences
    audio = np.concatenate([silence(0.7), a, silence(1.0), b, silence(0.8)])
    small, _ = run(vad.open(), audio, 320)       # 20 ms
    large, _ = run(vad.open(), audio, 2 * SR)    # 2 s
    odd, _ = run(vad.open(), audio, 1234)
    assert spans(small) == spans(large) == spans(odd) and len(small) == 2
    for x, y in zip(small, large):
        np.testing.assert_array_equal(x.audio, y.audio)


def test_streams_are_independent(vad, sentences):
    a, b = sentences
    audio_a = np.concatenate([silence(0.5), a, silence(1.0)])
    audio_b = np.concatenate([silence(1.3), b, silence(0.7), a, silence(0.8)])
    solo_a, _ = run(vad.open(), audio_a, 320)
    solo_b, _ = run(vad.open(), audio_b, 320)
    sa, sb = vad.open(), vad.open()
    got_a, got_b = [], []
    for i in range(0, max(len(audio_a), len(audio_b)), 320):
        got_a += sa.feed(audio_a[i:i + 320]).utterances
        got_b += sb.feed(audio_b[i:i + 320]).utterances
    assert spans(got_a) == spans(solo_a) and len(got_a) == 1
    assert spans(got_b) == spans(solo_b) and len(got_b) == 2


def test_feed_many_matches_feed(vad, sentences):
    a, b = sentences
    audios = [np.concatenate([silence(0.5), a, silence(1.0)]), np.concatenate([silence(1.1), b, silence(1.0)]), silence(2.0)]
    solo = [spans(run(vad.open(), x, 320)[0]) for x in audios]
    streams = [vad.open() for _ in audios]
    got = [[] for _ in audios]
    chunk = [320, 640, 960]                      # different tick sizes: streams have different window counts
    for t in range(0, 200):
        evs = vad.feed_many(streams, [x[t * c:(t + 1) * c] for x, c in zip(audios, chunk)])
        for g, ev in zip(got, evs):
            g += ev.utterances
    assert [spans(g) for g in got] == solo
    assert [len(s) for s in solo] == [1, 1, 0]


def test_max_utterance_forces_cuts_and_bounds_memory(vad, sentences):
    speech = np.concatenate([sentences[0], sentences[1]])        # ~3.6 s of continuous speech
    audio = np.concatenate([silence(0.3), speech, silence(1.0)])
    s = vad.open(VadConfig(max_utterance_s=1.0))
    utts, _ = run(s, audio, 320)
    assert len(utts) >= 3 and any(u.forced for u in utts)
    assert all(u.end - u.start <= SR + 512 for u in utts)
    for x, y in zip(utts, utts[1:]):
        assert x.end <= y.start


def test_flush_returns_the_open_utterance(vad, sentences):
    audio = np.concatenate([silence(0.5), sentences[0]])
    s = vad.open()
    utts, speaking = run(s, audio, 320)
    assert utts == [] and speaking[-1]
    u = s.flush()
    assert u is not None and u.duration_s > 1.0 and not s.speaking
    assert s.flush() is None


def test_speech_start_and_stop_are_marked_where_utterances_begin_and_end(vad, sentences):
    a, b = sentences
    audio = np.concatenate([silence(0.5), a, silence(1.0), b, silence(1.0)])
    stream, starts, stops, utts = vad.open(), [], [], []
    for i in range(0, len(audio), 8000):            # 0.5-s feeds, as a tick brings them
        ev = stream.feed(audio[i:i + 8000])
        utts += ev.utterances
        starts += [ev.started_at] if ev.started_at is not None else []
        stops += [ev.stopped_at] if ev.stopped_at is not None else []
    assert len(utts) == 2
    assert starts == [u.start for u in utts] and stops == [u.end for u in utts]


def test_a_longer_silence_setting_keeps_a_pause_inside_the_utterance(vad, sentences):
    a, b = sentences
    audio = np.concatenate([silence(0.5), a, silence(0.7), b, silence(2.0)])
    default, _ = run(vad.open(), audio, 320)
    patient = vad.open()
    patient.reconfigure(VadConfig(min_silence_ms=1200))   # the client's silence_duration_ms
    joined, _ = run(patient, audio, 320)
    assert len(default) == 2 and len(joined) == 1
    assert joined[0].start == default[0].start and joined[0].end > default[1].start


def test_the_tentative_utterance_is_the_one_the_silence_ends_or_none_once_speech_goes_on(vad, sentences):
    config = VadConfig(min_silence_ms=300, speech_pad_ms=100)
    audio = np.concatenate([silence(0.3), sentences[0], silence(0.6)])
    s = vad.open(config)
    guesses, ended = [], []
    for i in range(0, len(audio), 320):   # 20-ms chunks: every state the silence passes through
        ended += s.feed(audio[i:i + 320]).utterances
        if not ended and (t := s.tentative()) is not None:
            guesses.append(t)
    assert len(ended) == 1 and guesses, "the silence gave no tentative utterance before it ended the utterance"
    last, final = guesses[-1], ended[0]
    assert (last.start, last.end) == (final.start, final.end) and np.array_equal(last.audio, final.audio)
    assert s.tentative() is None                               # ended: nothing open

    s = vad.open(config)                                       # a pause past the pad, then more speech
    s.feed(np.concatenate([silence(0.3), sentences[0], silence(0.3)]))
    assert s.tentative() is not None
    s.feed(sentences[1][:8000])
    assert s.speaking and s.tentative() is None
