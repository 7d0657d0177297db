"""Whisper log-mel features on the tower's device against transformers' WhisperFeatureExtractor (the oracle),
clip by clip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metronome.audio.omni.thinker import whisper_extractor
from metronome.audio.omni.whisper_log_mel import WhisperLogMel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("mel,samples", [(128, 32000), (128, 16000 + 160 * 7), (80, 4000), (128, 31999)])
def test_features_are_the_extractors_per_clip(mel, samples):
    extractor = whisper_extractor(None, mel)
    rng = np.random.default_rng(samples)
    waves = (rng.standard_normal((3, samples)) * [[0.3], [0.01], [1.0]]).astype(np.float32)
    waves[1, : samples // 2] = 0.0    # a silent half: the floor 8 below the clip's own peak decides it
    got = WhisperLogMel(extractor, DEVICE)(waves)
    assert got.device.type == torch.device(DEVICE).type and got.shape == (3, mel, samples // extractor.hop_length)
    for row, wave in enumerate(waves):
        want = extractor([wave], sampling_rate=16000, padding=True, truncation=False, return_tensors="pt")
        torch.testing.assert_close(got[row].cpu(), want["input_features"][0], atol=1e-4, rtol=1e-4)
