"""Host-to-device copies that never wait for the device.

A copy from pageable host memory first waits for every kernel already queued on the stream: in the middle
of a tick that is a synchronisation, after which the host launches the rest of the tick while the GPU
idles. A copy from pinned memory with ``non_blocking`` is queued behind those kernels instead; torch's
pinned allocator keeps the staging memory until the copy has run.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import numpy as np
import torch


def to_device(data: torch.Tensor | np.ndarray | Sequence, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a tensor, an array or a list of numbers) as a tensor on ``device``, without a blocking copy."""
    tensor = torch.as_tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def embed_lists(embed: Callable[[torch.Tensor], torch.Tensor], lists: Sequence[Sequence[int]],
                device: torch.device | str) -> list[torch.Tensor]:
    """Each list of token ids embedded, from one copy and one lookup for all of them: a copy and a lookup a
    list cost the host tens of microseconds each, hundreds of sessions a tick, while the GPU waits."""
    sizes = [len(ids) for ids in lists]
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=sum(sizes))
    return list(embed(to_device(flat, device)).split(sizes))
