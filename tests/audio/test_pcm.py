"""PCM16 decoding, resampling (one-shot and streaming) and level statistics."""

from __future__ import annotations

import numpy as np
import pytest

from metronome.audio.pcm import (CLIP_LEVEL, SILENCE_DBFS, Resampler, check_sample_rate, clipping_fraction,
                                 decode_pcm16, encode_pcm16, levels, resample, rms_dbfs)


def tone(freq: float, seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def dominant_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum)) * rate / len(x)


def test_decode_little_endian_full_scale():
    data = np.array([0, 1, -1, 32767, -32768, 16384], dtype="<i2").tobytes()
    x = decode_pcm16(data)
    assert x.dtype == np.float32
    assert x.tolist() == [0.0, 1 / 32768, -1 / 32768, 32767 / 32768, -1.0, 0.5]
    assert decode_pcm16(b"").shape == (0,)
    assert decode_pcm16(b"\x00\x80").tolist() == [-1.0]  # byte order: 0x8000 little-endian


def test_odd_byte_count_is_refused_clearly():
    with pytest.raises(ValueError, match="even number of bytes.*got 3"):
        decode_pcm16(b"\x00\x01\x02")


def test_encode_round_trips_and_clips():
    x = np.array([0.0, 0.5, -0.25, -1.0], np.float32)
    assert decode_pcm16(encode_pcm16(x)).tolist() == x.tolist()
    assert decode_pcm16(encode_pcm16(np.array([3.0, -3.0]))).tolist() == [32767 / 32768, -1.0]


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resample_keeps_duration_and_pitch(rate):
    x = tone(440, 1.0, rate)
    y = resample(x, rate, 16000)
    assert y.dtype == np.float32 and abs(len(y) - 16000) <= 1
    assert abs(dominant_hz(y, 16000) - 440) < 2
    assert np.array_equal(resample(x, rate, rate), x)


def test_streaming_resampler_equals_one_shot_without_drift():
    # 20 ms chunks at 44.1 kHz: 882 samples each. Resampled one by one, every chunk boundary would
    # restart the filter; the stream's output is exactly the one-shot output, delayed by the filter.
    x = tone(440, 1.0, 44100, amplitude=0.3)
    r = Resampler(44100, 16000)
    streamed = np.concatenate([r.process(x[i:i + 882]) for i in range(0, len(x), 882)])
    whole = resample(x, 44100, 16000)
    assert 15500 < len(streamed) <= len(whole)
    np.testing.assert_allclose(streamed, whole[:len(streamed)], atol=1e-5)
    assert r.process(np.zeros(0, np.float32)).shape == (0,)
    same = Resampler(16000, 16000)
    assert np.array_equal(same.process(x[:100]), x[:100])


def test_sample_rate_range():
    for ok in (8000, 16000, 48000):
        check_sample_rate(ok)
    for bad in (0, 4000, 7999, 48001, 96000):
        with pytest.raises(ValueError, match="8000-48000 Hz"):
            check_sample_rate(bad)


def test_levels():
    assert rms_dbfs(tone(1000, 0.1, 16000, amplitude=1.0)) == pytest.approx(-3.01, abs=0.02)
    assert rms_dbfs(tone(1000, 0.1, 16000, amplitude=0.1)) == pytest.approx(-23.01, abs=0.02)
    assert rms_dbfs(np.zeros(100, np.float32)) == SILENCE_DBFS
    assert rms_dbfs(np.zeros(0, np.float32)) == SILENCE_DBFS
    assert clipping_fraction(np.array([1.0, -1.0, 0.2, 0.0], np.float32)) == 0.5
    assert clipping_fraction(decode_pcm16(encode_pcm16(np.array([5.0, 0.0])))) == 0.5  # PCM16 full scale counts
    lv = levels(tone(1000, 0.5, 16000, amplitude=0.5), 16000)
    assert lv.duration_ms == 500 and lv.clipping == 0.0
    assert lv.peak_dbfs == pytest.approx(-6.02, abs=0.05) and lv.rms_dbfs == pytest.approx(-9.03, abs=0.05)


def test_decode_and_levels_match_float64_on_every_pcm16_value():
    """The one-pass decoding and copy-free levels equal a float64 computation of the same formulas, on every
    PCM16 value and on clipped and quiet speech-like chunks."""
    every = np.arange(-32768, 32768, dtype="<i2")
    assert np.array_equal(decode_pcm16(every.tobytes()), (every.astype(np.float64) / 32768).astype(np.float32))
    rng = np.random.default_rng(5)
    for gain, n in ((0.001, 320), (0.3, 32000), (3.0, 32000), (1.0, 1)):
        x = decode_pcm16(encode_pcm16(rng.standard_normal(n) * gain))   # gain 3: many samples at full scale
        x64 = x.astype(np.float64)
        lv = levels(x, 16000)
        assert lv.rms_dbfs == pytest.approx(20 * np.log10(np.sqrt(np.mean(x64 ** 2))), abs=1e-3)
        assert lv.peak_dbfs == pytest.approx(20 * np.log10(np.max(np.abs(x64))), abs=1e-4)
        assert lv.clipping == np.count_nonzero(np.abs(x64) >= CLIP_LEVEL) / n
    assert levels(np.full(8, -1.0, np.float32), 16000).clipping == 1.0   # negative full scale alone
    y = decode_pcm16(encode_pcm16(rng.standard_normal(64) * 0.3))
    assert rms_dbfs(y.reshape(8, 8)) == rms_dbfs(y)   # any shape, as before: the level of all its samples
