"""Mimi as a batched streaming codec: 80 ms of 24 kHz audio ↔ one frame of 8 codes per stream, bounded state.

The modules and weights are transformers' ``MimiModel`` (the checkpoint's ``audio_encoder.*``); only the
streaming is done here, so that the streams of many sessions, of any ages, run as ONE batch per tick.
transformers' own streaming encode (``use_streaming=True``) carries a ``DynamicCache`` per call whose
length and positions follow each stream's age, so streams of different ages could not share a batch;
its ``decode`` has no streaming mode at all. Here every stream's state has a fixed shape:

* causal ``MimiConv1d`` (encoder: strided too; decoder: stride 1): the last ``kernel - stride`` inputs
  (dilated kernel) are carried and prepended, which is exactly the left padding of the full-sequence
  path when chunks are whole frames (transformers' ``MimiConv1dPaddingCache`` does the same);
  ``replicate``-padded convolutions (the encoder's downsampler) start from the stream's first sample;
* causal ``MimiConvTranspose1d`` (the upsampler and the SEANet upsampling layers): overlap-add. A chunk's
  transposed convolution is computed without bias; its first ``kernel - stride`` outputs get the
  previous chunk's tail added, the next ``n · stride`` are emitted (+ bias), the last ``kernel - stride``
  become the tail. The full-sequence path trims exactly those right-most outputs;
* the encoder and decoder transformers: a ring of ``sliding_window - 1 + steps`` keys/values per layer
  (``steps`` new positions a frame; masked out while the stream is young) and the stream's step count; position
  p lives in slot ``p % ring``, so a frame writes only its own positions back to the pool; new queries attend
  to keys at positions ``(p - sliding_window, p]``, transformers' sliding-window mask, with RoPE at the
  absolute positions the full-sequence path uses.

So streaming equals transformers' full-sequence ``encode``/``decode`` up to float rounding (the order
of a few additions), at any length, and a stream's state never grows (the tests check both). A
``MimiStreamState`` is one stream (a row of the codec's state pool); ``encode``/``decode`` take a list of
them and run them as one batch, one frame each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metronome.device_copy import to_device


@dataclass(frozen=True)
class MimiParts:
    """The six stages of a transformers ``MimiModel``, whichever layout its version has.

    transformers ≤ 5.17 keeps them flat on the model (``encoder`` is the SEANet encoder,
    ``encoder_transformer``, ``downsample``, ...); later versions nest them in ``MimiEncoderModel`` /
    ``MimiDecoderModel`` halves (``encoder.encoder_seanet``, ``decoder.decoder_transformer``, ...)."""

    encoder_seanet: nn.Module
    encoder_transformer: nn.Module
    downsample: nn.Module | None
    upsample: nn.Module | None
    decoder_transformer: nn.Module
    decoder_seanet: nn.Module

    @classmethod
    def of(cls, model: nn.Module) -> "MimiParts":
        enc, dec = model.encoder, model.decoder
        if hasattr(enc, "encoder_seanet"):
            return cls(enc.encoder_seanet, enc.encoder_transformer, enc.downsample, dec.upsample,
                       dec.decoder_transformer, dec.decoder_seanet)
        return cls(enc, model.encoder_transformer, model.downsample, model.upsample, model.decoder_transformer, dec)


@dataclass
class MimiStreamState:
    """One stream: its row (slot) in the codec's state pool, and whether it has started."""

    slot: int
    started: bool = False
    closed: bool = False


