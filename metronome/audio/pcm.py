"""PCM16 decoding, resampling (soxr) and level statistics.

Samples are float32 mono in [-1, 1]: PCM16 value ``v`` becomes ``v / 32768``.

>>> decode_pcm16(b"\\x00\\x40\\x00\\xc0").tolist()       # 16384, -16384 little-endian
[0.5, -0.5]
>>> len(resample(np.zeros(480, np.float32), 48000, 16000))  # 10 ms at 48 kHz -> 10 ms at 16 kHz
160
>>> round(rms_dbfs(np.full(160, 0.5, np.float32)), 2)     # half scale: 20*log10(0.5)
-6.02
>>> rms_dbfs(np.zeros(160, np.float32)) == SILENCE_DBFS   # digital silence has a finite floor
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import soxr

# The rates the front end accepts: telephone (8 kHz) up to studio (48 kHz).
MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000

# Finite floor for silence so that levels stay JSON-serialisable and bucketable; one PCM16 LSB is -90 dBFS.
SILENCE_DBFS = -120.0

# A sample at or above this magnitude is counted as clipped (PCM16 full scale is 32767/32768 = 0.99997).
CLIP_LEVEL = 0.999


def decode_pcm16(data: bytes) -> np.ndarray:
    """Little-endian signed 16-bit mono PCM → float32 samples in [-1, 1).

    Raises ``ValueError`` when the byte count is odd (a truncated sample).
    """
    if len(data) % 2:
        raise ValueError(f"PCM16 audio must have an even number of bytes (2 per sample), got {len(data)}")
    samples = np.frombuffer(data, dtype="<i2").astype(np.float32)
    samples *= np.float32(1.0 / 32768.0)   # in place; a power of two, so exactly a division by 32768
    return samples


def encode_pcm16(samples: np.ndarray) -> bytes:
    """float samples → little-endian PCM16 (clipped to full scale). The inverse of ``decode_pcm16``.

    >>> decode_pcm16(encode_pcm16(np.array([0.25, -1.0, 2.0]))).tolist()
    [0.25, -1.0, 0.999969482421875]
    """
    scaled = np.clip(np.round(np.asarray(samples, dtype=np.float64) * 32768.0), -32768, 32767)
    return scaled.astype("<i2").tobytes()


def check_sample_rate(rate: int) -> None:
    """Raise ``ValueError`` unless ``rate`` is a sample rate the front end accepts."""
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise ValueError(f"sample rate {rate} Hz is not supported; send {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz")


def resample(samples: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    """Resample one complete clip (no state carried between calls). float32 mono in and out."""
    samples = np.asarray(samples, dtype=np.float32)
    if in_rate == out_rate or samples.size == 0:
        return samples.copy()
    return soxr.resample(samples, in_rate, out_rate).astype(np.float32, copy=False)


class Resampler:
    """Streaming resampler for one session: chunks in, chunks out, no clicks or drift at chunk boundaries.

    Resampling each tick's chunk on its own would restart the filter every tick (edge artefacts) and
    round the length of every chunk (drift: 20 ms at 44.1 kHz is 882 samples, 320 at 16 kHz, but
    other chunk sizes do not divide evenly). The stream keeps the filter's tail between calls; output
    lags input by the filter delay (a few ms), so a chunk's output can be shorter than its share.

    >>> r = Resampler(48000, 16000)
    >>> total = sum(len(r.process(np.zeros(960, np.float32))) for _ in range(50))  # 1 s in
    >>> 15600 < total <= 16000
    True
    """

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32")

    def process(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32)
        if self._stream is None:   # same rate: the samples themselves (a copy of 2 s per session cost a tick)
            return samples
        if samples.size == 0:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(samples)


def rms_dbfs(samples: np.ndarray) -> float:
    """Root-mean-square level in dB relative to full scale (a full-scale square wave is 0 dBFS).

    Empty or all-zero input gives ``SILENCE_DBFS``.
    """
    samples = np.asarray(samples, dtype=np.float32)
    if samples.size == 0:
        return SILENCE_DBFS
    rms = math.sqrt(float(np.vdot(samples, samples)) / samples.size)   # one pass, no squared copy, any shape
    if rms <= 0.0:
        return SILENCE_DBFS
    return max(SILENCE_DBFS, 20.0 * float(np.log10(rms)))


def clipping_fraction(samples: np.ndarray, level: float = CLIP_LEVEL) -> float:
    """Fraction of samples whose magnitude reaches ``level`` (0.0 for empty input).

    >>> clipping_fraction(np.array([0.0, 1.0, -1.0, 0.5], np.float32))
    0.5
    """
    samples = np.asarray(samples, dtype=np.float32)
    if samples.size == 0 or peak_magnitude(samples) < level:   # the usual case: one pass, no copies
        return 0.0
    return _share_at_or_above(samples, level)


def _share_at_or_above(samples: np.ndarray, level: float) -> float:
    return float(np.count_nonzero(np.abs(samples) >= level)) / samples.size


def peak_magnitude(samples: np.ndarray) -> float:
    """max |sample| of non-empty ``samples``, without an ``abs`` copy."""
    return max(float(samples.max()), -float(samples.min()))


@dataclass(frozen=True)
class Levels:
    rms_dbfs: float
    peak_dbfs: float
    clipping: float      # fraction of samples at full scale
    duration_ms: float


def levels(samples: np.ndarray, sample_rate: int) -> Levels:
    """Level statistics of one chunk (for metrics, VAD gates and the energy adapter).

    >>> lv = levels(np.array([0.5, -0.5, 1.0, 0.0], np.float32), 16000)
    >>> round(lv.peak_dbfs, 1), lv.clipping, lv.duration_ms
    (0.0, 0.25, 0.25)
    """
    samples = np.asarray(samples, dtype=np.float32)
    peak = peak_magnitude(samples) if samples.size else 0.0
    peak_db = max(SILENCE_DBFS, 20.0 * math.log10(peak)) if peak > 0 else SILENCE_DBFS
    clipping = _share_at_or_above(samples, CLIP_LEVEL) if peak >= CLIP_LEVEL else 0.0
    return Levels(rms_dbfs(samples), peak_db, clipping, samples.size * 1000.0 / sample_rate)
