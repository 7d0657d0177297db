"""Real speech for the experiments, synthesised offline with ``espeak-ng`` (nothing is downloaded).

Two kinds of material, as the paper's load: short **questions with known answers** (the probe of
the quality experiment scores whether the reply contains the expected word) and **long read-aloud text**.
The read-aloud text is the Nettle cryptography library's manual (Niels Möller et al.), which says of
itself "This manual is placed in the public domain"; its prose paragraphs were extracted from
``/usr/share/doc/nettle-dev/nettle.html`` (Debian package ``nettle-dev``) into ``data/nettle_manual.txt``
(``extract_manual`` rebuilds it), so machines without that package (the GPU box) read the same words.
The quality experiment's perplexity runs over the same text.

``speech_stream`` lays read-aloud paragraphs and questions end to end with short pauses, seeded, as
float32 16 kHz; ``loadgen`` streams it (looped) in 20 ms chunks. espeak-ng is deterministic, so a
seed gives the same audio on every run. ``cached_stream`` keeps each stream as PCM16 ``.npy`` in
``$METRONOME_SPEECH_CACHE`` (default ``~/.cache/metronome/speech``): a machine without espeak-ng (the
GPU image has none) runs the speech presets from a cache made elsewhere and carried there::

    python -m metronome.experiments.speech --seeds 0-19 --cache-dir results/speech-cache   # 60-s loops, ~1.9 MB each
    METRONOME_SPEECH_CACHE=results/speech-cache metronome bench cliff --preset gpu
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from metronome.audio.pcm import decode_pcm16, resample

RATE = 16000
DATA = Path(__file__).resolve().parent / "data"
MANUAL = DATA / "nettle_manual.txt"
MANUAL_SOURCE = "/usr/share/doc/nettle-dev/nettle.html"


@dataclass(frozen=True)
class Question:
    text: str
    answers: tuple[str, ...]      # the reply is correct if it contains any of these words (case-insensitive)


QUESTIONS = (
    Question("What is the capital of France?", ("paris",)),
    Question("What is the capital of Germany?", ("berlin",)),
    Question("What is the capital of Japan?", ("tokyo",)),
    Question("What is the capital of Italy?", ("rome",)),
    Question("What is the capital of Spain?", ("madrid",)),
    Question("What is the capital of England?", ("london",)),
    Question("What is the capital of Russia?", ("moscow",)),
    Question("What is the capital of Egypt?", ("cairo",)),
    Question("What color is the sky on a clear day?", ("blue",)),
    Question("How many days are there in a week?", ("seven", "7")),
    Question("What is the largest ocean on Earth?", ("pacific",)),
    Question("Which planet do we live on?", ("earth",)),
)


def answered(reply: str, q: Question) -> bool:
    """Whether ``reply`` contains one of the expected words (whole word, case-insensitive).

    >>> answered("The capital of France is Paris.", QUESTIONS[0]), answered("Parisian food", QUESTIONS[0])
    (True, False)
    """
    words = set(re.findall(r"[a-z0-9]+", reply.lower()))
    return any(a in words for a in q.answers)


def have_espeak() -> bool:
    return shutil.which("espeak-ng") is not None


def espeak(text: str, rate: int = RATE, *, voice: str = "en-us", words_per_minute: int = 160) -> np.ndarray:
    """``text`` spoken by espeak-ng, float32 mono at ``rate`` Hz; RuntimeError if espeak-ng is missing."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("speech audio needs espeak-ng (apt-get install espeak-ng); or use audio='noise'")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run([exe, "-v", voice, "-s", str(words_per_minute), "-w", str(path), text],
                       check=True, capture_output=True, timeout=120)
        with wave.open(str(path), "rb") as w:
            src_rate = w.getframerate()
            samples = decode_pcm16(w.readframes(w.getnframes()))
    return resample(samples, src_rate, rate)


