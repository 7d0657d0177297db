"""Typed, validated configuration.

>>> KVPolicy(sinks=16, window=1024, block_size=16).rebase_interval
256
>>> KVPolicy(window=None).bounded
False
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from metronome.cpu import auto_dtype
from metronome.errors import ConfigError

# The paper's frame period B: the default of every adapter whose model does not fix its own
# (audio/registry.py holds each adapter's B; a gateway given none adopts its workers').
DEFAULT_BUDGET_MS = 2000.0

PositionMode = Literal["absolute", "rebased"]


@dataclass(frozen=True)
class KVPolicy:
    """What each session keeps in its KV cache.

    A bounded policy keeps the first ``sinks`` tokens (pinned "attention sinks") plus the ``window``
    most recent tokens: the query at token index ``t`` attends to keys ``[0, sinks) ∪ [t - window, t]``.
    ``window=None`` keeps everything (the Unbounded baseline that reproduces today's engines).

    ``positions="absolute"`` gives every token its true RoPE position, so a session ends at the
    model's position limit. ``positions="rebased"`` re-rotates the live window keys by ``R(-Δ)``
    every ``Δ = rebase_interval`` tokens so positions stay below ``sinks + window + Δ + chunk``.
    """

    sinks: int = 16
    window: int | None = 1024
    block_size: int = 16
    positions: PositionMode | None = None  # None: "rebased" when bounded, else "absolute"
    rebase_every: int | None = None  # Δ; None picks max(block_size, window // 4)

    def __post_init__(self) -> None:
        if self.positions is None:
            object.__setattr__(self, "positions", "rebased" if self.window is not None else "absolute")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.sinks < 0:
            raise ConfigError(f"sinks must be >= 0, got {self.sinks}")
        if self.window is not None and self.window < 1:
            raise ConfigError(f"window must be >= 1 or None (unbounded), got {self.window}")
        if self.positions not in ("absolute", "rebased"):
            raise ConfigError(f"positions must be 'absolute' or 'rebased', got {self.positions!r}")
        if self.positions == "rebased" and self.window is None:
            raise ConfigError("positions='rebased' needs a window; an unbounded cache keeps absolute positions")
        if self.rebase_every is not None and self.rebase_every < 1:
            raise ConfigError(f"rebase_every must be >= 1, got {self.rebase_every}")

    @property
    def bounded(self) -> bool:
        return self.window is not None

    @property
    def rebase_interval(self) -> int:
        if self.rebase_every is not None:
            return self.rebase_every
        return max(self.block_size, (self.window or 0) // 4)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start.

    ``model`` is ``"smollm2-135m"`` (the packaged default) or a Hugging Face checkpoint directory.
    ``num_blocks=None`` sizes the KV pool from free memory (``kv_memory_fraction`` of it).
    ``max_chunk_tokens`` bounds one session's new input per step; it enters the reservation formula.
    ``dtype="auto"`` becomes bfloat16 on a CPU that executes it natively (AMX or AVX512-BF16), float32
    elsewhere (``metronome.cpu.auto_dtype``); the config always holds the resolved name.

    ``quantization="fp8"``: the decoder's linear layers and MoE experts hold E4M3 weights with per-channel
    scales, quantised at load (an FP8 checkpoint, ``quantization_config.quant_method == "fp8"``, loads as
    stored whatever this says); so do the linear layers of the omni adapters' audio towers' blocks
    (``audio/omni/tower_fp8.py``). ``kv_cache_dtype="fp8"``: KV pages hold E4M3 with one scale per layer and
    KV head, one byte per element (``"auto"``: the compute ``dtype``).

    ``cpu_linear`` (CPU only): ``"packed"`` packs the decoder's linear weights once for oneDNN
    (``models/cpu_linear.py``); ``"kernel"`` multiplies float32 weights by few rows (decode rounds, the logits)
    in Metronome's C kernel; ``"aten"`` keeps ``F.linear``; ``"auto"`` packs bfloat16 weights where oneDNN
    can (a CPU with bf16 instructions) and gives float32 to the C kernel where it builds (else aten). FP8 weights
    (``quantization="fp8"``) multiply through their own C kernel unless ``"aten"``, which dequantises them for each
    product.

    ``cpu_attention`` (CPU only): how decode rounds attend. ``"kernel"``: the C kernel built for this CPU
    (``attention/cpu_kernel.py``; an error where it cannot be built); ``"sdpa"``: torch's SDPA; ``"auto"``:
    the kernel where it builds, SDPA elsewhere (logged).

    ``cpu_elementwise`` (CPU only): a layer's RMSNorms, rotary embedding and SiLU-times-up. ``"kernel"``: one C
    call each (``models/cpu_layer_ops.py``; an error where the kernels cannot be built); ``"torch"``: torch's
    operators; ``"auto"``: the kernels where they build, torch elsewhere (logged).
    """

    model: str = "smollm2-135m"
    policy: KVPolicy = field(default_factory=KVPolicy)
    device: str = "cpu"
    dtype: str = "auto"
    num_blocks: int | None = None
    max_chunk_tokens: int = 256
    max_batch_tokens: int = 8192
    kv_memory_fraction: float = 0.25
    attention: str | None = None  # "torch" (reference) or "triton"; None: triton on CUDA, torch elsewhere
    cuda_graphs: bool = True      # capture decode rounds as CUDA graphs (CUDA with Triton attention only)
    seed: int = 0
    quantization: str | None = None  # None (the checkpoint's dtype) or "fp8"
    kv_cache_dtype: str = "auto"     # "auto" (the compute dtype) or "fp8"
    cpu_linear: str = "auto"         # "auto", "packed", "kernel" or "aten"
    cpu_attention: str = "auto"      # "auto", "kernel" or "sdpa"
    cpu_elementwise: str = "auto"    # "auto", "kernel" or "torch"

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", auto_dtype(self.device))
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (one is the null block), got {self.num_blocks}")
        if self.max_chunk_tokens < 1:
            raise ConfigError(f"max_chunk_tokens must be >= 1, got {self.max_chunk_tokens}")
        if self.max_batch_tokens <= self.max_chunk_tokens:
            raise ConfigError(
                f"max_batch_tokens ({self.max_batch_tokens}) must exceed max_chunk_tokens "
                f"({self.max_chunk_tokens}) so every session's segment fits in one forward")
        if not 0.0 < self.kv_memory_fraction <= 0.95:
            raise ConfigError(f"kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction}")
        if self.attention is None:
            object.__setattr__(self, "attention", "triton" if self.device.startswith("cuda") else "torch")
        if self.attention not in ("torch", "triton"):
            raise ConfigError(f"attention must be 'torch' or 'triton', got {self.attention!r}")
        if self.quantization not in (None, "fp8"):
            raise ConfigError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.cpu_linear not in ("auto", "packed", "kernel", "aten"):
            raise ConfigError(f"cpu_linear must be 'auto', 'packed', 'kernel' or 'aten', got {self.cpu_linear!r}")
        if self.cpu_attention not in ("auto", "kernel", "sdpa"):
            raise ConfigError(f"cpu_attention must be 'auto', 'kernel' or 'sdpa', got {self.cpu_attention!r}")
        if self.cpu_elementwise not in ("auto", "kernel", "torch"):
            raise ConfigError(f"cpu_elementwise must be 'auto', 'kernel' or 'torch', got {self.cpu_elementwise!r}")
        if not self.device.startswith("cpu") and "kernel" in (self.cpu_linear, self.cpu_attention,
                                                              self.cpu_elementwise):
            raise ConfigError(f"cpu_linear/cpu_attention/cpu_elementwise='kernel' are the CPU's C kernels; the device "
                              f"is {self.device}")
        if self.cpu_elementwise == "kernel" and self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"cpu_elementwise='kernel' runs float32 or bfloat16, the engine's dtype is {self.dtype}")
        if self.cpu_linear == "kernel" and self.dtype != "float32":
            raise ConfigError(f"cpu_linear='kernel' multiplies float32 weights, the engine's dtype is {self.dtype}")
        if self.quantization is not None and self.cpu_linear == "kernel":
            raise ConfigError("cpu_linear='kernel' multiplies float32 weights; quantization='fp8' keeps E4M3 ones")


