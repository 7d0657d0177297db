"""`metronome demo --speech`: the bundled spoken questions through a served session, heard and answered."""

from __future__ import annotations

import pytest

from metronome.cli.demo import sample_conversation
from metronome.cli.main import main

pytestmark = pytest.mark.slow


def test_the_bundled_samples_are_small_16k_mono_speech():
    samples = sample_conversation()
    assert len(samples) >= 2
    for name, pcm, rate in samples:
        assert name.endswith(".wav") and rate == 16000 and 1.0 < len(pcm) / 2 / rate < 5.0


def test_demo_speech_prints_what_was_heard_and_said(capsys):
    assert main(["demo", "--speech", "--speed", "4", "--budget-ms", "1000"]) == 0
    out = capsys.readouterr().out
    assert out.count("heard:") == len(sample_conversation()), out
    assert "France" in out and "Paris" in out, out
    assert "ticks: median" in out
