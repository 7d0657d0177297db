"""The Qwen3-Omni adapter: whole seconds of audio → the thinker's audio encoder → embeddings in its prompt.

Audio path, the model's own: Whisper log-mel features (16 kHz, 128 mel bins, 10 ms hop; the checkpoint's
``preprocessor_config.json`` when it has one, computed as Qwen3-Omni's processor does: ``padding=True``,
no truncation) and transformers' ``Qwen3OmniMoeAudioEncoder``, reused as is, its weights read from the
checkpoint's ``thinker.audio_tower.*``. The encoder convolves its input in chunks of ``2 * n_window``
mel frames (100 = 1 s, 13 embeddings each, the sinusoidal positions restarting per chunk) and attends
within windows of ``n_window_infer`` frames (800 = 8 s). A session's audio is therefore taken in whole
seconds: each tick's whole seconds (2 at B = 2 s: 26 embeddings) form one clip, encoded on its own
exactly as the encoder encodes a recording of that length; what is short of a second waits for the
next tick. No encoder state is carried between ticks (per session only < 1 s of audio, or at most
``max_pending_s`` while a turn-mode answer is being decoded). The cost of bounding the state: a clip
attends over itself (2 s), not over the 8-s windows an offline pass over a long recording would use.
Every tick, the clips of ALL sessions go through one feature extraction per clip length (one in the
steady state) and one encoder call; the encoder's window attention runs as one batched SDPA per layer
(``window_sdpa``) instead of transformers' per-window loop.

Prompt layout (Qwen3-Omni's chat template; ChatML turns)::

    header (first tick; what the sinks pin):  <|im_start|>system\\n{instructions}<|im_end|>\\n
    free running, first tick:   <|im_start|>user\\n<|audio_start|> 26 × <|audio_pad|> <|audio_end|>{instruction}
                                <|im_end|>\\n<|im_start|>assistant\\n                      decode max_tokens
    free running, later ticks:  <|audio_start|> 26 × <|audio_pad|> <|audio_end|>           decode max_tokens

``<|audio_pad|>`` rows are replaced by the encoder's outputs (transformers' ``masked_scatter``); the
other tokens are embedded with the decoder's table (``AdapterContext.embed``). The prepared input is
``embeds`` when audio is in it, else ``token_ids``.

Positions: with audio and text only, ``get_rope_index`` gives every token the next integer in all three
MRoPE components (audio tokens included), and interleaved MRoPE with three equal components is 1-D
RoPE: the engine's positions are exact (tests/models/omni/test_qwen3_omni.py checks it).

Modes, held audio and refused input are the thinker adapter's (``metronome/audio/omni/thinker.py``):
``"free_running"`` (default) or ``"turn"``; audio arriving during a turn-mode answer waits, at most
``max_pending_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from metronome.audio.adapter import AdapterContext
from metronome.audio.omni import thinker
from metronome.audio.omni.thinker import MODES, SAMPLE_RATE, ThinkerAdapter, window_sdpa
from metronome.errors import ConfigError

__all__ = ["MODES", "SAMPLE_RATE", "AudioFrontEnd", "AudioMarkers", "Qwen3OmniAdapter", "TowerLayout", "audio_config",
           "audio_tower_weight_name", "build_adapter", "build_audio_encoder", "feature_extractor_for", "output_tokens",
           "window_sdpa"]


# ---------------------------------------------------------------------------------------------- encoder
def audio_tower_weight_name(stored: str) -> str | None:
    """A checkpoint tensor name → the audio encoder's parameter name, or None for every other part.

    >>> audio_tower_weight_name("thinker.audio_tower.layers.0.fc1.weight")
    'layers.0.fc1.weight'
    >>> audio_tower_weight_name("thinker.lm_head.weight") is None
    True
    """
    name = stored.removeprefix("thinker.")
    return name.removeprefix("audio_tower.") if name.startswith("audio_tower.") else None


def audio_config(config: dict):
    """The thinker's ``Qwen3OmniMoeAudioEncoderConfig`` from a full or thinker-only ``config.json``."""
    from transformers import Qwen3OmniMoeAudioEncoderConfig

    from metronome.models.omni.qwen3_omni import thinker_config

    return thinker.audio_encoder_config(Qwen3OmniMoeAudioEncoderConfig, thinker_config(config))


def build_audio_encoder(config, device: torch.device | str, dtype: torch.dtype, batched: bool = True) -> nn.Module:
    """transformers' ``Qwen3OmniMoeAudioEncoder`` of ``config``, uninitialised (fill it from a checkpoint).

    ``batched`` runs its window attention through ``window_sdpa`` (one SDPA per layer for the whole batch).
    """
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    return thinker.build_audio_encoder(Qwen3OmniMoeAudioEncoder, config, device, dtype, batched)


