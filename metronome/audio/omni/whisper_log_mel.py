"""Whisper log-mel features computed on the audio tower's device and left there.

transformers' ``WhisperFeatureExtractor`` computes them with torch (on the GPU when asked) but returns them to
the host as numpy, after a host pass over every clip; a tower on the GPU then copies them back. For 192 clips of
2 s that round trip took longer than the features (docs/benchmarks/models.md). ``WhisperLogMel`` is the
extractor's torch path step for step (Hann-window STFT, power, the extractor's own mel filters, log10, the floor
8 below each clip's peak, rescaling), reading every setting from the extractor it is given.
"""

from __future__ import annotations

import numpy as np
import torch


class WhisperLogMel:
    """``extractor``'s log-mel features of equal-length clips, on ``device``."""

    def __init__(self, extractor, device: torch.device | str) -> None:
        self.extractor = extractor
        self.device = torch.device(device)
        self.mel_filters = torch.from_numpy(np.asarray(extractor.mel_filters)).to(self.device, torch.float32)
        self.window = torch.hann_window(extractor.n_fft, device=self.device)

    def __call__(self, waves: np.ndarray) -> torch.Tensor:
        """[clips, samples] → [clips, mel, samples // hop] float32 (the extractor's frames of each clip)."""
        wave = torch.from_numpy(np.asarray(waves, np.float32)).to(self.device)
        if self.extractor.dither:
            wave = wave + self.extractor.dither * torch.randn_like(wave)
        stft = torch.stft(wave, self.extractor.n_fft, self.extractor.hop_length, window=self.window,
                          return_complex=True)
        log_spec = (self.mel_filters.T @ (stft[..., :-1].abs() ** 2)).clamp_(min=1e-10).log10_()
        floor = log_spec.amax(dim=(1, 2), keepdim=True) - 8.0
        return (torch.maximum(log_spec, floor) + 4.0) / 4.0
