"""The Qwen2.5-Omni adapter: 2-s audio blocks → the thinker's audio encoder → embeddings spliced into its prompt.

The audio path is the model's own: a Whisper log-mel front end (16 kHz, 128 mel bins, 10 ms hop; the
checkpoint's ``preprocessor_config.json`` when it has one) and transformers' ``Qwen2_5OmniAudioEncoder``
(reused as is, its weights read from the checkpoint's ``thinker.audio_tower.*``). The encoder attends
within windows of ``2 * n_window`` mel frames (200 = 2 s), so a session's audio is cut into 2-s blocks
and each block is encoded on its own: what the encoder does with the same features inside a long
recording (its windows never see each other), with no encoder state carried between ticks (per
session only the < 2 s of audio not yet forming a block is kept). The features themselves differ from
a whole-recording pass only at block edges (the STFT window sees zeros past the block, as the
processor pads a clip) and in Whisper's log-mel floor, taken per tick's clip instead of per recording.
A block gives 50 embeddings (25 per second, one per TMRoPE time step of 40 ms). Every tick, the blocks
of ALL sessions go through the feature extractor and the encoder in one call each.

Prompt layout (the Qwen2.5-Omni chat template; B = 2 s, so one block per tick)::

    header (first tick; what the sinks pin):  <|im_start|>system\\n{system prompt}<|im_end|>\\n
    free running, first tick:   <|im_start|>user\\n <|audio_bos|> 50 × <|AUDIO|> <|audio_eos|> {instruction}
                                <|im_end|>\\n<|im_start|>assistant\\n                       decode max_tokens
    free running, later ticks:  <|audio_bos|> 50 × <|AUDIO|> <|audio_eos|>                 decode max_tokens

``<|AUDIO|>`` rows are replaced by the encoder's outputs (as transformers' ``masked_scatter`` does);
the rest is embedded with the decoder's own table (``AdapterContext.embed``). The prepared input is
``embeds`` whenever audio is in it, else plain ``token_ids``.

Positions: for audio and text, TMRoPE's three components are equal and consecutive (transformers'
``get_rope_index`` gives every token, audio or text, the next integer), so the engine's 1-D positions
are exact (see ``metronome/models/omni/qwen2_5_omni.py`` and its tests).

Modes, held audio and refused input are the thinker adapter's (``metronome/audio/omni/thinker.py``):
``"free_running"`` (default) or ``"turn"``; audio heard while a turn-mode answer is decoded waits, at
most ``max_pending_s``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from metronome.audio.adapter import AdapterContext
from metronome.audio.omni import thinker
from metronome.audio.omni.thinker import MODES, SAMPLE_RATE, ThinkerAdapter, splice
from metronome.audio.omni.thinker import window_sdpa as packed_sdpa
from metronome.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["MODES", "SAMPLE_RATE", "SYSTEM_PROMPT", "AudioFrontEnd", "AudioMarkers", "Qwen25OmniAdapter",
           "audio_config", "audio_tower_weight_name", "build_adapter", "build_audio_encoder", "feature_extractor_for",
           "load_audio_encoder", "packed_sdpa", "splice"]

# The system prompt Qwen2.5-Omni was tuned with (its model card asks for it verbatim).
SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
                 "auditory and visual inputs, as well as generating text and speech.")


# ---------------------------------------------------------------------------------------------- encoder
def audio_tower_weight_name(stored: str) -> str | None:
    """A checkpoint tensor name → the audio encoder's parameter name, or None for every other part.

    >>> audio_tower_weight_name("thinker.audio_tower.layers.0.fc1.weight")
    'layers.0.fc1.weight'
    >>> audio_tower_weight_name("audio_tower.proj.bias")     # a thinker-only checkpoint
    'proj.bias'
    >>> audio_tower_weight_name("thinker.model.norm.weight") is None
    True
    """
    name = stored.removeprefix("thinker.").removeprefix("model.")
    return name.removeprefix("audio_tower.") if name.startswith("audio_tower.") else None


def audio_config(config: dict):
    """The thinker's ``Qwen2_5OmniAudioEncoderConfig`` from a full or thinker-only ``config.json``."""
    from transformers import Qwen2_5OmniAudioEncoderConfig

    from metronome.models.omni.qwen2_5_omni import thinker_config

    return thinker.audio_encoder_config(Qwen2_5OmniAudioEncoderConfig, thinker_config(config))


