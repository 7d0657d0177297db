"""Rotary position embedding (Hugging Face "rotate half" layout) and in-place key re-rotation.

Rotation by angle ``p * θ`` composes: ``R(-Δ) R(p) k = R(p - Δ) k``, so keys already stored at
position ``p`` move to ``p - Δ`` without recomputing them.

>>> import torch
>>> rope = Rotary(inv_freq=(1.0, 0.01), attention_scaling=1.0, device="cpu")
>>> k = torch.randn(3, 1, 4)
>>> cos, sin = rope.cos_sin(torch.tensor([40, 41, 42]))
>>> at_40 = rope.apply(k, cos, sin)
>>> cos2, sin2 = rope.cos_sin(torch.tensor([10, 11, 12]))
>>> torch.allclose(rope.shift(at_40, -30), rope.apply(k, cos2, sin2), atol=1e-5)
True
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary:
    def __init__(self, inv_freq: tuple[float, ...], attention_scaling: float, device: str | torch.device) -> None:
        self.inv_freq = torch.tensor(inv_freq, dtype=torch.float32, device=device)
        self.attention_scaling = attention_scaling

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [T, head_dim] (float32) for integer positions [T]."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] by per-token tables [T, head_dim]; keeps x's dtype."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        xf = x.to(torch.float32)
        return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)

    def shift(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """Move already-rotated keys [N, heads, head_dim] by ``delta`` positions (pure rotation)."""
        return self.apply(x, *self.shift_tables(torch.full((x.shape[0],), delta, device=x.device)))

    def shift_tables(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [N, head_dim] that move row i by ``deltas[i]`` positions (no attention scaling:
        a pure rotation of keys already stored). Angles in float64: deltas reach thousands of positions."""
        angle = deltas.to(torch.float64)[:, None] * self.inv_freq.to(torch.float64)[None, :]
        emb = torch.cat((angle, angle), dim=-1)
        return emb.cos().to(torch.float32), emb.sin().to(torch.float32)
