"""The ``espeak-ng`` program (Debian package ``espeak-ng``), always run as a separate process.

espeak-ng is GPL; calling the program keeps its code out of this Apache-2.0 process. It serves twice:
as the phonemizer of a neural voice (``phonemize``: IPA with clause punctuation, the form Piper
voices were trained on) and as the fallback voice itself (``speak``: a formant synthesiser, always
available, robotic but fast). The text goes on stdin, never on the command line, so a piece that
starts with ``-`` is read as text and not as an option.

>>> phonemize("Hello, world!")                    # doctest: +SKIP
'həlˈoʊ, wˈɜːld!'
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import wave

import numpy as np

from metronome.audio.pcm import decode_pcm16

PROGRAM = "espeak-ng"
DEFAULT_VOICE = "en-us"
TIMEOUT_S = 30.0

# Where espeak-ng ends a clause: a punctuation mark followed by a space or the end (not "3.5" or
# "1,000"), and the em dash. The mark becomes the clause's terminator, as Piper's phonemizer writes it.
_CLAUSE_END = re.compile(r"([.,;:!?…]+|—)[\"'”’)\]]*(?=\s|$)")
# espeak-ng marks words it reads in another language's rules with "(fr)" ... "(en)".
_LANGUAGE_SWITCH = re.compile(r"\([^)]*\)")
_SENTENCE_TERMINATORS = (".", "!", "?")


def espeak_program() -> str:
    """Path of the ``espeak-ng`` program; ``RuntimeError`` naming the package to install when absent."""
    path = shutil.which(PROGRAM)
    if path is None:
        raise RuntimeError("speech output needs the espeak-ng program (Debian: apt-get install espeak-ng; "
                           "`make install` installs it)")
    return path


def _run(args: list[str], text: str, program: str | None) -> bytes:
    exe = program or espeak_program()
    try:
        done = subprocess.run([exe, *args], input=text.encode("utf-8"), capture_output=True, check=True,
                              timeout=TIMEOUT_S)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{PROGRAM} failed ({e.returncode}): {e.stderr.decode(errors='replace').strip()}") from e
    return done.stdout


def ipa_clauses(text: str, voice: str = DEFAULT_VOICE, program: str | None = None) -> list[str]:
    """espeak-ng's IPA for ``text``, one string per clause (it drops the punctuation)."""
    out = _run(["-q", "--ipa", "-v", voice], text, program).decode("utf-8")
    clauses = (" ".join(_LANGUAGE_SWITCH.sub("", line).split()) for line in out.splitlines())
    return [c for c in clauses if c]


def terminator(mark: str) -> str:
    """The one punctuation phoneme a clause mark stands for.

    >>> [terminator(m) for m in ("?!", "...", "…", "—", ";")]
    ['?', '.', '.', ';', ';']
    """
    for t in ("?", "!"):
        if t in mark:
            return t
    return {"…": ".", "—": ";"}.get(mark[0], mark[0])


def phonemize(text: str, voice: str = DEFAULT_VOICE, program: str | None = None) -> str:
    """IPA phonemes of ``text`` with each clause's punctuation kept (``"həlˈoʊ, wˈɜːld!"``).

    The program prints one line per clause without its punctuation; the marks found in the text put
    it back when they line up one to one with the lines. When espeak-ng ends a clause where the text
    shows no mark ("Dr." expanded to "doctor") or none where it does ("p.m."), inner clauses get a
    comma's pause and the last one the text's final mark.
    """
    clauses = ipa_clauses(text, voice, program)
    if not clauses:
        return ""
    text = text.rstrip()
    found = list(_CLAUSE_END.finditer(text))
    marks = [terminator(m.group(1)) for m in found]
    if not (found and found[-1].end() == len(text)):
        marks.append("")                  # the text stops without a mark: so does its last clause
    if len(marks) != len(clauses):
        marks = [","] * (len(clauses) - 1) + marks[-1:]
    return " ".join(clause + mark for clause, mark in zip(clauses, marks))


def speak(text: str, voice: str = DEFAULT_VOICE, words_per_minute: int = 165,
          program: str | None = None) -> tuple[np.ndarray, int]:
    """``text`` spoken by espeak-ng's own synthesiser: (float32 mono samples, sample rate)."""
    data = _run(["-v", voice, "-s", str(words_per_minute), "--stdout"], text, program)
    with wave.open(io.BytesIO(data), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise RuntimeError(f"{PROGRAM} wrote {w.getnchannels()}-channel {8 * w.getsampwidth()}-bit audio; "
                               "expected 16-bit mono")
        rate = w.getframerate()
        # Writing to a pipe, espeak-ng cannot seek back to fill in the length: read every frame there is.
        frames = w.readframes(max(w.getnframes(), len(data) // 2))
    return decode_pcm16(frames[: len(frames) // 2 * 2]), rate
