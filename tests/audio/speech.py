"""Test helper: synthesise speech with Debian ``espeak-ng`` at test time (nothing is downloaded).

``synth`` skips the calling test cleanly when ``espeak-ng`` is not installed (``apt-get install espeak-ng``).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np
import pytest

from metronome.audio.pcm import decode_pcm16, resample


def have_espeak() -> bool:
    return shutil.which("espeak-ng") is not None


def synth(text: str, rate: int = 16000, *, voice: str = "en-us", words_per_minute: int = 150) -> np.ndarray:
    """``text`` spoken by espeak-ng as float32 mono at ``rate`` Hz (espeak's 22.05 kHz output resampled by soxr)."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run([exe, "-v", voice, "-s", str(words_per_minute), "-w", str(path), text],
                       check=True, capture_output=True, timeout=60)
        with wave.open(str(path), "rb") as w:
            assert w.getsampwidth() == 2 and w.getnchannels() == 1, "espeak-ng writes 16-bit mono WAV"
            src_rate = w.getframerate()
            samples = decode_pcm16(w.readframes(w.getnframes()))
    return resample(samples, src_rate, rate)


def silence(seconds: float, rate: int = 16000) -> np.ndarray:
    return np.zeros(int(round(seconds * rate)), np.float32)


def trim(samples: np.ndarray, threshold: float = 1e-3) -> np.ndarray:
    """``samples`` without leading/trailing near-silence (espeak pads its output a little)."""
    idx = np.flatnonzero(np.abs(samples) > threshold)
    return samples[idx[0]: idx[-1] + 1] if idx.size else samples[:0]
