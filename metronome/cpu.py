"""The CPU this process runs on: what it executes natively, and how a serving box shares its cores.

Two decisions are made here, once, at start-up:

* ``auto_dtype``: ``EngineConfig(dtype="auto")`` becomes bfloat16 where the CPU executes bf16 matrix
  products natively (AMX-BF16 or AVX512-BF16: several times float32 there), float32 elsewhere (on AVX2
  alone torch emulates bf16, slower than float32).
* ``ThreadPlan``: the engine (torch intra-op threads), the ASR (CTranslate2), the VAD (onnxruntime) and the
  gateway each get a fixed share of the cores, so a busy front end never makes torch's threads wait for
  a core; ``thread_wait_env`` lets idle OpenMP threads spin only briefly before they sleep. Where
  speech and the tick still meet on a core (the voice threads outnumber the ASR's share), the speech threads
  run at a higher nice value (``lower_thread_priority``), so the tick, which has a deadline, goes first.

Torch-free at import: the gateway and ``metronome.config`` import this module.

>>> cap = CpuCapability("Intel Xeon", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}), cores=2)
>>> cap.native_bf16, auto_dtype("cpu", cap)
(True, 'bfloat16')
>>> auto_dtype("cpu", CpuCapability("AMD EPYC", frozenset({"avx2"}), cores=2))
'float32'
>>> ThreadPlan.for_box(2, speech=True)
ThreadPlan(cores=2, workers=1, worker=1, asr=1, vad=1, gateway=0, speech_nice=5)
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, MutableMapping, TypeVar

# Flags (as /proc/cpuinfo spells them) under which oneDNN runs bf16 matrix products in hardware.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# What idle OpenMP threads do: spin briefly, then sleep (libgomp: 10,000 rounds, a few hundred microseconds;
# Intel OpenMP: 1 ms). A decode round is hundreds of parallel regions microseconds apart, and waking a sleeping
# thread for each cost 30-80 us on a VM; between ticks they sleep, so a neighbour keeps its core
# (docs/benchmarks/cpu.md). Set before the runtime loads (before torch or CTranslate2 is imported); a value
# already set is kept, and OMP_WAIT_POLICY, where set, decides instead.
THREAD_WAIT_ENV = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}
# How ``serve`` hands each worker process its share (the worker reads it back with ``ThreadPlan.from_env``).
PLAN_ENV = "METRONOME_THREAD_PLAN"
# How much lower the speech threads (VAD, ASR, speech out) run than the engine's tick: a nice value's weight
# is ~1.25x the next one's, so at +5 the tick gets ~3/4 of a core it shares with one of them.
SPEECH_NICE = 5

T = TypeVar("T")


def triton_interpreted() -> bool:
    """Whether Triton kernels run in its interpreter on the CPU (``TRITON_INTERPRET=1``, as in the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers narrow), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class CpuCapability:
    model: str
    flags: frozenset[str]
    cores: int

    @property
    def native_bf16(self) -> bool:
        return any(f in self.flags for f in BF16_FLAGS)

    @property
    def vector_isa(self) -> str:
        for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2")):
            if flag in self.flags:
                return name
        return "no AVX2"

    def describe(self) -> str:
        """One line for the start-up log, e.g. ``AMD EPYC, 2 cores, AVX2, no native bf16``."""
        bf16 = "native bf16 (" + ", ".join(f for f in BF16_FLAGS if f in self.flags) + ")" \
            if self.native_bf16 else "no native bf16"
        return f"{self.model}, {self.cores} cores, {self.vector_isa}, {bf16}"


def read_capability(cpuinfo: str = "/proc/cpuinfo") -> CpuCapability:
    """The first processor's model name and flags from ``cpuinfo`` (empty when unreadable: not Linux)."""
    model, flags = "unknown CPU", frozenset()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return CpuCapability(model, flags, usable_cores())


def auto_dtype(device: str, capability: CpuCapability | None = None) -> str:
    """The engine dtype ``"auto"`` stands for: bfloat16 on a CPU with native bf16, else float32.

    Other devices keep float32 (pass ``dtype="bfloat16"`` for a GPU, as the GPU benchmarks do).
    """
    if not device.startswith("cpu"):
        return "float32"
    capability = capability or read_capability()
    return "bfloat16" if capability.native_bf16 else "float32"