def build_audio_encoder(config, device: torch.device | str, dtype: torch.dtype, packed: bool = True) -> nn.Module:
    """transformers' ``Qwen2_5OmniAudioEncoder`` of ``config``, uninitialised (fill it from a checkpoint).

    ``packed`` runs its window attention through ``packed_sdpa`` (one call per layer for the whole batch).
    """
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    return thinker.build_audio_encoder(Qwen2_5OmniAudioEncoder, config, device, dtype, packed)


def load_audio_encoder(checkpoint: Path, config: dict, device: torch.device | str, dtype: torch.dtype,
                       packed: bool = True) -> nn.Module:
    """The checkpoint's audio tower on ``device`` in ``dtype``; every one of its weights must be found."""
    from metronome.models.weights import fill_weights

    encoder = build_audio_encoder(audio_config(config), device, dtype, packed)
    fill_weights(encoder, Path(checkpoint), audio_tower_weight_name)
    return encoder


def feature_extractor_for(checkpoint: Path | None, num_mel_bins: int):
    """The checkpoint's WhisperFeatureExtractor (``preprocessor_config.json``), else Qwen2.5-Omni's settings."""
    return thinker.whisper_extractor(checkpoint, num_mel_bins)


def _conv_rows(frames: int) -> int:
    """Rows the encoder's first convolution (stride 2) makes of ``frames`` mel frames: its attention runs over them."""
    return (frames - 1) // 2 + 1


