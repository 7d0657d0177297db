"""Exceptions raised to callers of the public API."""


class MetronomeError(Exception):
    """Base class of every error Metronome raises on purpose."""


class ConfigError(MetronomeError, ValueError):
    """A configuration value is invalid; the message names the field and the accepted range."""


class AdmissionError(MetronomeError):
    """A new session's KV reservation does not fit in the pool; nothing was allocated."""


class ModelLoadError(MetronomeError):
    """A checkpoint could not be found or is of an unsupported architecture."""