def manual_paragraphs() -> list[str]:
    """The read-aloud / perplexity text: prose paragraphs of the (public-domain) Nettle manual."""
    return [p for p in MANUAL.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def long_text(min_chars: int = 0) -> str:
    """The manual's paragraphs joined with blank lines, cut after the paragraph that passes ``min_chars``."""
    out, n = [], 0
    for p in manual_paragraphs():
        out.append(p)
        n += len(p) + 2
        if min_chars and n >= min_chars:
            break
    return "\n\n".join(out)


def silence(seconds: float, rate: int = RATE) -> np.ndarray:
    return np.zeros(int(round(seconds * rate)), np.float32)


def speech_stream(seconds: float, seed: int, *, question_every: int = 3, rate: int = RATE) -> np.ndarray:
    """At least ``seconds`` of speech: seeded read-aloud paragraphs (their first two sentences), a question
    after every ``question_every`` of them, 0.3-1.0 s pauses between utterances; float32 at ``rate``."""
    rng = np.random.default_rng(seed)
    paras = manual_paragraphs()
    parts, total, k = [], 0.0, 0
    while total < seconds:
        if question_every and k % (question_every + 1) == question_every:
            text = QUESTIONS[int(rng.integers(len(QUESTIONS)))].text
        else:
            sentences = re.split(r"(?<=[.!?])\s+", paras[int(rng.integers(len(paras)))])
            text = " ".join(sentences[:2])
        audio = espeak(text, rate) * 0.8
        pause = silence(float(rng.uniform(0.3, 1.0)), rate)
        parts += [audio, pause]
        total += (audio.size + pause.size) / rate
        k += 1
    return np.concatenate(parts)


CACHE_ENV = "METRONOME_SPEECH_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "metronome" / "speech")


def cached_stream(seconds: float, seed: int, *, question_every: int = 3, directory: Path | None = None) -> np.ndarray:
    """``speech_stream(seconds, seed)``, synthesised once and kept as PCM16 ``.npy`` (keyed by the arguments,
    the text and the question list); float32 at 16 kHz."""
    from metronome.audio.pcm import decode_pcm16, encode_pcm16

    text = MANUAL.read_bytes() + repr(QUESTIONS).encode()
    key = hashlib.sha1(f"{seconds}|{seed}|{question_every}|".encode() + text).hexdigest()[:16]
    path = Path(directory or cache_dir()) / f"speech-{seconds:g}s-seed{seed}-{key}.npy"
    if path.is_file():
        return decode_pcm16(np.load(path).tobytes())
    if not have_espeak():
        raise RuntimeError(f"speech audio needs espeak-ng (apt-get install espeak-ng) or a cached stream at {path} "
                           f"(make one with `python -m metronome.experiments.speech` and set ${CACHE_ENV}); or use audio='noise'")
    audio = speech_stream(seconds, seed, question_every=question_every)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, np.frombuffer(encode_pcm16(audio), "<i2"))
    tmp.replace(path)
    return decode_pcm16(encode_pcm16(audio))


def extract_manual(src: str = MANUAL_SOURCE, dst: Path = MANUAL) -> int:
    """Rebuild ``data/nettle_manual.txt`` from the installed HTML manual: the ``<p>`` prose of at least
    12 words, code (``pre``, ``code``, ``var``, tables) dropped and paragraphs with holes left by it skipped.
    Returns the number of paragraphs written."""
    import html.parser

    class _Paragraphs(html.parser.HTMLParser):
        SKIP = ("pre", "table", "code", "var", "samp", "kbd")

        def __init__(self) -> None:
            super().__init__()
            self.skip, self.inside, self.buf, self.paras = 0, False, [], []

        def handle_starttag(self, tag, attrs):
            self.skip += tag in self.SKIP
            if tag == "p":
                self.inside, self.buf = True, []

        def handle_endtag(self, tag):
            self.skip -= tag in self.SKIP
            if tag == "p" and self.inside:
                self.inside = False
                text = " ".join("".join(self.buf).split())
                if text:
                    self.paras.append(text)

        def handle_data(self, data):
            if self.inside and self.skip == 0:
                self.buf.append(data)

    parser = _Paragraphs()
    parser.feed(Path(src).read_text(encoding="utf-8"))
    good = [t for t in parser.paras
            if len(t.split()) >= 12 and not re.search(r"\s[,.;:)]", t) and "()" not in t and "[" not in t]
    Path(dst).write_text("\n\n".join(good) + "\n", encoding="utf-8")
    return len(good)


def main(argv=None) -> int:
    """Pre-synthesise the load generator's speech loops into a cache directory (to carry to another machine)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m metronome.experiments.speech", description=main.__doc__)
    p.add_argument("--seeds", default="0-19", help="seeds, e.g. 0-19 or 0,1,2 (the runs' indices)")
    p.add_argument("--seconds", type=float, default=60.0, help="loop length (loadgen.SPEECH_LOOP_S)")
    p.add_argument("--cache-dir", type=Path, default=None, help=f"default ${CACHE_ENV} or ~/.cache/metronome/speech")
    args = p.parse_args(argv)
    seeds = []
    for part in args.seeds.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    for seed in seeds:
        cached_stream(args.seconds, seed, directory=args.cache_dir)
    print(f"{len(seeds)} streams in {args.cache_dir or cache_dir()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
