"""Random weights for the GPU benchmarks: real shapes, nothing downloaded.

Like a freshly initialised model, so activations stay O(1) through dozens of layers (the kernels'
timing does not depend on the values, but NaNs would make some paths bail out early): matrices and
embeddings N(0, 0.02), norm weights 1, biases 0.

    net = random_decoder(LlamaFamilyForCausalLM, spec, "cuda", torch.bfloat16)
"""

from __future__ import annotations

import torch
from torch import nn


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


def random_decoder(cls, spec, device, dtype: torch.dtype, seed: int = 0, **kwargs) -> nn.Module:
    """``cls(spec, **kwargs)`` (an engine decoder: Llama family, MoE, ...) on ``device`` with random weights,
    projections fused and rotary tables built, as ``models.loader`` leaves a loaded one."""
    with torch.device("meta"):
        net = cls(spec, **kwargs)
    net = randomize_(net.to_empty(device=device).to(dtype), seed)
    net.fuse_projections()
    net.init_rotary(device)
    return net.eval().requires_grad_(False)
