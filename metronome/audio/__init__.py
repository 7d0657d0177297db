"""Audio front end: PCM decoding and resampling, and the adapters that turn a tick's audio into model input.

Layering: ``audio`` imports ``config``/``errors``, third-party libraries, and from ``models`` only what
loads a checkpoint's pieces (``models.loader.fill_weights``, the omni models' config readers) for the
omni adapters' audio encoders; it never imports ``serving`` (the worker imports it) or ``engine``.

>>> from metronome.audio import decode_pcm16
>>> decode_pcm16(b"\\x00\\x40").tolist()
[0.5]
"""

from metronome.audio.adapter import InteractionAdapter, PreparedInput, TickAudio
from metronome.audio.pcm import Resampler, clipping_fraction, decode_pcm16, levels, resample, rms_dbfs

__all__ = [
    "InteractionAdapter", "PreparedInput", "Resampler", "TickAudio", "clipping_fraction", "decode_pcm16", "levels",
    "resample", "rms_dbfs",
]