@dataclass(frozen=True)
class AimdConfig:
    """Admission controller settings (see ``serving/admission.py``).

    The controller reads each tick's latency and moves the session cap: multiplicative decrease by
    ``backoff`` when the robust latency statistic over the last ``window`` ticks exceeds
    ``target_fraction * budget_ms`` (or a deadline was missed), additive increase by ``step`` when
    latency is under target and live sessions are within ``grow_headroom`` of the cap. Until its first
    decrease the robust controller starts fast: a verdict under target may multiply the cap by up to
    ``slow_start`` (1 turns this off), bounded by what the measured latency projects to fit. With
    ``load_evidence`` the robust controller decreases only once latency has been seen to grow with the
    number of sessions: a fixed per-tick cost (one session's own speech recognition) is not overload.
    """

    budget_ms: float = DEFAULT_BUDGET_MS   # the gateway sets its own B here
    target_fraction: float = 0.3
    backoff: float = 0.9
    step: int = 1
    window: int = 5
    initial_cap: int | None = 4   # None: start at the memory/static ceiling, as the paper's prototype did
    min_cap: int = 1
    grow_headroom: int = 2
    slow_start: float = 2.0
    load_evidence: bool = True

    def __post_init__(self) -> None:
        if self.budget_ms <= 0:
            raise ConfigError(f"budget_ms must be > 0, got {self.budget_ms}")
        if not 0.0 < self.target_fraction <= 1.0:
            raise ConfigError(f"target_fraction must be in (0, 1], got {self.target_fraction}")
        if not 0.0 < self.backoff < 1.0:
            raise ConfigError(f"backoff must be in (0, 1), got {self.backoff}")
        if self.step < 1 or self.window < 1 or self.min_cap < 0 or self.grow_headroom < 0:
            raise ConfigError("step and window must be >= 1; min_cap and grow_headroom >= 0")
        if not self.slow_start >= 1.0:
            raise ConfigError(f"slow_start must be >= 1 (1 = additive growth only), got {self.slow_start}")
        if self.initial_cap is not None and self.initial_cap < self.min_cap:
            raise ConfigError(f"initial_cap ({self.initial_cap}) must be >= min_cap ({self.min_cap})")

    @property
    def target_ms(self) -> float:
        return self.target_fraction * self.budget_ms


