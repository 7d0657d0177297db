"""The interaction (omni) models Metronome serves: one record per model, read by everything that dispatches on one.

A record names the checkpoint ``model_type`` values it covers, where its decoder loader and its audio
adapter's factory live, and the frame budget B its adapter is built for. ``models.loader`` reads the
decoder, ``audio.registry`` the adapter and B, and the CLI the model types. References are
``"module:attribute"`` strings resolved on use: reading the table imports nothing heavy, and this layer
names the audio layer's factory without importing it (models never import audio, engine or serving).

Adding a model is one record here plus its two modules::

    def load_decoder(checkpoint: Path, config: dict, dtype, device) -> decoder   # models/omni/<name>.py
    def build_adapter(context: AdapterContext) -> InteractionAdapter           # audio/omni/<name>.py

>>> omni_model("minicpmo").name, omni_model("qwen3_omni_moe_thinker").budget_ms, omni_model("llama")
('minicpm_o', 2000.0, None)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from metronome.config import DEFAULT_BUDGET_MS


@dataclass(frozen=True)
class OmniModel:
    name: str                     # the adapter's name (``--adapter``)
    model_types: tuple[str, ...]  # config.json model_type values of its checkpoints
    decoder: str                  # "module:attr" of load_decoder(checkpoint, config, dtype, device)
    adapter: str                  # "module:attr" of the adapter factory, called with an AdapterContext
    budget_ms: float = DEFAULT_BUDGET_MS   # the frame budget B the adapter is built for


OMNI_MODELS = (
    OmniModel("qwen2_5_omni", ("qwen2_5_omni", "qwen2_5_omni_thinker"),
              "metronome.models.omni.qwen2_5_omni:load_decoder", "metronome.audio.omni.qwen2_5_omni:build_adapter"),
    OmniModel("qwen3_omni", ("qwen3_omni_moe", "qwen3_omni_moe_thinker"),
              "metronome.models.omni.qwen3_omni:load_decoder", "metronome.audio.omni.qwen3_omni:build_adapter"),
    # MiniCPM-o's streaming audio encoder works in 1 s chunks.
    OmniModel("minicpm_o", ("minicpmo",),
              "metronome.models.omni.minicpm_o:load_decoder", "metronome.audio.omni.minicpm_o:build_adapter",
              budget_ms=1000.0),
    # Moshi advances one 80 ms Mimi frame per step.
    OmniModel("moshi", ("moshi",),
              "metronome.models.omni.moshi:load_decoder", "metronome.audio.omni.moshi:build_adapter",
              budget_ms=80.0),
)

_BY_MODEL_TYPE = {model_type: model for model in OMNI_MODELS for model_type in model.model_types}


def omni_model(model_type: str | None) -> OmniModel | None:
    """The record of the omni model whose checkpoints have ``model_type``; None for any other model."""
    return _BY_MODEL_TYPE.get(model_type)


def omni_model_types() -> tuple[str, ...]:
    return tuple(_BY_MODEL_TYPE)


def resolve(ref: str) -> Any:
    """The object a ``"module:attr.attr"`` reference names (imports its module)."""
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
