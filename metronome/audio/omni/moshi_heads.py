"""Moshi's per-frame heads, run by the adapter: the input embedding sum, the text head, the depth transformer.

Loaded from the checkpoint's tensors the temporal decoder skips (``metronome/models/omni/moshi.py``):

    embed_tokens.{0..2K-1}.weight   audio-codebook embeddings of the temporal transformer's input
                                    (Moshi's K codebooks, then the user's K; row ``audio_vocab_size`` is
                                    the "initial" token)
    decoder.lm_head.weight          the text head; skipped (``text_head=False``) when the adapter shares
                                    the engine decoder's (``AdapterContext.compute_logits``)
    depth_decoder.*                 transformers' ``MoshiDepthDecoder`` (module reused for its weights)
    audio_encoder.*                 transformers' ``MimiModel`` (``moshi_mimi.MimiCodec`` streams it)

``DepthTransformer.generate`` is the depth decoder's per-frame loop for a batch of sessions: K steps,
step k embeds the previous token (the text token at step 0, codebook k-1 after), adds the projection
of the temporal hidden state by ``input_projections[k]``, runs the layers with codebook k's weights
(transformers' ``MoshiFlexibleLinear``) over a per-frame KV of at most K positions, and picks codebook
k from ``lm_heads[k]``. It is the arithmetic of transformers' ``MoshiDepthDecoder.forward`` with a
cache, written out so that one frame for N sessions is K small batched steps with no generation
machinery in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from metronome.errors import ModelLoadError

TEXT_HEAD = "decoder.lm_head.weight"


@dataclass(frozen=True)
class Sampling:
    """Per-stream sampling: ``temperature`` 0 is greedy; ``top_k`` 0 keeps every token."""

    temperature: float = 0.0
    top_k: int = 0

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """logits [N, V] → ids [N]."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            cut = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < cut, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's rms_norm upcasts a bf16 x to float32 and rounds once at the end, as transformers' MoshiRMSNorm does
    # (a test holds it to that): one kernel, not four.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _stack_as_views(weights: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``weights`` concatenated along ``dim``; each becomes a view of the result, so the weights are not held
    twice (their module must have its final dtype and device: a later ``.to`` would leave the stack behind)."""
    stacked = torch.cat([w.data for w in weights], dim)
    start = 0
    for w in weights:
        size = w.shape[dim]
        w.data = stacked.narrow(dim, start, size)
        start += size
    return stacked


def _fuse_qkv(attn: nn.Module) -> torch.Tensor:
    """One [K, q + k + v rows, hidden] weight for a layer's three projections: one product a codebook, not three."""
    return _stack_as_views([attn.q_proj.linear.weight, attn.k_proj.linear.weight, attn.v_proj.linear.weight], 1)