@dataclass(frozen=True)
class GatewayConfig:
    """The WebSocket gateway: where it listens, which workers it drives, and its limits per client.

    Slow readers: each client has a bounded queue of ``send_queue_events`` outgoing events and
    ``send_queue_bytes`` bytes; a client that lets it fill (stops reading) is disconnected with an error
    rather than growing server memory. Input per tick is bounded too: audio by ``max_buffered_audio_s``,
    text by ``max_text_bytes_per_tick`` (beyond it an error event), and a whole Step by
    ``max_step_bytes`` (sessions that do not fit wait for the next tick).

    Input goes to the worker as it arrives, every ``stream_interval_ms``, so that at the tick only the
    remainder crosses the wire (``StreamStep``); at ``stream_interval_ms >= budget_ms`` each tick's input
    goes in one message at the tick.

    ``budget_ms=None``: adopt the frame budget B the workers report (their adapter's); a given B must
    equal every worker's, and a worker that reports another is not used.

    Hostile clients cost only themselves: typed text (``max_text_bytes_per_tick``) and instructions
    (``max_instruction_bytes``) are bounded in bytes here and in tokens by the worker before its engine
    thread; audio may run ``audio_realtime_factor`` times faster than real time after a burst of
    ``max_buffered_audio_s``. Each refusal of oversized input is a strike: ``abuse_strikes`` of them with
    less than ``abuse_window_s`` between them close the socket (1008). Liveness: a ping after
    ``ping_interval_s`` of silence on the socket, unanswered for ``pong_timeout_s``, closes it; a session
    that sends no event for ``idle_timeout_s`` (0: never; audio, silence included, is an event) is closed;
    an HTTP request must arrive whole within ``handshake_timeout_s`` and ``max_header_bytes``. Failed
    API-key attempts are limited to ``auth_failures_per_min`` per client address (then 429).
    ``worker_token``: sent to the workers in every RPC (``serving/auth.py``).

    ``workers``: ``host:port`` entries and ``dns:NAME:PORT`` entries (every address NAME resolves to, a
    Kubernetes headless Service; resolved again every ``discovery_interval_s``). ``admission``: "worker"
    (each worker admits or refuses by its own controller, so gateways can share workers) or "gateway" (the
    paper's arrangement: this gateway's own ``controller`` per worker, for experiments). On SIGTERM the
    gateway drains: it admits nothing more, tells its sessions ``session_ending`` and closes those still
    open after ``drain_grace_s`` with 1001.
    """

    workers: tuple[str, ...] = ("127.0.0.1:50051",)
    host: str = "127.0.0.1"
    port: int = 8000
    budget_ms: float | None = None
    tokens_per_tick: int = 25
    max_sessions: int | None = None       # static cap, combined with the controller's
    api_key: str | None = None
    model_name: str = "metronome"
    max_message_bytes: int = 1 << 20      # larger messages get an error; 4x this closes the socket
    max_buffered_audio_s: float = 10.0    # audio waiting for the next tick, per session
    send_queue_events: int = 512
    send_queue_bytes: int = 8 << 20       # ... and at most this many bytes of them (events can be ~1 MiB)
    max_messages_per_s: float = 250.0     # sustained client event rate (20 ms chunks are 50/s)
    # User text (conversation.item.create) per session per tick: about 2000 tokens of English, twice what a
    # worker takes in one tick. The worker counts what passes in tokens on its token thread, and at 32 KiB
    # that counting alone added 40 ms to other sessions' ticks on a shared 2-core box (bench/abuse.py).
    max_text_bytes_per_tick: int = 8 << 10
    max_instruction_bytes: int = 16 << 10
    audio_realtime_factor: float = 2.0
    abuse_strikes: int = 3
    abuse_window_s: float = 10.0
    ping_interval_s: float = 20.0
    pong_timeout_s: float = 20.0
    idle_timeout_s: float = 120.0
    handshake_timeout_s: float = 5.0
    max_header_bytes: int = 16 << 10
    auth_failures_per_min: float = 10.0
    worker_token: str | None = field(default=None, repr=False)
    max_step_bytes: int = 48 << 20        # one Step request; under the worker's 64 MiB gRPC message limit
    step_timeout_s: float = 30.0
    stream_interval_ms: float = 100.0
    aimd: AimdConfig = field(default_factory=AimdConfig)
    controller: str = "aimd"  # "aimd" (robust) or "paper" (the prototype's single-sample rule, for experiments)
    admission: str = "worker"  # "worker": the workers' own caps; "gateway": ``controller`` here, per worker
    discovery_interval_s: float = 5.0
    drain_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.workers:
            raise ConfigError("the gateway needs at least one worker address")
        if (self.budget_ms is not None and self.budget_ms <= 0) or self.tokens_per_tick < 0:
            raise ConfigError("budget_ms must be > 0 (or None: the workers') and tokens_per_tick >= 0")
        if self.max_sessions is not None and self.max_sessions < 0:
            raise ConfigError(f"max_sessions must be >= 0, got {self.max_sessions}")
        if self.max_message_bytes < 1024 or self.send_queue_events < 8 or self.max_messages_per_s <= 0:
            raise ConfigError("max_message_bytes >= 1024, send_queue_events >= 8, max_messages_per_s > 0")
        if self.send_queue_bytes < 1024 or self.max_text_bytes_per_tick < 1:
            raise ConfigError("send_queue_bytes >= 1024 and max_text_bytes_per_tick >= 1")
        one_session = self.max_text_bytes_per_tick + int(self.max_buffered_audio_s * 48000) * 2 + 4096
        if self.max_step_bytes < one_session:
            raise ConfigError(f"max_step_bytes must hold one session's tick at the limits ({one_session} bytes)")
        if self.controller not in ("aimd", "paper"):
            raise ConfigError(f"controller must be 'aimd' or 'paper', got {self.controller!r}")
        if self.admission not in ("worker", "gateway"):
            raise ConfigError(f"admission must be 'worker' or 'gateway', got {self.admission!r}")
        if not self.discovery_interval_s > 0 or self.drain_grace_s < 0:
            raise ConfigError("discovery_interval_s must be > 0 and drain_grace_s >= 0")
        if not self.stream_interval_ms > 0:
            raise ConfigError(f"stream_interval_ms must be > 0, got {self.stream_interval_ms}")
        if self.max_instruction_bytes < 1 or self.abuse_strikes < 1 or not self.audio_realtime_factor >= 1.0:
            raise ConfigError("max_instruction_bytes >= 1, abuse_strikes >= 1 and audio_realtime_factor >= 1")
        positive = ("abuse_window_s", "ping_interval_s", "pong_timeout_s", "handshake_timeout_s",
                    "auth_failures_per_min")
        if not all(getattr(self, name) > 0 for name in positive) or self.idle_timeout_s < 0:
            raise ConfigError(f"{', '.join(positive)} must be > 0 and idle_timeout_s >= 0 (0: no idle timeout)")
        if self.max_header_bytes < 1024:
            raise ConfigError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.budget_ms is not None and self.aimd.budget_ms != self.budget_ms:
            object.__setattr__(self, "aimd", replace(self.aimd, budget_ms=self.budget_ms))
