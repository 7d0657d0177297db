"""The interaction adapters a worker can run, by name, and the frame budget B each is built for.

The omni models' adapters come from their records (``models/omni/registry.py``); the two model-agnostic
adapters are listed here. Nothing heavy is imported until an adapter is built (the cascade loads
Whisper, the omni adapters their audio encoders), so the CLI can read this table at start-up.

``resolve_adapter`` picks the adapter a checkpoint needs when the user asks for ``auto``: an omni model's
own audio path, else the speech cascade. ``default_budget_ms`` gives its B on the engine it will drive.

>>> resolve_adapter("smollm2-135m", "auto"), resolve_adapter("smollm2-135m", "energy")
('cascade', 'energy')
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from metronome.config import DEFAULT_BUDGET_MS
from metronome.cpu import auto_dtype
from metronome.models.omni.registry import OMNI_MODELS, omni_model, resolve


@dataclass(frozen=True)
class AdapterRecord:
    name: str
    factory: str        # "module:attr": called with an AdapterContext, returns the adapter
    budget_ms: float    # the default frame budget B
    float32_cpu_budget_ms: float | None = None   # B where the engine computes in float32 on a CPU, if other


_RECORDS = (
    # The cascade's B is short: a spoken reply waits for two tick boundaries (its transcript joining a tick,
    # its first speech leaving in one). A float32 engine on a CPU needs the longer B for the tick that prefills
    # a question. Measured: docs/benchmarks/cpu.md.
    AdapterRecord("cascade", "metronome.audio.cascade:CascadeAdapter.from_context", 250.0, 500.0),
    AdapterRecord("energy", "metronome.audio.energy_tokens:EnergyTokenAdapter.from_context", DEFAULT_BUDGET_MS),
    *(AdapterRecord(m.name, m.adapter, m.budget_ms) for m in OMNI_MODELS),
)
RECORDS = {r.name: r for r in _RECORDS}

# Views of the records: name -> factory reference; config.json model_type -> the adapter of that
# model's own audio path.
ADAPTERS = {name: r.factory for name, r in RECORDS.items()}
MODEL_TYPE_ADAPTERS = {t: m.name for m in OMNI_MODELS for t in m.model_types}


def adapter_record(name: str) -> AdapterRecord:
    if name not in RECORDS:
        raise ValueError(f"adapter must be one of {tuple(RECORDS)}, got {name!r}")
    return RECORDS[name]


def default_budget_ms(adapter: str, *, device: str, dtype: str) -> float:
    """The frame budget B ``adapter`` is built for, on an engine of that device and dtype ("auto": the one
    the engine picks); ValueError for an unknown adapter.

    >>> [default_budget_ms(a, device="cpu", dtype="float32") for a in ("moshi", "cascade")]
    [80.0, 500.0]
    >>> default_budget_ms("cascade", device="cpu", dtype="bfloat16")
    250.0
    """
    record = adapter_record(adapter)
    if record.float32_cpu_budget_ms is not None and device.startswith("cpu"):
        if (auto_dtype(device) if dtype == "auto" else dtype) == "float32":
            return record.float32_cpu_budget_ms
    return record.budget_ms


def adapter_factory(adapter: str):
    """The callable that builds ``adapter`` from an AdapterContext (imports its module)."""
    return resolve(adapter_record(adapter).factory)


def resolve_adapter(model: str, adapter: str) -> str:
    """The adapter for ``model``: ``adapter="auto"`` reads the checkpoint's model_type."""
    if adapter == "auto":
        adapter = "cascade"
        config = Path(model).expanduser() / "config.json"
        if config.is_file():
            try:
                model_type = json.loads(config.read_text()).get("model_type")
            except (OSError, ValueError):
                model_type = None   # the loader reports an unreadable config with its own clear error
            if (omni := omni_model(model_type)) is not None:
                adapter = omni.name
    if adapter not in RECORDS:
        raise ValueError(f"adapter must be 'auto' or one of {tuple(RECORDS)}, got {adapter!r}")
    return adapter
