"""The FP8 (E4M3) format: saturating casts, and the per-head scales of an FP8 KV cache.

An FP8 cache stores ``to_e4m3(x, scale)`` for every key and value element, with one float32 scale per
(layer, K or V, KV head): the real value is ``stored * scale``. Both attention backends fold the scales
into the scores (keys) and the output (values), so dequantising a tile is a dtype conversion.

E4M3 keeps 3 mantissa bits: in its normal range ``[2**-6, 448] * scale`` a value is off by at most
``E4M3_RELATIVE_ERROR`` of itself, below it by at most ``E4M3_ABSOLUTE_ERROR * scale``.

The scales are set once, from the keys and values of the engine's first forward
(``CalibratingAttention``): ``amax * KV_SCALE_HEADROOM / E4M3_MAX`` per head, so later tokens up to
``KV_SCALE_HEADROOM`` times that amax keep full precision; anything larger saturates at
``±448 * scale`` (never inf or NaN).

>>> x = torch.tensor([1.0, 3.3, -500.0])
>>> to_e4m3(x, torch.tensor(1.0)).float().tolist()
[1.0, 3.25, -448.0]
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_RELATIVE_ERROR = 2.0 ** -4   # half a unit in the last place of a 3-bit mantissa
E4M3_ABSOLUTE_ERROR = 2.0 ** -10  # half the subnormal step 2**-9
# Calibrated scales leave this factor of room above the first forward's largest key or value: the range
# costs nothing (E4M3 spans ~15 binades at full precision) and later sessions' activations vary.
KV_SCALE_HEADROOM = 16.0


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to E4M3, saturating at ±448 (a plain cast is free to give NaN out of range)."""
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def head_scales(x: torch.Tensor, headroom: float = KV_SCALE_HEADROOM) -> torch.Tensor:
    """One scale per head of ``x`` [tokens, heads, head_dim]: ``amax * headroom / 448`` (1 where all zero)."""
    amax = x.detach().abs().float().amax(dim=(0, 2))
    return torch.where(torch.isfinite(amax) & (amax > 0), amax * (headroom / E4M3_MAX), torch.ones_like(amax))


class CalibratingAttention:
    """An attention backend that first sets each layer's KV scales from the keys and values it is about to
    write (in place, so captured graphs see them), then runs ``inner``. The runner uses it for one forward."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def prepare(self, meta):
        return self.inner.prepare(meta)

    def __call__(self, query, key, value, k_cache, v_cache, plan, kv_scale=None):
        if kv_scale is not None:
            kv_scale.copy_(torch.stack([head_scales(key), head_scales(value)]))
        return self.inner(query, key, value, k_cache, v_cache, plan, kv_scale)
