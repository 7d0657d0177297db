"""The CPU decode-attention kernel (``metronome/csrc/decode_attention.c``, built by ``metronome/native.py``),
typed for torch tensors.

SDPA's CPU kernel is built for long queries; a decode round has one query token per session, and there it
runs at a fraction of memory speed. The C kernel reads each session's keys and values once, in L1-sized
tiles. Where no compiler builds it, ``cpu_attention="auto"`` falls back to SDPA and says why (the engine loads
the library once, for this and the products).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from metronome.attention.fp8 import E4M3
from metronome.native import NativeLibrary, load_library

# The C kernels' dtype codes (csrc/*.c: 0 float32, 1 bfloat16).
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# What the decode-attention kernel reads keys and values as: the query's dtype, or E4M3 with per-head scales.
KV_KINDS = {**DTYPES, E4M3: 2}


def check_attention(code: int) -> None:
    """Raise for ``metronome_decode_attention``'s return code (0: done)."""
    if code == 2:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    if code:
        raise ValueError(f"the CPU attention kernel refused its inputs (code {code})")


@dataclass(frozen=True)
class CpuDecodeKernel:
    """Decode attention through the native library; a head dim must be a multiple of ``vector_width``."""

    library: NativeLibrary

    @property
    def vector_width(self) -> int:
        return self.library.vector_width

    @property
    def path(self) -> Path:
        return self.library.path

    def supports(self, kv_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether it attends over keys and values of ``kv_dtype`` (float32, bfloat16 or E4M3) at ``head_dim``."""
        return kv_dtype in KV_KINDS and head_dim % self.vector_width == 0

    def __call__(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``query`` [n, kv_heads, group, dim] over ``k``/``v`` [>= n, kv_heads, >= width, dim]
        (rows of ``dim`` contiguous values, any row and head strides) for the ``width`` columns ``mask``
        [n, width] (bool, True = attend) allows; returns [n, kv_heads, group, dim] in ``query``'s dtype.
        Keys and values are in ``query``'s dtype, or E4M3 with ``kv_scale`` [2, kv_heads] (float32: each head's
        key scale, then its value scale, as ``attention/fp8.py`` stores them).
        The kernel reads raw memory, so everything it assumes is checked here (``ValueError``)."""
        n, kv_heads, group, dim = query.shape
        width = mask.shape[1]
        fp8 = k.dtype == E4M3
        if query.dtype not in DTYPES or not self.supports(k.dtype, dim) or k.dtype != v.dtype \
                or (k.dtype != query.dtype and not fp8) or fp8 != (kv_scale is not None):
            raise ValueError(f"the CPU kernel takes float32 or bfloat16 queries, keys and values of the query's dtype "
                             f"or E4M3 with their scales, and a head dim that is a multiple of {self.vector_width}; "
                             f"got {query.dtype}, {k.dtype}, {v.dtype}, head dim {dim}, scales "
                             f"{'given' if kv_scale is not None else 'none'}")
        if fp8:
            if kv_scale.shape != (2, kv_heads) or kv_scale.device.type != "cpu":
                raise ValueError(f"E4M3 keys and values take CPU scales [2, {kv_heads}]; got {tuple(kv_scale.shape)}")
            kv_scale = kv_scale.to(torch.float32).contiguous()
        if not all(t.device.type == "cpu" for t in (query, k, v, mask)) or mask.dtype != torch.bool \
                or mask.shape[0] != n or k.shape != v.shape or k.stride() != v.stride() \
                or k.shape[0] < n or k.shape[1] != kv_heads or k.shape[2] < width or k.shape[3] != dim \
                or k.stride(3) != 1 or k.stride(2) != dim:
            raise ValueError(f"the CPU kernel takes CPU tensors: keys and values alike [>= {n}, {kv_heads}, "
                             f">= {width}, {dim}] with contiguous rows, a bool mask [{n}, {width}]; got keys "
                             f"{tuple(k.shape)} strides {k.stride()}, values {tuple(v.shape)} strides {v.stride()}, "
                             f"mask {tuple(mask.shape)} {mask.dtype}")
        query, mask = query.contiguous(), mask.contiguous()
        out = torch.empty_like(query)
        failed = self.library.cdll.metronome_decode_attention(
            n, kv_heads, group, dim, width, DTYPES[query.dtype], KV_KINDS[k.dtype], query.data_ptr(), k.data_ptr(),
            v.data_ptr(), k.stride(0), k.stride(1), mask.data_ptr(), mask.stride(0),
            kv_scale.data_ptr() if fp8 else None, out.data_ptr(), scale, torch.get_num_threads())
        check_attention(failed)
        return out

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """E4M3 ``codes`` [..., heads, dim] (contiguous) times ``scale`` [heads] (float32) in ``dtype``, as
        ``(codes.float() * scale[:, None]).to(dtype)`` gives it; None where it does not apply (other dtypes or
        layouts)."""
        if not (codes.dtype == E4M3 and codes.device.type == "cpu" and codes.is_contiguous() and codes.dim() >= 2
                and dtype in DTYPES and scale.dtype == torch.float32 and scale.shape == (codes.shape[-2],)):
            return None
        scale = scale.contiguous()
        out = torch.empty(codes.shape, dtype=dtype)
        heads, dim = codes.shape[-2:]
        if self.library.cdll.metronome_e4m3_dequantize(codes.numel() // dim, heads, dim, codes.data_ptr(),
                                                       scale.data_ptr(), out.data_ptr(), DTYPES[dtype],
                                                       torch.get_num_threads()):
            raise MemoryError("the CPU dequantiser could not allocate its scratch memory")
        return out

    def quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        """E4M3 codes, as bytes [T, heads, dim], of ``x`` [T, heads, dim] (float32 or bfloat16, each row's values
        contiguous, any token and head strides) over ``scale`` [heads] (float32): what ``attention.fp8.to_e4m3``
        gives, byte for byte, in one call. None where it does not apply (other dtypes or layouts)."""
        if not (x.dtype in DTYPES and x.device.type == "cpu" and x.dim() == 3 and x.stride(2) == 1
                and scale.dtype == torch.float32 and scale.device.type == "cpu" and scale.shape == (x.shape[1],)):
            return None
        scale = scale.contiguous()
        tokens, heads, dim = x.shape
        out = torch.empty(x.shape, dtype=torch.uint8)
        self.library.cdll.metronome_e4m3_quantize(tokens, heads, dim, x.data_ptr(), x.stride(0), x.stride(1),
                                                  DTYPES[x.dtype], scale.data_ptr(), out.data_ptr())
        return out

    def scatter_rows_(self, rows: torch.Tensor, dest: torch.Tensor, index: torch.Tensor) -> bool:
        """``dest[index[t * heads + h]] = rows[t, h]`` for ``rows`` [T, heads, width] (each row's values
        contiguous, any token and head strides) into ``dest`` [R, width] (contiguous): a decode round's new keys or
        values into the cache or the window's buffers, as ``index_copy_`` over the flattened rows. False (nothing
        written) where it does not apply: other dtypes or layouts, an index that is not [T * heads] int64.
        ``IndexError`` for an index outside ``dest``, as ``index_copy_``."""
        tokens, heads, width = rows.shape
        if not (rows.dtype == dest.dtype and rows.device.type == dest.device.type == index.device.type == "cpu"
                and dest.dim() == 2 and dest.shape[1] == width and dest.is_contiguous() and rows.stride(2) == 1
                and index.dtype == torch.int64 and index.is_contiguous() and index.shape == (tokens * heads,)
                and not (torch.is_grad_enabled() and dest.requires_grad)):
            return False
        size = rows.element_size()
        if self.library.cdll.metronome_scatter_rows(tokens, heads, width * size, rows.data_ptr(), rows.stride(0) * size,
                                                    rows.stride(1) * size, dest.data_ptr(), dest.shape[0],
                                                    index.data_ptr()):
            raise IndexError(f"a row index is outside the {dest.shape[0]} rows written to")
        return True

    def copy_rows_(self, src: torch.Tensor, src_index: torch.Tensor, dest: torch.Tensor,
                   dest_index: torch.Tensor) -> bool:
        """``dest[dest_index[i]] = src[src_index[i]]`` for ``src`` [R, width] and ``dest`` [R', width] (both
        contiguous, one dtype): the decode window's rows gathered out of the paged cache. False (nothing written)
        where it does not apply: other layouts, indices that are not int64 of one length. ``IndexError`` for an
        index outside its tensor, as ``index_select``."""
        if not (src.dtype == dest.dtype and src.device.type == dest.device.type == "cpu" == src_index.device.type
                == dest_index.device.type and src.dim() == dest.dim() == 2 and src.shape[1] == dest.shape[1]
                and src.is_contiguous() and dest.is_contiguous() and src_index.dtype == dest_index.dtype == torch.int64
                and src_index.is_contiguous() and dest_index.is_contiguous()
                and src_index.shape == dest_index.shape == (src_index.numel(),)
                and not (torch.is_grad_enabled() and dest.requires_grad)):
            return False
        if self.library.cdll.metronome_copy_rows(
                src_index.numel(), src.shape[1] * src.element_size(), src.data_ptr(), src.shape[0],
                src_index.data_ptr(), dest.data_ptr(), dest.shape[0], dest_index.data_ptr(), torch.get_num_threads()):
            raise IndexError(f"a row index is outside the {src.shape[0]} rows read or the {dest.shape[0]} written")
        return True


def load_kernel(directory: Path | None = None) -> CpuDecodeKernel:
    """The kernel for this CPU (``native.load_library``); raises ``native.KernelBuildError``."""
    return CpuDecodeKernel(load_library(directory))


def kernel_for(choice: str, library: NativeLibrary | None, dtype: torch.dtype, head_dim: int,
               kv_dtype: torch.dtype | None = None) -> tuple[CpuDecodeKernel | None, str]:
    """What ``EngineConfig.cpu_attention`` gives a model of ``dtype`` and ``head_dim`` over KV pages of ``kv_dtype``
    (None: ``dtype``), with the engine's C kernels (``library``; None where they could not be built): the kernel or
    None, and a line saying which and why. SDPA where asked, where there is no library, or where the kernel does not
    take the dtypes or head dim."""
    kv_dtype = kv_dtype or dtype
    if choice == "sdpa":
        return None, "decode attention: SDPA (as asked)"
    if library is None:
        return None, "decode attention: SDPA (the C kernels are not available; the warning above says why)"
    kernel = CpuDecodeKernel(library)
    if dtype not in DTYPES or kv_dtype not in (dtype, E4M3) or not kernel.supports(kv_dtype, head_dim):
        pages = "" if kv_dtype == dtype else f" over {kv_dtype} pages"
        return None, (f"decode attention: SDPA (the C kernel takes float32 or bfloat16, over pages of that dtype or "
                      f"E4M3, with a head dim that is a multiple of {kernel.vector_width}; this model has {dtype} and "
                      f"{head_dim}{pages})")
    return kernel, f"decode attention: C kernel ({library.vector_width * 32}-bit vectors, {library.path.name})"
