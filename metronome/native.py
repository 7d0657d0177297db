"""Metronome's C kernels for the CPU (``metronome/csrc/*.c``): built once per machine, cached, loaded with ctypes.

The sources are compiled together into one shared library with the system's C compiler, for the CPU it runs
on (``-march=native``: AVX2, AVX-512 or whatever the machine has), in about a second, into a cache keyed by
the sources, the compiler and the CPU; every later start loads it at once. ``-fopenmp`` threads the kernels;
the OpenMP runtime is the one torch already loaded (the same ``libgomp.so.1``), so they share its pool and
wait policy. The typed wrappers live beside their callers (``attention/cpu_kernel.py``,
``models/cpu_linear.py``, ``models/cpu_layer_ops.py``); this module only builds and loads.

Torch-free: it never imports torch.
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

from metronome.cpu import read_capability
from metronome.errors import MetronomeError

log = logging.getLogger(__name__)

# compiled into one library
SOURCES = ("decode_attention.c", "e4m3.c", "e4m3_linear.c", "scatter_rows.c", "skinny_linear.c", "layer_ops.c")
HEADERS = ("e4m3.h", "scalars.h", "vectors.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
CACHE_ENV = "METRONOME_KERNEL_CACHE"   # where built kernels are kept (default: the user's cache folder)
BUILD_TIMEOUT_S = 120


class KernelBuildError(MetronomeError):
    """The C kernels could not be built or loaded here; the message says why (compiler, flags, output)."""


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
class NativeLibrary:
    """The loaded library. ``vector_width``: floats in one vector of this CPU; the kernels need row lengths
    (head dim, a linear layer's input features) that are multiples of it."""

    cdll: ctypes.CDLL
    path: Path
    vector_width: int


def load_library(directory: Path | None = None, target: tuple[str, ...] = ()) -> NativeLibrary:
    """The kernels for this CPU: from the cache, or built into it first. Raises ``KernelBuildError``. ``target``:
    compiler flags after the defaults, for a build of a narrower instruction set than this CPU's (e.g.
    ``("-march=x86-64-v3",)``), so that one machine can run every branch the kernels take on others."""
    compiler = find_compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    sources = {name: (resources.files("metronome") / "csrc" / name).read_bytes() for name in SOURCES + HEADERS}
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"the C compiler {' '.join(compiler)!r} does not run: {e}") from e
    cpu = read_capability()
    flags = (*FLAGS, *target)
    key = hashlib.sha256(b"\0".join([*sources.values(), version.encode(), " ".join(flags).encode(),
                                     cpu.model.encode(), " ".join(sorted(cpu.flags)).encode()])).hexdigest()[:16]
    directory = directory or cache_dir()
    path = directory / f"metronome_cpu-{key}.so"
    if not path.exists():
        _build(compiler, flags, sources, directory, path)
    try:
        cdll = ctypes.CDLL(str(path))
    except OSError:     # a damaged cache entry: build it once more
        _build(compiler, flags, sources, directory, path)
        try:
            cdll = ctypes.CDLL(str(path))
        except OSError as e:
            raise KernelBuildError(f"the built kernels {path} do not load: {e}") from e
    cdll.metronome_vector_width.restype = ctypes.c_int
    cdll.metronome_decode_attention.restype = ctypes.c_int
    cdll.metronome_decode_attention.argtypes = (
        [ctypes.c_int] * 7 + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
        + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int])
    cdll.metronome_e4m3_dequantize.restype = ctypes.c_int
    cdll.metronome_e4m3_dequantize.argtypes = ([ctypes.c_long] + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3
                                               + [ctypes.c_int] * 2)
    cdll.metronome_e4m3_quantize.restype = ctypes.c_int
    cdll.metronome_e4m3_quantize.argtypes = ([ctypes.c_long] + [ctypes.c_int] * 2 + [ctypes.c_void_p]
                                             + [ctypes.c_long] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2)
    cdll.metronome_e4m3_linear.restype = ctypes.c_int
    cdll.metronome_e4m3_linear.argtypes = ([ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 4
                                           + [ctypes.c_long, ctypes.c_int])
    cdll.metronome_e4m3_linear_pairs.restype = ctypes.c_int
    cdll.metronome_e4m3_linear_pairs.argtypes = ([ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_long]
                                                 + [ctypes.c_void_p] * 4 + [ctypes.c_long, ctypes.c_int])
    cdll.metronome_e4m3_pairs_available.restype = ctypes.c_int
    cdll.metronome_scatter_rows.restype = ctypes.c_int
    cdll.metronome_scatter_rows.argtypes = ([ctypes.c_int] * 2 + [ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 2
                                            + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p])
    cdll.metronome_copy_rows.restype = ctypes.c_int
    cdll.metronome_copy_rows.argtypes = ([ctypes.c_long] * 2 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p] * 2
                                         + [ctypes.c_int])
    cdll.metronome_skinny_linear.restype = ctypes.c_int
    cdll.metronome_skinny_linear.argtypes = (
        [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_int])
    for name in ("metronome_rms_norm", "metronome_rope", "metronome_silu_mul"):
        getattr(cdll, name).restype = ctypes.c_int
    cdll.metronome_rms_norm.argtypes = (
        [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
                              ctypes.c_long, ctypes.c_int])
    cdll.metronome_rope.argtypes = (
        [ctypes.c_int] * 4 + [ctypes.c_void_p] + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int])
    cdll.metronome_silu_mul.argtypes = (
        [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_int])
    return NativeLibrary(cdll, path, cdll.metronome_vector_width())


def optional_library(choice: str, instead: str) -> NativeLibrary | None:
    """The library for a setting's ``choice``: ``"kernel"`` raises ``KernelBuildError`` where it cannot be had,
    ``"auto"`` logs why and returns None (the caller does ``instead``)."""
    try:
        return load_library()
    except KernelBuildError as e:
        if choice == "kernel":
            raise
        log.warning("Metronome's C kernels are not available, %s: %s", instead, e)
        return None


def _build(compiler: list[str], flags: tuple[str, ...], sources: dict[str, bytes], directory: Path,
           path: Path) -> None:
    """Compile into a temporary file beside ``path``, then rename it: processes building at once don't clash."""
    log.info("building Metronome's CPU kernels into %s", path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as work:
            for name, text in sources.items():
                (Path(work) / name).write_bytes(text)
            files = [str(Path(work) / name) for name in SOURCES]
            lib = Path(work) / path.name
            command = [*compiler, *flags, *files, "-o", str(lib)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except subprocess.SubprocessError as e:
                raise KernelBuildError(f"{' '.join(command)} failed: {e}") from e
            if done.returncode != 0:
                raise KernelBuildError(f"{' '.join(command)} exited {done.returncode}: "
                                       f"{done.stderr.strip()[-2000:]}")
            os.replace(lib, path)
    except OSError as e:      # the cache is not writable, the disk is full, the compiler is not there
        raise KernelBuildError(f"cannot build the kernels into {directory}: {e}") from e
