"""Speech for the load generator (espeak-ng, offline) and the public-domain text; the CLI for recycling, ablation and quality."""

import argparse
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from metronome.experiments import speech
from metronome.experiments.loadgen import append_messages, make_audio
from metronome.audio.pcm import decode_pcm16

needs_espeak = pytest.mark.skipif(not speech.have_espeak(), reason="espeak-ng is not installed")


def test_the_text_is_long_public_domain_prose():
    paras = speech.manual_paragraphs()
    assert len(paras) > 200 and sum(len(p) for p in paras) > 60000
    assert any("placed in the public domain" in p for p in paras)
    assert len(speech.long_text(5000)) >= 5000 > len(speech.long_text(5000)) - len(paras[0]) - 2000


@pytest.mark.skipif(not Path(speech.MANUAL_SOURCE).is_file(), reason="nettle-dev's HTML manual is not installed")
def test_the_vendored_text_is_what_extract_manual_makes(tmp_path):
    n = speech.extract_manual(dst=tmp_path / "manual.txt")
    assert (tmp_path / "manual.txt").read_text() == speech.MANUAL.read_text() and n == len(speech.manual_paragraphs())


@needs_espeak
def test_speech_stream_is_speech_with_pauses_and_deterministic():
    a = speech.speech_stream(6.0, seed=3)
    assert a.dtype == np.float32 and a.size >= 6.0 * speech.RATE
    frames = np.abs(a[: a.size // 320 * 320].reshape(-1, 320)).max(axis=1)     # 20 ms frames
    assert (frames > 0.05).mean() > 0.4 and (frames == 0).any()                  # mostly voiced, with pauses
    np.testing.assert_array_equal(a, speech.speech_stream(6.0, seed=3))


@needs_espeak
def test_load_generator_speech_audio_is_pcm16_in_20ms_chunks(tmp_path, monkeypatch):
    monkeypatch.setenv(speech.CACHE_ENV, str(tmp_path))
    pcm = make_audio("speech", seed=1)
    assert len(list(tmp_path.glob("speech-60s-seed1-*.npy"))) == 1
    assert len(pcm) >= 2 * 16000 * 59
    samples = decode_pcm16(pcm)
    assert 0.02 < float(np.sqrt(np.mean(samples ** 2))) < 0.5
    msgs = append_messages(pcm[: 2 * 16000])                 # 1 s -> 50 chunks of 640 bytes
    assert len(msgs) == 50 and len(json.loads(msgs[0])["audio"]) == 856   # base64 of 640 bytes
    assert len(make_audio("noise", seed=1)) == 2 * 16000 * 8
    with pytest.raises(ValueError):
        make_audio("music", seed=1)


def _parser():
    from metronome.cli import bench

    p = argparse.ArgumentParser(prog="metronome")
    bench.add_parser(p.add_subparsers(dest="command", required=True))
    return p


def test_metronome_bench_reanalyses_recycling_ablation_quality(tmp_path):
    from tests.experiments.test_ablation import _point
    from tests.experiments.test_recycling import _synthetic_point

    from metronome.experiments.ablation import CPU as ABL
    from metronome.experiments.recycling import CPU as REC

    raws = {"recycling": {"preset": REC.to_dict(), "machine": {}, "points": [_synthetic_point("recycling")]},
            "ablation": {"preset": ABL.to_dict(), "machine": {}, "kv_bytes_per_token": 512,
                         "points": [_point(4, 32, 20.0, 4)]}}
    for name, raw in raws.items():
        path = tmp_path / f"{name}.json.gz"
        path.write_bytes(gzip.compress(json.dumps(raw).encode()))
        args = _parser().parse_args(["bench", name, "--preset", "cpu", "--from", str(path), "--out",
                                     str(tmp_path / name)])
        assert args.experiment == name and args.run(args) == 0
        assert (tmp_path / name / "summary.md").read_text().startswith(f"# {name}")
    args = _parser().parse_args(["bench", "quality", "--preset", "gpu", "--parts", "perplexity", "--text-tokens", "64",
                                 "--window", "256"])
    assert args.parts == ("perplexity",) and args.text_tokens == 64 and args.window == 256
    assert _parser().parse_args(["bench", "admission", "--profiles", "ramp,step"]).profiles == ("ramp", "step")


@needs_espeak
def test_speech_cache_serves_machines_without_espeak(tmp_path, monkeypatch):
    a = speech.cached_stream(4.0, seed=2, directory=tmp_path)
    files = list(tmp_path.glob("speech-4s-seed2-*.npy"))
    assert len(files) == 1
    monkeypatch.setattr(speech, "have_espeak", lambda: False)
    monkeypatch.setattr(speech, "espeak", lambda *a, **k: pytest.fail("espeak-ng must not run on a cache hit"))
    np.testing.assert_array_equal(speech.cached_stream(4.0, seed=2, directory=tmp_path), a)
    with pytest.raises(RuntimeError, match="espeak-ng"):
        speech.cached_stream(4.0, seed=3, directory=tmp_path)
    monkeypatch.setenv(speech.CACHE_ENV, str(tmp_path))
    assert speech.main(["--seeds", "2", "--seconds", "4"]) == 0        # already cached: no synthesis needed
