"""Random weights for the GPU benchmarks: real shapes, nothing downloaded.

Like a freshly initialised model, so activations stay O(1) through dozens of layers (the kernels'
timing does not depend on the values, but NaNs would make some paths bail out early): matrices and
embeddings N(0, 0.02), norm weights 1, biases 0.

    net = random_decoder(LlamaFamilyForCausalLM, spec, "cuda", torch.bfloat16)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from metronome.models.llama import fuse_layer


def randomize_(module: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Fill ``module``'s parameters in place (seeded on their device); returns it."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            is_norm = "norm" in name or "ln_" in name
            if is_norm and name.endswith("weight"):
                p.fill_(1.0)
            elif is_norm or name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
    return module


def random_decoder(cls, spec, device, dtype: torch.dtype, seed: int = 0,
                   each_layer: Callable[[nn.Module], object] | None = None, **kwargs) -> nn.Module:
    """``cls(spec, **kwargs)`` (an engine decoder: Llama family, MoE, ...) on ``device`` with random weights,
    projections fused and rotary tables built, as ``models.loader`` leaves a loaded one.

    The decoder layers are made one at a time, each handed to ``each_layer`` (quantised to FP8, say) before the
    next is made, so the model never needs to fit whole in its build dtype (Qwen3-Omni's 61 GB of bf16 on an
    80 GB card, as 31 GB of E4M3)."""
    with torch.device("meta"):
        net = cls(spec, **kwargs)
    layers, net.model.layers = net.model.layers, nn.ModuleList()
    net = randomize_(net.to_empty(device=device).to(dtype), seed)
    for i, layer in enumerate(layers):
        layer = randomize_(layer.to_empty(device=device).to(dtype), seed + 1 + i)
        fuse_layer(layer)
        if each_layer is not None:
            each_layer(layer)
        net.model.layers.append(layer)
    net.init_rotary(device)
    return net.eval().requires_grad_(False)