class DepthTransformer:
    """Batched greedy/sampled depth decoding over a transformers ``MoshiDepthDecoder``'s weights.

    A frame is K steps of every layer for a handful of rows, so its time is the number of kernels it launches:
    q, k and v come from one product, the residual adds ride on the output products (``addmm``), the norms
    and the attention are one kernel each, and the temporal state's projection for all K codebooks is one
    product before the loop."""

    def __init__(self, depth: nn.Module, cuda_graphs: bool = True) -> None:
        from metronome.audio.omni.moshi_graphs import BucketedGraphs

        self.depth = depth.eval()
        self._greedy = BucketedGraphs(self._generate, pads=(0.0, 0), enabled=cuda_graphs)
        cfg = depth.config
        self.num_codebooks = cfg.num_codebooks
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        if cfg.hidden_act != "silu":
            raise ModelLoadError(f"depth decoder hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        if cfg.sliding_window is not None and cfg.sliding_window < self.num_codebooks:
            raise ModelLoadError("depth decoder sliding_window is shorter than one frame's codebooks")
        with torch.no_grad():
            self.qkv = [_fuse_qkv(layer.self_attn) for layer in depth.layers]

    @torch.no_grad()
    def generate(self, hidden: torch.Tensor, text: torch.Tensor, sampling: Sampling = Sampling(),
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """hidden [N, H] (temporal transformer's last hidden), text [N] → audio codes [N, K].

        Greedy decoding replays a CUDA graph on the GPU (one per batch-size bucket)."""
        if sampling.temperature <= 0:
            return self._greedy(hidden, text)[0].clone()
        return self._generate(hidden, text, sampling, generator)[0]

    def _generate(self, hidden: torch.Tensor, text: torch.Tensor, sampling: Sampling = Sampling(),
                  generator: torch.Generator | None = None) -> list[torch.Tensor]:
        d = self.depth
        n, k_total = hidden.shape[0], self.num_codebooks
        projections = d.input_projections.weight                     # [K, depth hidden, temporal hidden]
        hidden = hidden.to(projections.dtype)
        projected = (hidden @ projections.flatten(0, 1).t()).view(n, k_total, -1)
        # each layer's keys and values of the frame's codebooks so far: [N, 2, kv heads, K, head_dim]
        caches = [hidden.new_empty(n, 2, self.num_kv_heads, k_total, self.head_dim) for _ in d.layers]
        token = text
        out = []
        for k in range(k_total):
            table = d.text_embed_tokens if k == 0 else d.embed_tokens[k - 1]
            x = table(token) + projected[:, k]
            for layer, qkv, cache in zip(d.layers, self.qkv, caches):
                x = self._attention(layer, qkv[k], x, k, cache)
                h = _rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
                gate, up = (h @ layer.mlp.fc1.weight[k].t()).chunk(2, dim=-1)
                x = torch.addmm(x, F.silu(gate) * up, layer.mlp.fc2.weight[k].t())
            token = sampling.pick(x @ d.lm_heads.weight[k].t(), generator)
            out.append(token)
        return [torch.stack(out, dim=1)]

    def _attention(self, layer: nn.Module, qkv: torch.Tensor, x: torch.Tensor, k: int,
                   cache: torch.Tensor) -> torch.Tensor:
        """x plus the layer's attention of codebook k over codebooks 0..k (``qkv``: codebook k's fused weight)."""
        n, q_size = x.shape[0], self.num_heads * self.head_dim
        q, kv = (_rms_norm(x, layer.input_layernorm.weight, self.eps) @ qkv.t()).split(
            [q_size, 2 * self.num_kv_heads * self.head_dim], -1)
        cache[:, :, :, k] = kv.view(n, 2, self.num_kv_heads, self.head_dim)
        o = F.scaled_dot_product_attention(q.view(n, self.num_heads, 1, self.head_dim), cache[:, 0, :, :k + 1],
                                           cache[:, 1, :, :k + 1], enable_gqa=self.num_kv_heads != self.num_heads)
        return torch.addmm(x, o.reshape(n, q_size), layer.self_attn.o_proj.linear.weight[k].t())


class AudioEmbeddings:
    """The summed audio-codebook embeddings of a column as one gather: the 2K tables are stacked into one
    (``_stack_as_views``), so a column costs a gather and a sum, not 2K lookups and adds."""

    def __init__(self, tables: nn.ModuleList) -> None:
        with torch.no_grad():
            self.table = _stack_as_views([t.weight for t in tables], 0)
        self.offsets = torch.arange(len(tables), device=self.table.device) * tables[0].weight.shape[0]

    @torch.no_grad()
    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [N, 2K] (Moshi's K, then the user's K; delayed already) → summed embeddings [N, hidden]."""
        return F.embedding(codes + self.offsets, self.table).sum(1)


class MoshiHeads(nn.Module):
    """The checkpoint's non-decoder parts (see the module docstring), names as transformers stores them."""

    def __init__(self, config, text_head: bool = True) -> None:
        from transformers import AutoModel
        from transformers.models.moshi.modeling_moshi import MoshiDepthDecoder

        super().__init__()
        self.num_codebooks = config.num_codebooks
        self.vocab_size, self.audio_vocab_size = config.vocab_size, config.audio_vocab_size
        self.embed_tokens = nn.ModuleList(nn.Embedding(config.audio_vocab_size + 1, config.hidden_size)
                                          for _ in range(2 * config.num_codebooks))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if text_head else None
        self.depth_decoder = MoshiDepthDecoder._from_config(config.depth_decoder_config)
        self.audio_encoder = AutoModel.from_config(config.audio_encoder_config)


# Mimi checkpoints (and transformers' save_pretrained) keep the original flat layout; transformers > 5.17 nests
# MimiModel's halves (its conversion_mapping renames on load; so do these when the module is nested).
_MIMI_FLAT = (("audio_encoder.encoder.layers.", "audio_encoder.encoder.encoder_seanet.layers."),
              ("audio_encoder.encoder_transformer.", "audio_encoder.encoder.encoder_transformer."),
              ("audio_encoder.downsample.", "audio_encoder.encoder.downsample."),
              ("audio_encoder.upsample.", "audio_encoder.decoder.upsample."),
              ("audio_encoder.decoder_transformer.", "audio_encoder.decoder.decoder_transformer."),
              ("audio_encoder.decoder.layers.", "audio_encoder.decoder.decoder_seanet.layers."))


def _stored_name(stored: str, names: set[str]) -> str | None:
    """Checkpoint name → MoshiHeads name (``names``: the module's); None for the temporal decoder's tensors."""
    if stored == TEXT_HEAD:
        return "lm_head.weight" if "lm_head.weight" in names else None
    for flat, nested in _MIMI_FLAT:
        if stored.startswith(flat) and nested + stored[len(flat):] in names:
            return nested + stored[len(flat):]
    if stored.startswith(("embed_tokens.", "depth_decoder.", "audio_encoder.")):
        return stored
    return None


def load_heads(checkpoint: Path, config, dtype: torch.dtype, device: torch.device | str,
               text_head: bool = True) -> MoshiHeads:
    """MoshiHeads filled from ``checkpoint``; Mimi stays float32, the rest takes ``dtype``.
    ``text_head=False`` leaves the text head out (the engine's decoder holds it)."""
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{checkpoint} holds no *.safetensors weights")
    with torch.device(device):
        heads = MoshiHeads(config, text_head)
    expected = heads.state_dict()
    state = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                name = _stored_name(stored, set(expected))
                if name is not None:
                    state[name] = f.get_tensor(stored)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(f"{checkpoint}: Moshi heads: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelLoadError(f"{checkpoint}: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(expected[name].shape)}")
    heads.load_state_dict(state, strict=True)
    heads.requires_grad_(False).eval()
    for module in (heads.embed_tokens, heads.lm_head, heads.depth_decoder):
        if module is not None:
            module.to(dtype)
    return heads
