"""MiniCPM-o 4.5's audio tower: 1-s chunks of 16 kHz audio → LLM input rows, as OpenBMB's published code does.

**Audio path** (``MiniCPMO.get_audio_embedding``), per 1-s chunk of 16 kHz audio:

1. Log-mel features: Whisper's front end (n_fft 400, hop 160, 80 mel bins, log10 floored at the
   clip's max - 8 dB, ``(x + 4) / 4``), which is what MiniCPM-o's ``MiniCPMAAudioProcessor`` computes
   for a clip by default: 16 000 samples → 100 frames.
2. ``apm``, a Whisper encoder (Whisper-medium: 24 layers, d_model 1024): conv1 → GELU → conv2 (stride 2)
   → GELU, + ``embed_positions[:50]``, the layers, the final ``layer_norm`` → [50, 1024]. transformers'
   own ``WhisperEncoder`` module holds the weights (``apm.*``), but its ``forward`` insists on 30 s of
   input, so the chunk runs through its submodules here exactly as MiniCPM-o's encoder subclass does.
3. ``audio_projection_layer`` (``MultiModalProjector``: linear1 → ReLU → linear2, 1024 → 4096 → 4096),
   THEN ``AvgPool1d(audio_pool_step=5)`` over time: [50, 4096] → [10, 4096]. (The published code
   projects before it pools; ReLU makes the order matter.)

So one second of audio is 10 LLM positions (``AudioSpec.tokens_per_chunk``); the adapter
(``minicpm_o.py``) places them in the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from metronome.audio.omni.tower_fp8 import quantize_tower_
from metronome.audio.omni.whisper_log_mel import WhisperLogMel
from metronome.errors import ConfigError

SAMPLE_RATE = 16000
HOP_LENGTH = 160
AUDIO_PREFIXES = ("apm.", "audio_projection_layer.")


@dataclass(frozen=True)
class AudioSpec:
    """The audio facts of a ``minicpmo`` config.json."""

    whisper: dict            # audio_config (a WhisperConfig as a dict)
    pool_step: int           # audio_pool_step (5)
    chunk_s: float           # audio_chunk_length (1.0)
    hidden_size: int         # the LLM's hidden size (the projection's output)

    @classmethod
    def from_config(cls, config: dict) -> "AudioSpec":
        if "audio_config" not in config or "hidden_size" not in config:
            raise ConfigError("the minicpmo config.json has no audio_config/hidden_size; is it a MiniCPM-o checkpoint?")
        spec = cls(dict(config["audio_config"]), int(config.get("audio_pool_step", 5)),
                   float(config.get("audio_chunk_length", 1.0)), int(config["hidden_size"]))
        if spec.pool_step < 1 or spec.chunk_s <= 0:
            raise ConfigError(f"audio_pool_step {spec.pool_step} / audio_chunk_length {spec.chunk_s} are invalid")
        return spec

    @property
    def chunk_samples(self) -> int:
        return int(round(self.chunk_s * SAMPLE_RATE))

    @property
    def chunk_frames(self) -> int:
        """Mel frames of one chunk (100 for 1 s)."""
        return self.chunk_samples // HOP_LENGTH

    @property
    def tokens_per_chunk(self) -> int:
        """LLM positions one chunk's audio fills: conv stride 2, then pooling (10 for 1 s, pool 5)."""
        encoder_frames = (self.chunk_frames - 1) // 2 + 1
        return (encoder_frames - self.pool_step) // self.pool_step + 1