def _conv_frames(n):
    """Embeddings the encoder's three stride-2 convolutions make of ``n`` mel frames (one chunk; an int or an
    array of them)."""
    return ((((n - 1) // 2 + 1) - 1) // 2 + 1 - 1) // 2 + 1


def output_tokens(frames: int, n_window: int) -> int:
    """Embeddings the encoder makes of ``frames`` mel frames: whole chunks of ``2 * n_window`` frames, then
    the rest. transformers' formula, which writes the whole chunk's count as 13 (= ``_conv_frames(100)``,
    the published ``n_window = 50``); computed here so other window sizes stay consistent.

    >>> output_tokens(200, 50), output_tokens(150, 50), output_tokens(7, 50)
    (26, 20, 1)
    """
    chunk = 2 * n_window
    rest = frames % chunk
    return (_conv_frames(rest) if rest else 0) + (frames // chunk) * _conv_frames(chunk)


def _leading_slots(lengths: np.ndarray) -> np.ndarray:
    """Flat indices of the first ``lengths[i]`` slots of each row of a [len(lengths), max(lengths)] grid."""
    return np.flatnonzero(np.arange(int(lengths.max()))[None, :] < lengths[:, None])


@dataclass(frozen=True)
class TowerLayout:
    """What transformers' encoder works out from the clips' frame counts, computed on the host.

    From lengths on the device, its own path syncs the host once per clip to lay out the attention windows;
    handed these, it skips that bookkeeping. ``chunk_lengths``: mel frames of each ``2 · n_window`` chunk,
    clip after clip; ``valid_indices``: the rows of the padded conv output that are real; ``cu_seqlens``: the
    attention windows' bounds over those rows.
    """

    chunk_lengths: np.ndarray   # [chunks]
    valid_indices: np.ndarray   # [rows]
    cu_seqlens: np.ndarray      # [windows + 1]

    @classmethod
    def of(cls, frames: list[int], n_window: int, n_window_infer: int) -> "TowerLayout":
        chunk = 2 * n_window
        chunk_lengths = np.array([min(chunk, n - start) for n in frames for start in range(0, n, chunk)])
        after = _conv_frames(chunk_lengths)
        longest_after = int(after.max())
        valid = _leading_slots(after)
        window = longest_after * (n_window_infer // chunk)
        bounds = [0]
        for n in frames:
            tokens = output_tokens(n, n_window)
            for start in range(0, tokens, window):
                bounds.append(bounds[-1] + min(window, tokens - start))
        return cls(chunk_lengths, valid, np.array(bounds, np.int32))

    @property
    def full(self) -> bool:
        """Every chunk whole (the steady state): the padded chunks are a reshape, every conv row is kept."""
        return bool((self.chunk_lengths == self.chunk_lengths.max()).all())

    def chunk_slots(self) -> np.ndarray:
        """Each input frame's row in the padded chunks ([chunks · longest chunk], row-major)."""
        return _leading_slots(self.chunk_lengths)


class AudioFrontEnd(thinker.TowerFrontEnd):
    """Whisper features + the audio tower over a batch of clips: ``encode(clips)`` → one [n_i, hidden] each."""

    def __init__(self, encoder: nn.Module, feature_extractor, device: torch.device | str, dtype: torch.dtype,
                 quantization: str | None = None) -> None:
        super().__init__(encoder, feature_extractor, device, dtype, quantization)
        self.n_window = int(encoder.config.n_window)
        self.block_samples = 2 * self.n_window * self.hop         # one conv chunk: 1 s
        self.tokens_per_block = output_tokens(2 * self.n_window, self.n_window)

    @classmethod
    def from_checkpoint(cls, checkpoint: Path, config: dict, device, dtype, batched: bool = True,
                        quantization: str | None = None) -> "AudioFrontEnd":
        from metronome.models.weights import fill_weights

        encoder = build_audio_encoder(audio_config(config), device, dtype, batched)
        fill_weights(encoder, Path(checkpoint), audio_tower_weight_name)
        return cls(encoder, feature_extractor_for(checkpoint, encoder.config.num_mel_bins), device, dtype,
                   quantization)

    def tokens_for_frames(self, frames: int) -> int:
        return output_tokens(frames, self.n_window)

    def tokens(self, samples: int) -> int:
        return output_tokens(samples // self.hop, self.n_window)

    def flush_samples(self, samples: int) -> int:
        """Whole hops only: the processor makes no frame of a partial hop, so it waits for the next tick."""
        return samples // self.hop * self.hop

    def extract(self, clips: list[np.ndarray]) -> list[torch.Tensor]:
        """Each clip's log-mel features [mel, frames], as the processor computes them for that clip alone
        (one batch per distinct length, so padding never changes a clip's features)."""
        out: list[torch.Tensor | None] = [None] * len(clips)
        by_length: dict[int, list[int]] = {}
        for i, clip in enumerate(clips):
            by_length.setdefault(clip.size, []).append(i)
        for indices in by_length.values():
            feats = self.log_mel(np.stack([clips[i] for i in indices]))
            for row, i in enumerate(indices):
                out[i] = feats[row]
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def encode_features(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """The audio tower over every clip's features in one call, split per clip, handed its layout
        (``TowerLayout``)."""
        frames = [f.shape[1] for f in features]
        lengths = torch.tensor(frames, dtype=torch.long)
        layout = TowerLayout.of(frames, self.n_window, int(self.encoder.config.n_window_infer))
        features = torch.cat(features, dim=1).to(self.device, self.dtype)
        mel, chunks, longest = features.shape[0], len(layout.chunk_lengths), int(layout.chunk_lengths.max())
        if layout.full:   # a view of the features; every conv row kept (no index to copy to the device)
            padded = features.T.reshape(chunks, longest, mel)
            valid = torch.arange(len(layout.valid_indices), device=self.device)
        else:
            padded = features.new_zeros(chunks * longest, mel)
            padded[torch.from_numpy(layout.chunk_slots()).to(self.device)] = features.T
            padded = padded.view(chunks, longest, mel)
            valid = torch.from_numpy(layout.valid_indices).to(self.device)
        return self.run_tower(features, lengths, layout.cu_seqlens, padded_feature=padded.transpose(1, 2),
                              chunk_lengths=torch.from_numpy(layout.chunk_lengths), valid_indices=valid)

    def encode(self, clips: list[np.ndarray]) -> list[torch.Tensor]:
        return self.encode_features(self.extract(clips)) if clips else []


def feature_extractor_for(checkpoint: Path | None, num_mel_bins: int):
    """The checkpoint's WhisperFeatureExtractor (``preprocessor_config.json``), else Qwen3-Omni's settings."""
    return thinker.whisper_extractor(checkpoint, num_mel_bins)


# ---------------------------------------------------------------------------------------------- adapter
class AudioMarkers(thinker.AudioMarkers):
    """The thinker's audio token ids: ``start``/``end`` frame a clip, ``pad`` rows become encoder outputs."""

    @classmethod
    def resolve(cls, config: dict, tokenizer) -> "AudioMarkers":
        """Start and pad from the thinker config (the ids its placeholder mask uses); the end marker, which
        the config does not name, from the tokenizer (``<|audio_end|>``)."""
        from metronome.models.omni.qwen3_omni import thinker_config

        cfg = thinker_config(config)
        start, pad = int(cfg.get("audio_start_token_id", 151669)), int(cfg.get("audio_token_id", 151675))
        end = tokenizer.convert_tokens_to_ids("<|audio_end|>")
        if end is None or end == tokenizer.unk_token_id:
            raise ConfigError("the tokenizer has no <|audio_end|> token; Qwen3-Omni frames audio with it")
        return cls(start, pad, int(end))


class Qwen3OmniAdapter(ThinkerAdapter):
    """Qwen3-Omni's audio front end and prompt layout for the thinker on the engine.

    ``instruction``: text after the first clip inside the first user turn (empty by default: the
    session's ``instructions`` become the system turn). ``max_response_tokens`` caps a turn-mode answer.
    """

    name = "qwen3_omni"

    def __init__(self, tokenizer, frontend: AudioFrontEnd, markers: AudioMarkers, embed, *,
                 max_input_tokens: int = 1024, instruction: str = "", max_response_tokens: int = 256,
                 max_pending_s: float = 4.0, default_mode: str = "free_running",
                 stop_token_ids: tuple[int, ...] | None = None) -> None:
        # No system prompt of its own: a session without instructions gets the chat template's default.
        super().__init__(tokenizer, frontend, markers, embed, max_input_tokens=max_input_tokens,
                         instruction=instruction, system_prompt="", max_response_tokens=max_response_tokens,
                         max_pending_s=max_pending_s, default_mode=default_mode, stop_token_ids=stop_token_ids)


def build_adapter(context: AdapterContext) -> Qwen3OmniAdapter:
    """The adapter over the engine's checkpoint: its audio tower, feature extractor and audio token ids."""
    from metronome.models.weights import read_config

    if context.checkpoint is None:
        raise ConfigError("the qwen3_omni adapter loads its audio encoder from the checkpoint directory; "
                          "this engine was built from a model object")
    config = read_config(Path(context.checkpoint))
    frontend = AudioFrontEnd.from_checkpoint(Path(context.checkpoint), config, context.device, context.dtype,
                                             quantization=context.quantization)
    return Qwen3OmniAdapter(context.tokenizer, frontend, AudioMarkers.resolve(config, context.tokenizer),
                            context.embed, max_input_tokens=context.max_input_tokens)
