"""The CPU decode-attention kernel (``csrc/decode_attention.c``): built once per machine, cached, called
through ctypes.

SDPA's CPU kernel is built for long queries; a decode round has one query token per session, and there it
runs at a fraction of memory speed. The C kernel reads each session's keys and values once, in L1-sized
tiles. It is compiled with the system's C compiler for the CPU it runs on (``-march=native``: AVX2,
AVX-512 or whatever the machine has), in about a second, into a cache keyed by the source, the compiler
and the CPU, so every later start loads it at once. ``-fopenmp`` threads it; the OpenMP runtime is the one
torch already loaded (the same ``libgomp.so.1``), so the two share a pool and its wait policy.

Where no compiler is found or the build fails, ``cpu_attention="auto"`` falls back to SDPA and says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from metronome.cpu import read_capability
from metronome.errors import MetronomeError

log = logging.getLogger(__name__)

SOURCE = "decode_attention.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
CACHE_ENV = "METRONOME_KERNEL_CACHE"   # where built kernels are kept (default: the user's cache folder)
BUILD_TIMEOUT_S = 120
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class KernelBuildError(MetronomeError):
    """The CPU kernel could not be built or loaded here; the message says why (compiler, flags, output)."""


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "metronome" / "kernels"


def find_compiler() -> str | None:
    """``$CC`` when set, else the first of cc, gcc, clang on the PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    return next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


@dataclass(frozen=True)
class CpuDecodeKernel:
    """The loaded kernel. ``vector_width``: floats per vector on this CPU; a head dim must be a multiple."""

    library: ctypes.CDLL
    path: Path
    vector_width: int

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in DTYPES and head_dim % self.vector_width == 0

    def __call__(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """Attention of ``query`` [n, kv_heads, group, dim] over ``k``/``v`` [>= n, kv_heads, >= width, dim]
        (rows of ``dim`` contiguous values, any row and head strides) for the ``width`` columns ``mask``
        [n, width] (bool, True = attend) allows; returns [n, kv_heads, group, dim] in ``query``'s dtype.
        The caller checks ``supports``: the kernel reads raw memory."""
        n, kv_heads, group, dim = query.shape
        width = mask.shape[1]
        query, mask = query.contiguous(), mask.contiguous()
        out = torch.empty_like(query)
        failed = self.library.metronome_decode_attention(
            n, kv_heads, group, dim, width, DTYPES[query.dtype], query.data_ptr(), k.data_ptr(), v.data_ptr(),
            k.stride(0), k.stride(1), mask.data_ptr(), mask.stride(0), out.data_ptr(), scale,
            torch.get_num_threads())
        if failed:
            raise MemoryError("the CPU attention kernel could not allocate its scratch memory") if failed == 2 \
                else ValueError(f"head dim {dim} is not a multiple of the vector width {self.vector_width}")
        return out


def load_kernel(directory: Path | None = None) -> CpuDecodeKernel:
    """The kernel for this CPU: from the cache, or built into it first. Raises ``KernelBuildError``."""
    compiler = find_compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    source = (resources.files("metronome.attention") / "csrc" / SOURCE).read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"the C compiler {compiler!r} does not run: {e}") from e
    cpu = read_capability()
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(FLAGS).encode(), cpu.model.encode(),
                                     " ".join(sorted(cpu.flags)).encode()])).hexdigest()[:16]
    directory = directory or cache_dir()
    path = directory / f"decode_attention-{key}.so"
    if not path.exists():
        _build(compiler, source, directory, path)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"the built kernel {path} does not load: {e}") from e
    library.metronome_decode_attention.restype = ctypes.c_int
    library.metronome_decode_attention.argtypes = (
        [ctypes.c_int] * 6 + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
        + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_float, ctypes.c_int])
    library.metronome_vector_width.restype = ctypes.c_int
    return CpuDecodeKernel(library, path, library.metronome_vector_width())


def _build(compiler: str, source: bytes, directory: Path, path: Path) -> None:
    """Compile into a temporary file beside ``path``, then rename it: processes building at once don't clash."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelBuildError(f"cannot create the kernel cache {directory}: {e}") from e
    log.info("building the CPU attention kernel into %s", path)
    with tempfile.TemporaryDirectory(dir=directory) as work:
        src, lib = Path(work) / SOURCE, Path(work) / path.name
        src.write_bytes(source)
        command = [compiler, *FLAGS, str(src), "-o", str(lib)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelBuildError(f"{' '.join(command)} failed: {e}") from e
        if done.returncode != 0:
            raise KernelBuildError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(lib, path)


def kernel_for(choice: str) -> tuple[CpuDecodeKernel | None, str]:
    """What ``EngineConfig.cpu_attention`` gives: the kernel or None, and a line saying which and why.
    ``"kernel"`` raises ``KernelBuildError`` where it cannot be had; ``"auto"`` falls back to SDPA."""
    if choice == "sdpa":
        return None, "decode attention: SDPA (as asked)"
    try:
        kernel = load_kernel()
    except KernelBuildError as e:
        if choice == "kernel":
            raise
        log.warning("the CPU attention kernel is not available, decode rounds use SDPA: %s", e)
        return None, f"decode attention: SDPA (the C kernel is not available: {e})"
    return kernel, f"decode attention: C kernel ({kernel.vector_width * 32}-bit vectors, {kernel.path.name})"
