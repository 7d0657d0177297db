"""Metronome: serving real-time interaction models with bounded per-session state.

Public API::

    from metronome import Engine, EngineConfig, KVPolicy, StepInput
"""

from metronome.config import EngineConfig, KVPolicy
from metronome.engine.engine import Engine, EngineStats, SessionNotFound, StepTiming
from metronome.engine.request import SamplingParams, StepInput, StepOutput
from metronome.errors import AdmissionError, ConfigError, MetronomeError, ModelLoadError

__all__ = [
    "AdmissionError", "ConfigError", "Engine", "EngineConfig", "EngineStats", "KVPolicy", "MetronomeError",
    "ModelLoadError", "SamplingParams", "SessionNotFound", "StepInput", "StepOutput", "StepTiming",
]
