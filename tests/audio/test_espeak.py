"""The espeak-ng program as phonemizer and as the fallback voice (a separate process)."""

from __future__ import annotations

import re
import shutil

import pytest

from metronome.audio import espeak

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")


def test_clause_punctuation_is_put_back():
    # exact IPA varies between espeak-ng releases; the shape does not
    assert re.fullmatch(r"h\S+, w\S+!", espeak.phonemize("Hello, world!"))
    ph = espeak.phonemize("Yes: three things; one, two. Why?")
    assert [c for c in ph if c in ",.;:!?"] == [":", ";", ",", ".", "?"]


def test_text_without_a_final_mark_gets_none():
    assert espeak.phonemize("The capital of France is Paris")[-1].isalpha()


def test_numbers_are_read_as_words():
    ph = espeak.phonemize("I am 42.")
    assert not any(c.isdigit() for c in ph) and len(ph.split()) >= 3 and ph.endswith(".")   # "I am forty two."


def test_clauses_espeak_adds_get_a_pause():
    # espeak-ng reads "Dr." as "doctor" and ends a clause there; the text's marks no longer line up
    ph = espeak.phonemize("Is it 5 p.m. now? No")
    assert ph.count(",") == 1 and not ph.endswith(("?", ".", ","))


def test_text_that_looks_like_an_option_is_read():
    assert "mˈaɪnəs" in espeak.phonemize("-5 degrees")


def test_nothing_to_say():
    assert espeak.phonemize("...") == "" and espeak.ipa_clauses("  ") == []


def test_speak_returns_audio_at_its_rate():
    samples, rate = espeak.speak("Hello there.")
    assert rate == 22050 and 0.3 < samples.size / rate < 3.0 and 0.05 < abs(samples).max() <= 1.0


def test_missing_program_is_named(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get install espeak-ng"):
        espeak.phonemize("hello")