class MultiModalProjector(nn.Module):
    """``audio_projection_layer``: linear1 → ReLU → linear2 (names as published)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.relu(self.linear1(x)))


class AudioTower(nn.Module):
    """``apm`` (transformers' WhisperEncoder) + ``audio_projection_layer`` + ``AvgPool1d``, per chunk."""

    def __init__(self, spec: AudioSpec) -> None:
        super().__init__()
        from transformers import WhisperConfig
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        fields = {k: v for k, v in spec.whisper.items() if k not in ("transformers_version", "architectures")}
        config = WhisperConfig(**fields)
        config._attn_implementation = "sdpa"   # as MiniCPMO.init_audio_module
        self.spec = spec
        self.apm = WhisperEncoder(config)
        # MiniCPMO: audio_output_dim = encoder_ffn_dim // 4 (= d_model for every Whisper size)
        self.audio_projection_layer = MultiModalProjector(config.encoder_ffn_dim // 4, spec.hidden_size)
        self.audio_avg_pooler = nn.AvgPool1d(spec.pool_step, stride=spec.pool_step)

    @classmethod
    def from_checkpoint(cls, checkpoint: Path, config: dict, dtype: torch.dtype, device: torch.device | str,
                        quantization: str | None = None) -> "AudioTower":
        """The checkpoint's tower; ``quantization="fp8"``: its Whisper layers' linear layers in FP8 (``tower_fp8``)."""
        from metronome.models.weights import fill_weights

        with torch.device("meta"):   # no random init of 300M parameters that are overwritten at once
            tower = cls(AudioSpec.from_config(config))
        tower = tower.to_empty(device=device).to(dtype)
        fill_weights(tower, checkpoint, lambda name: name if name.startswith(AUDIO_PREFIXES) else None)
        return quantize_tower_(tower.eval().requires_grad_(False), quantization)

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """Whisper over whole chunks: [n, mel_bins, frames] → last hidden state [n, frames/2, d_model].

        MiniCPMWhisperEncoder.forward without cache: positions from 0, full attention within the chunk.
        """
        apm = self.apm
        mel = mel.to(dtype=apm.conv1.weight.dtype, device=apm.conv1.weight.device)
        x = nn.functional.gelu(apm.conv1(mel))
        x = nn.functional.gelu(apm.conv2(x)).permute(0, 2, 1)
        if x.shape[1] > apm.embed_positions.weight.shape[0]:
            raise ValueError(f"{x.shape[1]} encoder frames exceed Whisper's {apm.embed_positions.weight.shape[0]}")
        x = x + apm.embed_positions.weight[:x.shape[1]]
        for layer in apm.layers:
            x = layer(x, None)
        return apm.layer_norm(x)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """[n, mel_bins, frames] → LLM input rows [n, tokens_per_chunk, hidden]: project, then pool."""
        x = self.audio_projection_layer(self.encode(mel))
        return self.audio_avg_pooler(x.transpose(1, 2)).transpose(1, 2)


class LogMel:
    """Whisper's log-mel front end on whole chunks, as MiniCPM-o's processor computes it for a short clip.

    ``MiniCPMOProcessor.process_audio`` zero-pads a clip to 30 s, extracts (transformers'
    ``WhisperFeatureExtractor`` formula: the max - 8 dB floor is taken over every frame) and keeps the
    clip's own frames. Frames past the clip's end + n_fft are pure padding and never raise the max, so
    padding with ``PAD`` zeros instead gives the same numbers for a fraction of the work.
    """

    PAD = 400   # n_fft: every frame that overlaps the clip is computed over the same zeros as with 30 s

    def __init__(self, mel_bins: int, device: torch.device | str = "cpu") -> None:
        from transformers import WhisperFeatureExtractor

        extractor = WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=SAMPLE_RATE, hop_length=HOP_LENGTH,
                                            n_fft=400)
        self.log_mel = WhisperLogMel(extractor, device)

    def __call__(self, chunks: list[np.ndarray]) -> torch.Tensor:
        """n equal-length chunks → [n, mel_bins, samples / hop], on the tower's device."""
        frames = chunks[0].size // HOP_LENGTH
        padded = np.zeros((len(chunks), chunks[0].size + self.PAD), np.float32)
        padded[:, :chunks[0].size] = np.stack(chunks)
        return self.log_mel(padded)[:, :, :frames]