class AudioFrontEnd(thinker.TowerFrontEnd):
    """Whisper features + the audio tower over a batch of clips: ``encode(clips)`` → one [n_i, hidden] each.

    Features are computed as Qwen2.5-Omni's processor computes them (zero padding after the clip, log-mel
    floor per clip), but only over the clip itself plus one FFT window instead of 30 s.
    """

    def __init__(self, encoder: nn.Module, feature_extractor, device: torch.device | str, dtype: torch.dtype,
                 quantization: str | None = None) -> None:
        super().__init__(encoder, feature_extractor, device, dtype, quantization)
        self.block_frames = 2 * int(encoder.config.n_window)   # the encoder's attention window
        self.block_samples = self.block_frames * self.hop

    @classmethod
    def from_checkpoint(cls, checkpoint: Path, config: dict, device, dtype, packed: bool = True,
                        quantization: str | None = None) -> "AudioFrontEnd":
        encoder = load_audio_encoder(checkpoint, config, device, dtype, packed)
        return cls(encoder, feature_extractor_for(checkpoint, encoder.config.num_mel_bins), device, dtype,
                   quantization)

    def frames(self, samples: int) -> int:
        """Mel frames of a clip of ``samples`` (the processor's attention-mask count)."""
        return -(-samples // self.hop)

    def tokens_for_frames(self, frames: int) -> int:
        """Embeddings the encoder makes of ``frames`` mel frames (transformers' output-length formula)."""
        return max(0, (_conv_rows(frames) - 2) // 2 + 1)

    def tokens(self, samples: int) -> int:
        return self.tokens_for_frames(self.frames(samples))

    def flush_samples(self, samples: int) -> int:
        """All of them: a partial hop is one more mel frame (the processor pads the clip with zeros)."""
        return samples

    @property
    def tokens_per_block(self) -> int:
        return self.tokens_for_frames(self.block_frames)

    def extract(self, clips: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features of every clip, packed: ([mel, sum of frames], frames per clip)."""
        longest = max(c.size for c in clips) + self.features.n_fft
        longest = -(-longest // self.hop) * self.hop
        waves = np.zeros((len(clips), longest), np.float32)     # the processor's zero padding after each clip
        for row, clip in enumerate(clips):
            waves[row, :clip.size] = clip
        frames = [self.frames(c.size) for c in clips]
        lengths = torch.tensor(frames, dtype=torch.long)
        feats = self.log_mel(waves)
        if len(set(frames)) == 1:   # the steady state: one block per clip
            return feats[:, :, :frames[0]].permute(1, 0, 2).reshape(feats.shape[1], -1), lengths
        return torch.cat([f[:, :n] for f, n in zip(feats, frames)], dim=1), lengths

    def window_bounds(self, frames: list[int]) -> np.ndarray:
        """The encoder's attention windows over its conv rows (one per ``block_frames`` of each clip), as the
        cumulative bounds transformers computes from the chunk lengths on the device."""
        block = self.block_frames
        rows = [_conv_rows(min(block, n - start)) for n in frames for start in range(0, n, block)]
        return np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)

    def encode_features(self, features: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """The audio tower over packed features ([mel, frames], frames per clip): one call, split per clip."""
        return self.run_tower(features, lengths, self.window_bounds(lengths.tolist()))

    def encode(self, clips: list[np.ndarray]) -> list[torch.Tensor]:
        return self.encode_features(*self.extract(clips)) if clips else []


# ---------------------------------------------------------------------------------------------- adapter
class AudioMarkers(thinker.AudioMarkers):
    """The thinker's audio token ids (from its config: the ids its embeddings and placeholder mask use)."""

    @classmethod
    def from_config(cls, config: dict) -> "AudioMarkers":
        """<|audio_bos|>, <|AUDIO|> (replaced by encoder outputs), <|audio_eos|>."""
        from metronome.models.omni.qwen2_5_omni import thinker_config

        cfg = thinker_config(config)
        return cls(int(cfg.get("audio_start_token_id", 151647)),
                   int(cfg.get("audio_token_index", cfg.get("audio_token_id", 151646))),
                   int(cfg.get("audio_end_token_id", 151648)))


class Qwen25OmniAdapter(ThinkerAdapter):
    """Qwen2.5-Omni's audio front end and prompt layout for the thinker on the engine.

    ``frontend``: the feature extractor + audio tower (``AudioFrontEnd``). ``instruction``: text placed
    after the first audio of a session's first user turn ("" for none). ``system_prompt``: the header's
    content when a session gives no instructions. ``max_pending_s`` bounds the audio a session holds.
    """

    name = "qwen2_5_omni"

    def __init__(self, tokenizer, frontend: AudioFrontEnd, markers: AudioMarkers, embed, *,
                 max_input_tokens: int = 1024, instruction: str = "", system_prompt: str = SYSTEM_PROMPT,
                 max_response_tokens: int = 256, max_pending_s: float = 10.0, default_mode: str = "free_running",
                 stop_token_ids: tuple[int, ...] | None = None) -> None:
        super().__init__(tokenizer, frontend, markers, embed, max_input_tokens=max_input_tokens,
                         instruction=instruction, system_prompt=system_prompt, max_response_tokens=max_response_tokens,
                         max_pending_s=max_pending_s, default_mode=default_mode, stop_token_ids=stop_token_ids)

    def session_state(self, session_id: str) -> dict:
        return {**super().session_state(session_id), "detok_held": self._sessions[session_id].detok.held}


def build_adapter(context: AdapterContext) -> Qwen25OmniAdapter:
    """The adapter over the engine's checkpoint: its audio tower, feature extractor and audio token ids."""
    from metronome.models.weights import read_config

    if context.checkpoint is None:
        raise ConfigError("the qwen2_5_omni adapter loads its audio encoder from the checkpoint directory; "
                          "this engine was built from a model object")
    config = read_config(Path(context.checkpoint))
    frontend = AudioFrontEnd.from_checkpoint(Path(context.checkpoint), config, context.device, context.dtype,
                                             quantization=context.quantization)
    if frontend.sample_rate != SAMPLE_RATE:
        log.info("qwen2_5_omni feature extractor runs at %d Hz", frontend.sample_rate)
    return Qwen25OmniAdapter(context.tokenizer, frontend, AudioMarkers.from_config(config), context.embed,
                             max_input_tokens=context.max_input_tokens)
