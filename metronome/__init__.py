"""Metronome: serving real-time interaction models with bounded per-session state.

Public API::

    from metronome import Engine, EngineConfig, KVPolicy, StepInput

Exports resolve lazily, so the gateway (which imports ``metronome.config`` and ``metronome.serving``)
never loads torch.
"""

from importlib import import_module

_EXPORTS = {
    "EngineConfig": "metronome.config", "KVPolicy": "metronome.config",
    "Engine": "metronome.engine.engine", "EngineStats": "metronome.engine.engine",
    "SessionNotFound": "metronome.engine.engine", "SessionStats": "metronome.engine.engine", "StepTiming": "metronome.engine.engine",
    "SamplingParams": "metronome.engine.request", "StepInput": "metronome.engine.request",
    "StepOutput": "metronome.engine.request",
    "AdmissionError": "metronome.errors", "ConfigError": "metronome.errors", "MetronomeError": "metronome.errors",
    "ModelLoadError": "metronome.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'metronome' has no attribute {name!r}")
