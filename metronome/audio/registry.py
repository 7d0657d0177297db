"""The interaction adapters a worker can run, by name (kept free of heavy imports for the CLI).

``resolve_adapter`` picks the adapter and frame budget a checkpoint needs when the user asks for
``auto``: an omni model's own audio path at the paper's budget, else the speech cascade.

>>> resolve_adapter("smollm2-135m", "auto", None)
('cascade', 2000.0)
>>> resolve_adapter("smollm2-135m", "energy", 500.0)
('energy', 500.0)
"""

from __future__ import annotations

import json
from pathlib import Path

# name -> "module:callable"; the callable takes an AdapterContext and returns the adapter. Imported
# only when chosen (the cascade loads Whisper, the omni adapters their audio encoders).
ADAPTERS = {
    "cascade": "metronome.audio.cascade:CascadeAdapter.from_context",
    "energy": "metronome.audio.energy_tokens:EnergyTokenAdapter.from_context",
    "qwen2_5_omni": "metronome.audio.omni.qwen2_5_omni:build_adapter",
    "qwen3_omni": "metronome.audio.omni.qwen3_omni:build_adapter",
    "minicpm_o": "metronome.audio.omni.minicpm_o:build_adapter",
    "moshi": "metronome.audio.omni.moshi:build_adapter",
}

# config.json model_type -> the adapter of that model's own audio path.
MODEL_TYPE_ADAPTERS = {
    "qwen2_5_omni": "qwen2_5_omni", "qwen2_5_omni_thinker": "qwen2_5_omni",
    "qwen3_omni_moe": "qwen3_omni", "qwen3_omni_moe_thinker": "qwen3_omni",
    "minicpmo": "minicpm_o",
    "moshi": "moshi",
}

# The frame budget B each adapter is built for (the paper's per-model periods); others: 2 s.
DEFAULT_BUDGET_MS = {"moshi": 80.0, "minicpm_o": 1000.0}


def resolve_adapter(model: str, adapter: str, budget_ms: float | None) -> tuple[str, float]:
    """``(adapter, budget_ms)`` for ``model``: ``adapter="auto"`` reads the checkpoint's model_type;
    ``budget_ms=None`` takes the adapter's default."""
    if adapter == "auto":
        adapter = "cascade"
        config = Path(model).expanduser() / "config.json"
        if config.is_file():
            try:
                model_type = json.loads(config.read_text()).get("model_type")
            except (OSError, ValueError):
                model_type = None   # the loader reports an unreadable config with its own clear error
            adapter = MODEL_TYPE_ADAPTERS.get(model_type, "cascade")
    if adapter not in ADAPTERS:
        raise ValueError(f"adapter must be 'auto' or one of {tuple(ADAPTERS)}, got {adapter!r}")
    return adapter, float(budget_ms) if budget_ms is not None else DEFAULT_BUDGET_MS.get(adapter, 2000.0)