@dataclass(frozen=True)
class ThreadPlan:
    """Fixed shares of one box's cores, per worker process: ``worker`` torch intra-op threads for the
    engine, ``asr`` CTranslate2 threads, ``vad`` onnxruntime threads and ``gateway`` cores kept for the
    gateway's event loop (0: it shares the front end's, it mostly waits on sockets).

    The front end (VAD + ASR) runs beside the engine's tick, so its cores are not the engine's; the VAD is
    a few milliseconds per tick and shares the ASR's core.

    >>> [(p.worker, p.asr, p.gateway) for p in (ThreadPlan.for_box(c, speech=True) for c in (1, 4, 8, 16))]
    [(1, 1, 0), (3, 1, 0), (5, 2, 1), (11, 4, 1)]
    >>> ThreadPlan.for_box(2, speech=False).worker    # no speech front end: the engine has both cores
    2
    """

    cores: int
    workers: int
    worker: int
    asr: int
    vad: int
    gateway: int
    speech_nice: int = 0   # the speech threads' nice value above the engine's (``lower_thread_priority``)

    @classmethod
    def for_box(cls, cores: int, speech: bool = True, workers: int = 1) -> ThreadPlan:
        cores, workers = max(1, cores), max(1, workers)
        gateway = 1 if cores >= 8 else 0
        asr = min(4, max(1, cores // 4)) if speech else 0
        per_worker = max(1, (cores - gateway) // workers)
        asr = min(asr, max(1, per_worker // 2)) if speech else 0
        return cls(cores, workers, max(1, per_worker - asr), asr, 1 if speech else 0, gateway,
                   SPEECH_NICE if speech else 0)

    @classmethod
    def for_this_process(cls, speech: bool = True, environ: MutableMapping[str, str] | None = None) -> ThreadPlan:
        """The plan ``serve`` handed this worker (``PLAN_ENV``), else this box's own."""
        environ = os.environ if environ is None else environ
        return cls.from_env(environ.get(PLAN_ENV, "")) or cls.for_box(usable_cores(), speech)

    def to_env(self) -> str:
        """``cores=2 workers=1 worker=1 asr=1 vad=1 gateway=0``: what ``from_env`` reads."""
        return " ".join(f"{k}={v}" for k, v in vars(self).items())

    @classmethod
    def from_env(cls, text: str) -> ThreadPlan | None:
        """The plan ``to_env`` wrote, or None for an empty or malformed value."""
        try:
            values = {k: int(v) for k, v in (item.split("=", 1) for item in text.split())}
            return cls(**values) if values else None
        except (TypeError, ValueError):
            return None

    def describe(self) -> str:
        front = f"ASR {self.asr} (CTranslate2), VAD {self.vad} (onnxruntime)" if self.asr else "no speech front end"
        gateway = f"gateway {self.gateway}" if self.gateway else "gateway shares"
        per = " per worker" if self.workers > 1 else ""
        wait = (f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}" if "OMP_WAIT_POLICY" in os.environ
                else f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}")
        nice = f"; speech threads at nice +{self.speech_nice}" if self.asr and self.speech_nice else ""
        return (f"threads on {self.cores} cores{per}: engine {self.worker} (torch, {wait}), "
                f"{front}, {gateway}{nice}")

    def apply_to_torch(self) -> None:
        """Give torch the engine's share (inter-op: one thread, the engine is single-threaded by design)."""
        import torch

        torch.set_num_threads(self.worker)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # only settable before the first inter-op work; one is the default use here
            pass


def thread_nice() -> int | None:
    """The calling thread's nice value, where the OS keeps one per thread (Linux; elsewhere a thread id is no
    ``PRIO_PROCESS`` target): None elsewhere."""
    if sys.platform != "linux":
        return None
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (at most to 19); the threads it starts inherit it.
    Where the OS keeps no nice value per thread, or refuses, nothing changes."""
    current = thread_nice()
    if nice <= 0 or current is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, current + nice))
    except OSError:
        pass


def start_at_lower_priority(build: Callable[[], T], nice: int) -> T:
    """``build()`` run on a short-lived thread at ``nice`` above this one: threads that a library starts while
    it loads (CTranslate2's workers) run at that priority from then on. What ``build`` raises, this raises."""
    if nice <= 0:
        return build()
    with ThreadPoolExecutor(1, "load-at-lower-priority", initializer=lower_thread_priority, initargs=(nice,)) as pool:
        return pool.submit(build).result()


def startup_line(device: str, dtype: str, plan: ThreadPlan | None) -> str:
    """What ``metronome serve`` and ``demo`` print at start-up: the CPU, the dtype and why, the threads."""
    if not device.startswith("cpu"):
        return f"engine on {device} in {auto_dtype(device) if dtype == 'auto' else dtype}"
    cap = read_capability()
    why = f"auto: {'native' if cap.native_bf16 else 'no native'} bf16" if dtype == "auto" else "as asked"
    line = f"cpu: {cap.describe()}; engine dtype {auto_dtype(device, cap) if dtype == 'auto' else dtype} ({why})"
    return line + (f"\n{plan.describe()}" if plan is not None else "")


def thread_wait_env(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set ``THREAD_WAIT_ENV`` in ``environ`` where unset; returns what it set. Nothing where ``OMP_WAIT_POLICY``
    is set: the user's policy decides (libgomp would take a spin count over PASSIVE). Call it before anything
    imports torch (the CLI's entry point does)."""
    if "OMP_WAIT_POLICY" in environ:
        return {}
    added = {k: v for k, v in THREAD_WAIT_ENV.items() if k not in environ}
    environ.update(added)
    return added
