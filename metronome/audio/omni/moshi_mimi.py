"""Mimi as a streaming codec: 80 ms of 24 kHz audio ↔ one frame of 8 codes, with bounded carried state.

transformers' ``MimiModel`` (reused as is; its weights are the checkpoint's ``audio_encoder.*``) encodes
in streaming mode itself: ``encode(..., use_streaming=True)`` carries a padding cache (the last
``kernel - stride`` inputs of every causal convolution) and the encoder transformer's KV cache, whose
layers are sliding-window layers (``sliding_window`` frames), so the state is bounded.

Its ``decode`` has no streaming mode, so the decoder is streamed here with the same modules and weights:

* causal ``MimiConv1d`` (all stride 1 in the decoder): the last ``(kernel - 1) · dilation`` inputs are
  carried and prepended, which is exactly the left padding of the full-sequence path;
* causal ``MimiConvTranspose1d`` (the upsampler and the SEANet upsampling layers): overlap-add. Each
  chunk's transposed convolution is computed without bias; its first ``kernel - stride`` outputs get the
  previous chunk's tail added, the next ``n · stride`` are emitted (+ bias) and the last ``kernel -
  stride`` become the tail. The full-sequence path trims exactly those right-most outputs, so the sums
  are the same terms (only the order of two float additions differs);
* the decoder transformer carries its sliding-window KV cache like the encoder's.

Streaming therefore equals the full-sequence ``encode``/``decode`` up to float rounding for clips shorter
than the transformers' sliding window (the tests check codes exactly and audio to 1e-5 relative). Beyond
the window the full-sequence path and the streaming path both attend to the last ``sliding_window``
frames; state per stream is O(sliding_window + Σ kernel sizes), whatever the stream's age.

A state holds a batch of streams of the same age (batch 1 per session in the adapter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MimiStreamState:
    """One batch of streams' carried state (all bounded; see the module docstring)."""

    encoder_cache: Any = None   # transformers DynamicCache (sliding-window layers)
    padding_cache: Any = None   # transformers MimiConv1dPaddingCache
    decoder_cache: Any = None   # transformers DynamicCache of the decoder transformer
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # decoder op index -> carried inputs / tail
    frames_in: int = 0
    frames_out: int = 0


class MimiCodec:
    """Streaming encode/decode over a transformers ``MimiModel`` (float32; it is small)."""

    def __init__(self, model: nn.Module, num_codebooks: int) -> None:
        from transformers.models.mimi.modeling_mimi import MimiConv1d, MimiConvTranspose1d, MimiResnetBlock

        self._conv_types = (MimiConv1d, MimiConvTranspose1d, MimiResnetBlock)
        self.model = model.eval()
        config = model.config
        self.num_codebooks = num_codebooks
        self.sample_rate = int(config.sampling_rate)
        self.frame_size = int(round(config.sampling_rate / config.frame_rate))  # 1920 samples = 80 ms
        self.device = next(model.parameters()).device
        decoder = model.decoder
        # Every streaming op of the decoder gets an index (its carried state's key).
        self._index: dict[int, int] = {}
        for module in [decoder.upsample, *decoder.decoder_seanet.modules()]:
            if isinstance(module, (MimiConv1d, MimiConvTranspose1d)) and id(module) not in self._index:
                self._check(module)
                self._index[id(module)] = len(self._index)

    def _check(self, module: nn.Module) -> None:
        conv = module.conv
        if not module.causal:
            raise ValueError("streaming Mimi needs causal convolutions (use_causal_conv=True)")
        if isinstance(conv, nn.ConvTranspose1d):
            if module.padding_left != 0 or conv.padding[0] or conv.output_padding[0] or conv.dilation[0] != 1:
                raise ValueError("streaming Mimi needs transposed convolutions trimmed on the right only")
        elif conv.stride[0] != 1:
            raise ValueError("streaming Mimi's decoder convolutions must have stride 1")

    def open(self) -> MimiStreamState:
        return MimiStreamState()

    # ------------------------------------------------------------------------------------- encode
    @torch.no_grad()
    def encode(self, state: MimiStreamState, pcm: torch.Tensor) -> torch.Tensor:
        """pcm [B, n · frame_size] (float, 24 kHz) → codes [B, num_codebooks, n]; advances ``state``."""
        if pcm.shape[-1] % self.frame_size:
            raise ValueError(f"encode takes whole frames of {self.frame_size} samples, got {pcm.shape[-1]}")
        out = self.model.encode(pcm.to(self.device, torch.float32)[:, None, :], num_quantizers=self.num_codebooks,
                                encoder_cache=state.encoder_cache, padding_cache=state.padding_cache,
                                use_streaming=True)
        state.encoder_cache, state.padding_cache = out.encoder_cache, out.padding_cache
        state.frames_in += out.audio_codes.shape[-1]
        return out.audio_codes

    # ------------------------------------------------------------------------------------- decode
    @torch.no_grad()
    def decode(self, state: MimiStreamState, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, K, n] → pcm [B, n · frame_size] (float32); advances ``state``."""
        decoder = self.model.decoder
        latents = self.model.quantizer.decode(codes.to(self.device))
        x = self._convtr(decoder.upsample, latents, state) if decoder.upsample is not None else latents
        out = decoder.decoder_transformer(x.transpose(1, 2), cache=state.decoder_cache, use_cache=True)
        state.decoder_cache = out.cache
        x = out.last_hidden_state.transpose(1, 2)
        for layer in decoder.decoder_seanet.layers:
            x = self._layer(layer, x, state)
        state.frames_out += codes.shape[-1]
        return x[:, 0]

    def _layer(self, layer: nn.Module, x: torch.Tensor, state: MimiStreamState) -> torch.Tensor:
        conv1d, convtr, resnet = self._conv_types
        if isinstance(layer, conv1d):
            return self._conv(layer, x, state)
        if isinstance(layer, convtr):
            return self._convtr(layer, x, state)
        if isinstance(layer, resnet):
            h = x
            for sub in layer.block:
                h = self._layer(sub, h, state)
            return self._layer(layer.shortcut, x, state) + h
        return layer(x)  # ELU, Identity: stateless

    def _conv(self, layer: nn.Module, x: torch.Tensor, state: MimiStreamState) -> torch.Tensor:
        key = self._index[id(layer)]
        pad = int(layer.padding_total)
        if pad == 0:
            return layer.conv(x)
        past = state.conv.get(key)
        if past is None:
            past = x[..., :1].expand(-1, -1, pad) if layer.pad_mode == "replicate" else x.new_zeros(*x.shape[:2], pad)
        full = torch.cat([past, x], dim=-1)
        state.conv[key] = full[..., -pad:].clone()
        return layer.conv(full)

    def _convtr(self, layer: nn.Module, x: torch.Tensor, state: MimiStreamState) -> torch.Tensor:
        key = self._index[id(layer)]
        conv = layer.conv
        stride = conv.stride[0]
        overlap = conv.kernel_size[0] - stride
        y = F.conv_transpose1d(x, conv.weight, None, stride=stride, groups=conv.groups)
        tail = state.conv.get(key)
        if tail is not None:
            y[..., :overlap] += tail
        n = x.shape[-1] * stride
        state.conv[key] = y[..., n:].clone()
        y = y[..., :n]
        return y if conv.bias is None else y + conv.bias[None, :, None]
