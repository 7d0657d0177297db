"""What a worker is started with, and the adapter it builds from that."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import PurePath

from metronome import Engine, EngineConfig, KVPolicy
from metronome.config import AimdConfig
from metronome.audio.adapter import AdapterContext, InteractionAdapter
from metronome.audio.registry import RECORDS, adapter_factory, default_budget_ms
from metronome.engine.runner import DTYPES
from metronome.errors import ConfigError


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs: the engine's config, the adapter, the frame budget and the address.

    ``budget_ms=None`` takes the adapter's own B on this engine (``audio/registry.py``); the worker
    reports it in Health, and gateways adopt it or refuse a worker whose B differs from theirs.
    ``port=0`` binds an ephemeral port (``WorkerServer.port`` says which). ``max_input_tokens``
    bounds one session's input per tick (see "Chunking" in ``tick.py``); ``None`` picks
    ``max(1024, max_chunk_tokens)``.
    ``max_message_bytes`` bounds a Step request, and a StreamStep's input before its last message: 2 s of
    48 kHz PCM16 is 192 KB per session.
    Admission is the worker's (``admission.py``): ``aimd`` drives its session cap (its ``budget_ms`` is set
    to the worker's B), ``max_sessions`` is an optional static cap. On SIGTERM the worker drains: it admits
    nothing more and its live sessions run for up to ``drain_grace_s`` before it stops.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    budget_ms: float | None = None
    adapter: str = "cascade"
    max_input_tokens: int | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    max_message_bytes: int = 64 * 1024 * 1024
    auth_token: str | None = field(default=None, repr=False)  # required in every RPC's metadata (``auth.py``)
    voice: str = "auto"      # the cascade's speech out: "auto", "piper", "espeak" or "none" (text only)
    aimd: AimdConfig = field(default_factory=AimdConfig)
    max_sessions: int | None = None
    drain_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if self.adapter not in RECORDS:
            raise ConfigError(f"adapter must be one of {tuple(RECORDS)}, got {self.adapter!r}")
        if self.budget_ms is None:
            object.__setattr__(self, "budget_ms", default_budget_ms(self.adapter, device=self.engine.device,
                                                                    dtype=self.engine.dtype))
        if self.budget_ms <= 0:
            raise ConfigError(f"budget_ms must be > 0, got {self.budget_ms}")
        chunk = self.engine.max_chunk_tokens
        if self.max_input_tokens is None:
            object.__setattr__(self, "max_input_tokens", max(1024, chunk))
        if self.max_input_tokens < chunk:
            raise ConfigError(f"max_input_tokens ({self.max_input_tokens}) must be >= max_chunk_tokens ({chunk})")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535] (0: ephemeral), got {self.port}")
        if self.max_message_bytes < 1024 * 1024:
            raise ConfigError(f"max_message_bytes must be >= 1 MiB, got {self.max_message_bytes}")
        if (self.max_sessions is not None and self.max_sessions < 0) or self.drain_grace_s < 0:
            raise ConfigError("max_sessions must be >= 0 (or None) and drain_grace_s >= 0")
        if self.aimd.budget_ms != self.budget_ms:
            object.__setattr__(self, "aimd", replace(self.aimd, budget_ms=self.budget_ms))

    @property
    def max_instruction_tokens(self) -> int:
        """What a session's system prompt may take: the adapters' limit (half of one tick's input)."""
        return self.max_input_tokens // 2


def adapter_context(config: WorkerConfig, engine: Engine) -> AdapterContext:
    return AdapterContext(
        tokenizer=engine.tokenizer, checkpoint=engine.checkpoint, embed=engine.model.embed,
        device=engine.device, dtype=DTYPES[engine.config.dtype],
        max_input_tokens=config.max_input_tokens, budget_ms=config.budget_ms,
        compute_logits=engine.model.compute_logits, voice=config.voice, quantization=engine.config.quantization)


def make_adapter(config: WorkerConfig, engine: Engine) -> InteractionAdapter:
    """The adapter ``config.adapter`` names, built over the engine's tokenizer and embeddings."""
    if config.adapter not in RECORDS:
        raise ConfigError(f"adapter must be one of {tuple(RECORDS)}, got {config.adapter!r}")
    return adapter_factory(config.adapter)(adapter_context(config, engine))


def model_name(model) -> str:
    """What the worker tells others it serves: a packaged model's name, a checkpoint directory's name (the
    path stays on the worker's machine).

    >>> model_name("smollm2-135m"), model_name("/data/ckpt/Qwen2.5-Omni-7B/")
    ('smollm2-135m', 'Qwen2.5-Omni-7B')
    """
    return PurePath(str(model).rstrip("/\\")).name or str(model)


def policy_name(policy: KVPolicy) -> str:
    """The policy as Health reports it.

    >>> policy_name(KVPolicy(sinks=16, window=1024)), policy_name(KVPolicy(window=None))
    ('sink_window(S=16,W=1024)', 'unbounded')
    """
    return f"sink_window(S={policy.sinks},W={policy.window})" if policy.bounded else "unbounded"