class MimiCodec:
    """Streaming encode/decode over a transformers ``MimiModel`` (float32: it is small).

    Every stream's state lives in one row of a pool of fixed-shape tensors (grown by doubling; row 0 is
    scratch, where a CUDA graph's padding rows read and write). A batch gathers its streams' rows, runs,
    and scatters the new state back: on CUDA all of it is one graph replay per batch-size bucket
    (``moshi_graphs.BucketedGraphs``), so the cost per tick does not grow with the number of kernels.
    """

    def __init__(self, model: nn.Module, num_codebooks: int, cuda_graphs: bool = True) -> None:
        from transformers.models.mimi.modeling_mimi import MimiConv1d, MimiConvTranspose1d, MimiResnetBlock

        from metronome.audio.omni.moshi_graphs import BucketedGraphs

        self._types = (MimiConv1d, MimiConvTranspose1d, MimiResnetBlock)
        self.model = model.eval()
        config = model.config
        self.num_codebooks = num_codebooks
        self.sample_rate = int(config.sampling_rate)
        self.frame_size = int(round(config.sampling_rate / config.frame_rate))  # 1920 samples = 80 ms
        # the transformers' steps a frame: they run between SEANet (hop: the product of its ratios) and the resampling
        self.steps = self.frame_size // math.prod(config.upsampling_ratios)
        self.device = next(model.parameters()).device
        self.parts = MimiParts.of(model)
        p = self.parts
        self._encoder_convs = [m for m in [*p.encoder_seanet.modules(), p.downsample]
                               if isinstance(m, (MimiConv1d, MimiConvTranspose1d))]
        self._decoder_convs = [m for m in [p.upsample, *p.decoder_seanet.modules()]
                               if isinstance(m, (MimiConv1d, MimiConvTranspose1d))]
        self._name: dict[int, str] = {}
        self._pad: dict[int, int] = {}   # Python ints: reading the buffer inside a CUDA graph would sync
        for prefix, convs in (("enc.conv", self._encoder_convs), ("dec.conv", self._decoder_convs)):
            for i, module in enumerate(convs):
                self._check(module)
                self._name[id(module)] = f"{prefix}{i}"
                self._pad[id(module)] = int(module.padding_total) if hasattr(module, "padding_total") else 0
        for tf in (p.encoder_transformer, p.decoder_transformer):
            if tf.config.sliding_window is None:
                raise ValueError("streaming Mimi needs transformers with a sliding window (bounded state)")
        # The transformers' key/value rings are written back a position at a time, not scattered whole.
        self._shapes, self._rings = self._state_shapes()
        self.pool: dict[str, torch.Tensor] = {}
        self._free: list[int] = []
        self._grow(4)
        self._encode = BucketedGraphs(self._encode_rows, pads=(0.0, False, 0), enabled=cuda_graphs)
        self._decode = BucketedGraphs(self._decode_rows, pads=(0, 0), enabled=cuda_graphs)

    def _check(self, module: nn.Module) -> None:
        conv = module.conv
        if not module.causal:
            raise ValueError("streaming Mimi needs causal convolutions (use_causal_conv=True)")
        if isinstance(conv, nn.ConvTranspose1d):
            if module.padding_left != 0 or conv.padding[0] or conv.output_padding[0] or conv.dilation[0] != 1:
                raise ValueError("streaming Mimi needs transposed convolutions trimmed on the right only")
        elif module.pad_mode not in ("constant", "replicate"):
            raise ValueError(f"streaming Mimi: pad_mode {module.pad_mode!r} is not supported")

    # ------------------------------------------------------------------------------------- state
    def _state_shapes(self) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], set[str]]:
        """Each state tensor's per-stream shape and dtype, by name; and the names of the transformers' rings."""
        shapes, rings = {}, set()
        for module in self._encoder_convs + self._decoder_convs:
            conv = module.conv
            if isinstance(conv, nn.ConvTranspose1d):
                shapes[self._name[id(module)]] = ((conv.out_channels, conv.kernel_size[0] - conv.stride[0]), torch.float32)
            elif self._pad[id(module)] > 0:
                shapes[self._name[id(module)]] = ((conv.in_channels, self._pad[id(module)]), torch.float32)
        for prefix, tf in (("enc.tf", self.parts.encoder_transformer), ("dec.tf", self.parts.decoder_transformer)):
            cfg = tf.config
            for i in range(len(tf.layers)):
                for kv in "kv":
                    shapes[f"{prefix}{i}{kv}"] = ((cfg.num_key_value_heads, self._ring_size(tf), cfg.head_dim),
                                                  torch.float32)
                    rings.add(f"{prefix}{i}{kv}")
            shapes[f"{prefix}.count"] = ((), torch.long)
        return shapes, rings

    def _ring_size(self, tf: nn.Module) -> int:
        """Key slots a layer keeps: every key a frame's new steps attend to, the new ones included."""
        return tf.config.sliding_window - 1 + self.steps

    def _grow(self, rows: int) -> None:
        old = len(next(iter(self.pool.values()))) if self.pool else 0
        for key, (shape, dtype) in self._shapes.items():
            extra = torch.zeros(rows - old, *shape, dtype=dtype, device=self.device)
            self.pool[key] = torch.cat([self.pool[key], extra]) if old else extra
        self._free.extend(range(max(old, 1), rows))   # row 0 is scratch
        if hasattr(self, "_encode"):
            self._encode.reset()   # the graphs read and write the old pool
            self._decode.reset()

    @property
    def state_bytes(self) -> int:
        """Bytes of carried state per stream (fixed)."""
        return sum(t[0].numel() * t.element_size() for t in self.pool.values())

    def open(self) -> MimiStreamState:
        """A new stream: zero tails and an empty transformer window in a free row of the pool."""
        if not self._free:
            self._grow(2 * len(self.pool["enc.tf.count"]))
        slot = self._free.pop()
        for t in self.pool.values():
            t[slot].zero_()
        return MimiStreamState(slot)

    def close(self, state: MimiStreamState) -> None:
        """Give the stream's row back (idempotent)."""
        if not state.closed:
            state.closed = True
            self._free.append(state.slot)

    def _rows(self, states: list[MimiStreamState]) -> torch.Tensor:
        if any(s.closed for s in states):
            raise ValueError("a closed Mimi stream cannot be used")
        return to_device([s.slot for s in states], self.device, torch.long)

    def _gather(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v.index_select(0, rows) for k, v in self.pool.items()}

    def _scatter(self, rows: torch.Tensor, st: dict[str, torch.Tensor]) -> None:
        for k, v in self.pool.items():
            if k not in self._rings:   # the rings' new positions went to the pool as they were written
                v.index_copy_(0, rows, st[k])

    # ------------------------------------------------------------------------------------- encode
    @torch.no_grad()
    def encode(self, states: list[MimiStreamState], pcm: torch.Tensor) -> torch.Tensor:
        """pcm [N, frame_size] (24 kHz) for N streams → codes [N, num_codebooks, 1]; advances the states."""
        if pcm.shape != (len(states), self.frame_size):
            raise ValueError(f"encode takes one frame of {self.frame_size} samples per stream, got {tuple(pcm.shape)}")
        fresh = to_device([not s.started for s in states], self.device, torch.bool)
        codes = self._encode(to_device(pcm, self.device, torch.float32), fresh, self._rows(states))[0].clone()
        for s in states:
            s.started = True
        return codes

    def _encode_rows(self, pcm: torch.Tensor, fresh: torch.Tensor, rows: torch.Tensor) -> list[torch.Tensor]:
        p = self.parts
        st = self._gather(rows)
        x = pcm[:, None, :]
        for layer in p.encoder_seanet.layers:
            x = self._layer(layer, x, st, fresh)
        x = self._transformer(p.encoder_transformer, x.transpose(1, 2), st, "enc.tf", rows).transpose(1, 2)
        latents = self._conv(p.downsample, x, st, fresh) if p.downsample is not None else x
        codes = self.model.quantizer.encode(latents, self.num_codebooks).transpose(0, 1)
        self._scatter(rows, st)
        return [codes]

    # ------------------------------------------------------------------------------------- decode
    @torch.no_grad()
    def decode(self, states: list[MimiStreamState], codes: torch.Tensor) -> torch.Tensor:
        """codes [N, K, 1] for N streams → pcm [N, frame_size] (float32); advances the states."""
        if codes.shape != (len(states), self.num_codebooks, 1):
            raise ValueError(f"decode takes one frame of {self.num_codebooks} codes per stream, got {tuple(codes.shape)}")
        return self._decode(codes.to(self.device), self._rows(states))[0].clone()

    def _decode_rows(self, codes: torch.Tensor, rows: torch.Tensor) -> list[torch.Tensor]:
        p = self.parts
        st = self._gather(rows)
        x = self.model.quantizer.decode(codes)
        if p.upsample is not None:
            x = self._convtr(p.upsample, x, st)
        x = self._transformer(p.decoder_transformer, x.transpose(1, 2), st, "dec.tf", rows).transpose(1, 2)
        for layer in p.decoder_seanet.layers:
            x = self._layer(layer, x, st, None)
        self._scatter(rows, st)
        return [x[:, 0]]

    # ------------------------------------------------------------------------------------- pieces
    def _layer(self, layer: nn.Module, x: torch.Tensor, st: dict, fresh) -> torch.Tensor:
        conv1d, convtr, resnet = self._types
        if isinstance(layer, conv1d):
            return self._conv(layer, x, st, fresh)
        if isinstance(layer, convtr):
            return self._convtr(layer, x, st)
        if isinstance(layer, resnet):
            h = x
            for sub in layer.block:
                h = self._layer(sub, h, st, fresh)
            return self._layer(layer.shortcut, x, st, fresh) + h
        return layer(x)  # ELU, Identity: stateless

    def _conv(self, layer: nn.Module, x: torch.Tensor, st: dict, fresh) -> torch.Tensor:
        pad = self._pad[id(layer)]
        if pad == 0:
            return layer.conv(x)
        key = self._name[id(layer)]
        past = st[key]
        if layer.pad_mode == "replicate" and fresh is not None:   # a new stream starts from its first sample
            past = torch.where(fresh[:, None, None], x[..., :1].expand_as(past), past)
        full = torch.cat([past, x], dim=-1)
        st[key] = full[..., -pad:]
        return layer.conv(full)

    def _convtr(self, layer: nn.Module, x: torch.Tensor, st: dict) -> torch.Tensor:
        key = self._name[id(layer)]
        conv = layer.conv
        stride = conv.stride[0]
        overlap = conv.kernel_size[0] - stride
        y = F.conv_transpose1d(x, conv.weight, None, stride=stride, groups=conv.groups)
        y[..., :overlap] += st[key]
        n = x.shape[-1] * stride
        st[key] = y[..., n:]
        y = y[..., :n]
        return y if conv.bias is None else y + conv.bias[None, :, None]

    def _transformer(self, tf: nn.Module, x: torch.Tensor, st: dict, prefix: str, rows: torch.Tensor) -> torch.Tensor:
        """transformers' MimiTransformerModel on new steps x [N, T, C], attending to each stream's window; the new
        keys and values go into their ring slots, in the gathered state and in the pool's ``rows``."""
        from transformers.models.mimi.modeling_mimi import apply_rotary_pos_emb

        n, t, _ = x.shape
        if t != self.steps:
            raise ValueError(f"Mimi's transformers take {self.steps} steps a frame, got {t}")
        window, size = tf.config.sliding_window, self._ring_size(tf)
        count = st[f"{prefix}.count"]                                              # [N]
        q_pos = count[:, None] + torch.arange(t, device=x.device)                  # [N, T]
        last = q_pos[:, -1:]
        k_pos = last - (last - torch.arange(size, device=x.device)) % size        # [N, size]: each slot's position
        rel = q_pos[:, :, None] - k_pos[:, None, :]                                 # [N, T, size]
        mask = (k_pos[:, None, :] >= 0) & (rel >= 0) & (rel < window)
        # The mask as an additive bias for every head, made once for the layers: [N * H, T, size].
        heads = tf.layers[0].self_attn.num_heads
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
        bias = bias[:, None].expand(n, heads, t, size).reshape(n * heads, t, size)
        slots = q_pos % size                                                       # [N, T]: the new steps' slots
        cos, sin = tf.rotary_emb(x, q_pos)
        for i, layer in enumerate(tf.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(n, t, -1, attn.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(n, t, -1, attn.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(n, t, -1, attn.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys, values = st[f"{prefix}{i}k"], st[f"{prefix}{i}v"]                # [N, H, size, D], gathered
            index = slots[:, None, :, None].expand_as(k)
            keys.scatter_(2, index, k)
            values.scatter_(2, index, v)
            self.pool[f"{prefix}{i}k"][rows[:, None], :, slots] = k.transpose(1, 2)
            self.pool[f"{prefix}{i}v"][rows[:, None], :, slots] = v.transpose(1, 2)
            if attn.num_key_value_groups > 1:
                keys = keys.repeat_interleave(attn.num_key_value_groups, 1)
                values = values.repeat_interleave(attn.num_key_value_groups, 1)
            # Two query steps against the ring: batched products, not a fused kernel that pads the queries to 64.
            scores = torch.baddbmm(bias, q.reshape(n * heads, t, -1), keys.flatten(0, 1).transpose(1, 2),
                                   alpha=attn.scaling)
            o = torch.bmm(scores.softmax(-1), values.flatten(0, 1)).view(n, heads, t, -1)
            x = x + layer.self_attn_layer_scale(attn.o_proj(o.transpose(1, 2).reshape(n, t, -1)))
            x = x + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(x)))
        st[f"{prefix}.count"] = count + t
        return x
