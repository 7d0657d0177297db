"""FP8 audio towers (``tower_fp8``): which linear layers turn FP8, and each omni tower's output against its float
self on the same audio, at tiny random shapes."""

from __future__ import annotations

import copy
import doctest
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
from torch import nn

from metronome.audio.omni import qwen2_5_omni, qwen3_omni, tower_fp8
from metronome.audio.omni.minicpm_o_audio import AudioSpec, AudioTower, LogMel
from metronome.audio.omni.tower_fp8 import quantize_tower_
from metronome.errors import ConfigError
from metronome.models.fp8 import Fp8Linear

# Per-channel E4M3 weights move these towers' outputs by 2-5.4 % (relative Frobenius norm, three seeds each). A
# square weight transposed after quantising moves them by more than 60 %, each channel's scale applied to its
# neighbour by more than 25 % (both checked below), a scale 1.25x too large by more than 10 %.
TOWER_BOUND = 0.08


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def speech_like(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    envelope = np.repeat(10 ** rng.uniform(-3.0, 0, size=n // 400 + 1), 400)[:n]
    return (rng.standard_normal(n) * envelope * 0.3).clip(-1, 1).astype(np.float32)


def unit_gain_(tower: nn.Module, seed: int) -> nn.Module:
    """Weights of variance 1 / fan-in, so every block changes the rows as much as it passes on (with transformers'
    0.02 the residual stream would hide the blocks, and a broken one would pass); random biases and norms."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if "embed_positions" in name:
                continue                                    # Whisper's sinusoids
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
            else:
                base = 1.0 if ("norm" in name or "ln_" in name) and name.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    return tower


@dataclass(frozen=True)
class Tower:
    """A tiny tower of one model: built with float weights, ``quantize(tower)`` as the model's loader does it,
    ``run(tower)`` its output rows for a few clips; ``kept``: the linear layers that stay float."""

    build: Callable[[int], nn.Module]
    quantize: Callable[[nn.Module], nn.Module]
    run: Callable[[nn.Module], torch.Tensor]
    kept: set[str]


CLIPS = [speech_like(2.0, 1), speech_like(1.0, 2), speech_like(3.0, 3)]


def _qwen2_5_omni() -> Tower:
    from transformers import Qwen2_5OmniAudioEncoderConfig

    config = Qwen2_5OmniAudioEncoderConfig(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2,
                                           encoder_ffn_dim=64, d_model=32, output_dim=64, n_window=100)
    extractor = qwen2_5_omni.feature_extractor_for(None, 128)

    def frontend(encoder, quantization=None):
        return qwen2_5_omni.AudioFrontEnd(encoder, extractor, "cpu", torch.float32, quantization)

    return Tower(build=lambda seed: unit_gain_(qwen2_5_omni.build_audio_encoder(config, "cpu", torch.float32), seed),
                 quantize=lambda encoder: frontend(encoder, "fp8").encoder,
                 run=lambda encoder: torch.cat(frontend(encoder).encode(CLIPS)), kept={"proj"})


def _qwen3_omni() -> Tower:
    from transformers import Qwen3OmniMoeAudioEncoderConfig

    config = Qwen3OmniMoeAudioEncoderConfig(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2,
                                            encoder_ffn_dim=32, d_model=16, output_dim=64, downsample_hidden_size=8,
                                            n_window=50, n_window_infer=800, max_source_positions=200)
    extractor = qwen3_omni.feature_extractor_for(None, 128)

    def frontend(encoder, quantization=None):
        return qwen3_omni.AudioFrontEnd(encoder, extractor, "cpu", torch.float32, quantization)

    return Tower(build=lambda seed: unit_gain_(qwen3_omni.build_audio_encoder(config, "cpu", torch.float32), seed),
                 quantize=lambda encoder: frontend(encoder, "fp8").encoder,
                 run=lambda encoder: torch.cat(frontend(encoder).encode(CLIPS)), kept={"conv_out", "proj1", "proj2"})


def _minicpm_o() -> Tower:
    spec = AudioSpec(whisper=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                                  num_mel_bins=80, max_source_positions=1500), pool_step=5, chunk_s=1.0, hidden_size=64)
    mel = LogMel(80)([speech_like(1.0, seed) for seed in range(3)])

    def run(tower):
        with torch.inference_mode():
            return tower(mel).flatten(0, 1)

    return Tower(build=lambda seed: unit_gain_(AudioTower(spec), seed).eval().requires_grad_(False),
                 quantize=lambda tower: quantize_tower_(tower, "fp8"), run=run,
                 kept={"audio_projection_layer.linear1", "audio_projection_layer.linear2"})


TOWERS = {"qwen2_5_omni": _qwen2_5_omni, "qwen3_omni": _qwen3_omni, "minicpm_o": _minicpm_o}


def test_doctests():
    assert doctest.testmod(tower_fp8).failed == 0


@pytest.mark.parametrize("model", sorted(TOWERS))
def test_the_blocks_linear_layers_turn_fp8_and_the_rest_stays_float(model, caplog):
    case = TOWERS[model]()
    tower = case.build(0)
    linears = {path for path, m in tower.named_modules() if isinstance(m, nn.Linear)}
    with caplog.at_level(logging.INFO, logger=tower_fp8.__name__):
        quantized = case.quantize(tower)
    fp8 = {path for path, m in quantized.named_modules() if isinstance(m, Fp8Linear)}
    float_ = {path for path, m in quantized.named_modules() if isinstance(m, nn.Linear)}
    assert float_ == case.kept and fp8 == linears - case.kept
    assert all(".layers." in f".{path}" for path in fp8) and len(fp8) == 2 * 6   # q, k, v, out, fc1, fc2 a layer
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.shape == (m.out_features, 1)
               for m in quantized.modules() if isinstance(m, Fp8Linear))
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and ": 12 linear layers" in logged[0] and f"{len(case.kept)} kept" in logged[0], logged


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("model", sorted(TOWERS))
def test_the_fp8_towers_output_is_close_to_the_float_towers(model, seed):
    case = TOWERS[model]()
    tower = case.build(seed)
    want = case.run(tower)
    quantized = case.quantize(copy.deepcopy(tower))
    error = relative_error(case.run(quantized), want)
    assert 0 < error < TOWER_BOUND, error

    # The bound catches what a wrong layout would do: square weights transposed, scales one channel off.
    transposed, rolled = copy.deepcopy(quantized), copy.deepcopy(quantized)
    for t, r in zip(transposed.modules(), rolled.modules()):
        if isinstance(t, Fp8Linear):
            if t.in_features == t.out_features:
                t.weight.copy_(t.weight.T.contiguous())
            r.weight_scale.copy_(r.weight_scale.roll(1, 0))
    assert relative_error(case.run(transposed), want) > TOWER_BOUND
    assert relative_error(case.run(rolled), want) > TOWER_BOUND


def test_no_quantization_leaves_the_tower_and_an_unknown_one_is_refused():
    tower = _minicpm_o().build(0)
    before = {path: type(m) for path, m in tower.named_modules()}
    assert quantize_tower_(tower, None) is tower
    assert {path: type(m) for path, m in tower.named_modules()} == before
    with pytest.raises(ConfigError, match="int8"):
        quantize_tower_(tower, "int8")
