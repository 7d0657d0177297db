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
import shlex
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
    home = os.path.expanduser("~")
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "metronome" / "kernels"
    if home.startswith("~"):   # no HOME and no passwd entry (an arbitrary container user)
        return Path(tempfile.gettempdir()) / f"metronome-kernels-{os.getuid()}"
    return Path(home) / ".cache" / "metronome" / "kernels"


def find_compiler() -> list[str] | None:
    """``$CC`` when set (a command line: ``ccache gcc`` works), else the first of cc, gcc, clang on the PATH."""
    if os.environ.get("CC", "").strip():
        return shlex.split(os.environ["CC"])
    found = next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    return [found] if found else None


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
        The kernel reads raw memory, so everything it assumes is checked here (``ValueError``)."""
        n, kv_heads, group, dim = query.shape
        width = mask.shape[1]
        if not self.supports(query.dtype, dim) or not (k.dtype == v.dtype == query.dtype):
            raise ValueError(f"the CPU kernel takes float32 or bfloat16 alike for query, keys and values and a head "
                             f"dim that is a multiple of {self.vector_width}; got {query.dtype}, {k.dtype}, "
                             f"{v.dtype}, head dim {dim}")
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
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
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
    except OSError:     # a damaged cache entry: build it once more
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


def _build(compiler: list[str], source: bytes, directory: Path, path: Path) -> None:
    """Compile into a temporary file beside ``path``, then rename it: processes building at once don't clash."""
    log.info("building the CPU attention kernel into %s", path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as work:
            src, lib = Path(work) / SOURCE, Path(work) / path.name
            src.write_bytes(source)
            command = [*compiler, *FLAGS, str(src), "-o", str(lib)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except subprocess.SubprocessError as e:
                raise KernelBuildError(f"{' '.join(command)} failed: {e}") from e
            if done.returncode != 0:
                raise KernelBuildError(f"{' '.join(command)} exited {done.returncode}: "
                                       f"{done.stderr.strip()[-2000:]}")
            os.replace(lib, path)
    except OSError as e:      # the cache is not writable, the disk is full, the compiler is not there
        raise KernelBuildError(f"cannot build the kernel into {directory}: {e}") from e


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
