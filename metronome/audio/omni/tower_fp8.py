"""FP8 (E4M3) weights for an omni model's audio tower when the engine runs with ``quantization="fp8"``.

The linear layers of the tower's transformer blocks (``...layers.<i>...``: attention projections and MLP, nearly
all of its multiply-adds, over every session's rows at once) become ``Fp8Linear`` layers with one scale per
output channel; ``Fp8Linear`` picks each product by its row count (FP8 tensor cores on a GPU that has them, the
dequantised weight on the CPU). The rest keeps the tower's dtype: the convolutions; the linear layers outside the
blocks, a few per cent of the work (Qwen3-Omni's ``conv_out`` at the input; the projections into the decoder's
hidden size, whose rows enter the decoder with no norm after them); and any layer whose dimensions are not multiples
of 16, which the FP8 tensor cores cannot take (it would be dequantised for every product).
"""

from __future__ import annotations

import logging

from torch import nn

from metronome.errors import ConfigError
from metronome.models.fp8 import quantize_linears_, tensor_core_dims

log = logging.getLogger(__name__)


def kept_unquantized(path: str, linear: nn.Linear) -> bool:
    """Whether the tower's linear layer at ``path`` keeps its dtype (module docstring).

    >>> kept_unquantized("layers.3.fc1", nn.Linear(32, 64)), kept_unquantized("apm.layers.0.fc2", nn.Linear(64, 32))
    (False, False)
    >>> kept_unquantized("proj", nn.Linear(32, 64)), kept_unquantized("layers.0.fc1", nn.Linear(20, 64))
    (True, True)
    """
    return ".layers." not in f".{path}" or not tensor_core_dims(linear.in_features, linear.out_features)


def quantize_tower_(tower: nn.Module, quantization: str | None) -> nn.Module:
    """With ``quantization="fp8"``, the tower's block linear layers in FP8, in place; ``None`` leaves it as it is."""
    if quantization is None:
        return tower
    if quantization != "fp8":
        raise ConfigError(f"quantization must be None or 'fp8', got {quantization!r}")
    swapped = quantize_linears_(tower, skip=kept_unquantized)
    kept = [m for m in tower.modules() if isinstance(m, nn.Linear)]
    log.info("%s: %d linear layers (%.1f M weights) in FP8, %d kept in %s", type(tower).__name__, len(swapped),
             sum(m.weight.numel() for m in swapped) / 1e6, len(kept),
             "/".join(sorted({str(m.weight.dtype).removeprefix("torch.") for m in kept})) or "-")
    return tower
