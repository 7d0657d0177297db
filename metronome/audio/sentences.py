"""Cut a streamed answer into pieces to speak: sentences, or clauses when a sentence runs long.

Text arrives as deltas (a few tokens per tick). A piece is handed on as soon as it is known to be
complete, so speech can start while the model is still writing:

* a sentence ends at ``.``, ``!``, ``?`` or ``…`` (with any closing quotes or brackets) followed by
  whitespace, or at the end of the text seen so far when the word before it is neither a number
  (``3.`` may go on as ``3.5``) nor an abbreviation or initial (``Dr.``, ``e.g.``, ``J.``); a line
  break ends a piece too (list items, paragraphs);
* the first piece of an answer may end early, so the first audio comes sooner: at a clause mark (``,``
  ``;`` ``:`` or a dash) once it holds ``first_clause_chars`` characters, or after its first
  ``first_words`` words (a whitespace after the last one shows it is whole), whichever comes first;
* a piece with no sentence end is cut at ``max_chars``: at its last clause mark, else its last space.

>>> cutter = SentenceCutter(CutPolicy(first_clause_chars=0))   # no early first piece: whole sentences
>>> cutter.push("Dr. Smith lives on Elm St. and")
[]
>>> cutter.push(" earns 3.5 million. He is")
['Dr. Smith lives on Elm St. and earns 3.5 million.']
>>> cutter.push(" happy!")
['He is happy!']
>>> cutter.flush()
[]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Lower-cased words that end with a full stop without ending a sentence (titles, Latin, units, months).
# Words that are also common at a sentence's end ("no", "sun", "fig") are left out: merging two
# sentences only delays their audio, cutting one in two breaks its intonation.
ABBREVIATIONS = frozenset("""
    mr mrs ms dr prof sr jr st mt ft vs etc e.g i.e cf approx dept est vol al inc ltd corp
    jan feb mar apr jun jul aug sep sept oct nov dec a.m p.m u.s u.k
""".split())

_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*")
_CLAUSE_MARK = re.compile(r"[,;:—–](?=\s)|\s-\s")
_WORD_BEFORE = re.compile(r"(\S+)$")


@dataclass(frozen=True)
class CutPolicy:
    """How long a piece may grow. ``max_chars``: a piece with no sentence end is cut near this length.
    ``first_clause_chars``: the answer's first piece ends at the first clause mark after this many
    characters (0: no early cut at all, the first piece is cut as the others). ``first_words``: with
    early cuts on, the first piece ends after this many words at the latest (0: only at a clause mark).
    A few words are ~1 s of speech: synthesised in a fraction of the time a whole clause takes, and the
    answer's later words are decoded and synthesised while they play.

    >>> CutPolicy(max_chars=10, first_clause_chars=20)
    Traceback (most recent call last):
    ...
    ValueError: first_clause_chars (20) must be at most max_chars (10)
    """

    max_chars: int = 200
    first_clause_chars: int = 24
    first_words: int = 3

    def __post_init__(self) -> None:
        if self.max_chars < 1 or self.first_clause_chars < 0 or self.first_words < 0:
            raise ValueError("max_chars must be >= 1, first_clause_chars and first_words >= 0")
        if self.first_clause_chars > self.max_chars:
            raise ValueError(f"first_clause_chars ({self.first_clause_chars}) must be at most max_chars ({self.max_chars})")


def speakable(piece: str) -> bool:
    """Whether ``piece`` holds anything to say (a letter or digit): stray punctuation is dropped.

    >>> speakable(' "!" '), speakable("42")
    (False, True)
    """
    return any(c.isalnum() for c in piece)


class SentenceCutter:
    """Incremental cutter for one answer: ``push`` deltas, get the complete pieces; ``flush`` at the end."""

    def __init__(self, policy: CutPolicy | None = None) -> None:
        self.policy = policy or CutPolicy()
        self._buffer = ""
        self._pieces = 0

    @property
    def pending(self) -> str:
        """Text received but not yet handed on."""
        return self._buffer

    def push(self, delta: str) -> list[str]:
        """Add ``delta``; return the pieces it completed, in order (stripped, each speakable)."""
        self._buffer += delta
        out: list[str] = []
        while True:
            cut = self._next_cut()
            if cut is None:
                break
            self._emit(self._buffer[:cut], out)
            self._buffer = self._buffer[cut:]
        return out

    def flush(self) -> list[str]:
        """The answer is complete: whatever is left is the last piece."""
        out: list[str] = []
        self._emit(self._buffer, out)
        self._buffer = ""
        return out

    def _emit(self, piece: str, out: list[str]) -> None:
        piece = " ".join(piece.split())
        if speakable(piece):
            out.append(piece)
            self._pieces += 1

    def _next_cut(self) -> int | None:
        """End index of the first complete piece in the buffer, or None while none is complete."""
        text, policy = self._buffer, self.policy
        newline = text.find("\n")
        ends = [self._sentence_end(text), newline + 1 if newline >= 0 else None]
        if self._pieces == 0 and policy.first_clause_chars:
            clause = _CLAUSE_MARK.search(text, policy.first_clause_chars - 1)
            ends.append(clause.end() if clause else None)
            words = re.match(r"\s*(?:\S+\s+){%d}" % policy.first_words, text) if policy.first_words else None
            ends.append(words.end() if words else None)
        found = [i for i in ends if i is not None]
        if found and min(found) <= policy.max_chars:
            return min(found)
        if len(text) >= policy.max_chars:
            return self._long_cut(text[:policy.max_chars])
        return None

    @staticmethod
    def _sentence_end(text: str) -> int | None:
        for m in _SENTENCE_END.finditer(text):
            end = m.end()
            at_end = end == len(text)
            if not at_end and not text[end].isspace():
                continue                      # "3.5", "e.g.," or "example.com": not an end
            if m.group()[0] == "." and not _full_stop_ends(text[:m.start()], at_end):
                continue
            return end
        return None

    @staticmethod
    def _long_cut(window: str) -> int:
        marks = list(_CLAUSE_MARK.finditer(window))
        if marks:
            return marks[-1].end()
        space = window.rstrip().rfind(" ")
        return space + 1 if space > 0 else len(window)


def _full_stop_ends(before: str, at_end: bool) -> bool:
    """Whether a full stop after ``before`` ends a sentence (``at_end``: nothing follows it yet)."""
    m = _WORD_BEFORE.search(before)
    if m is None:
        return True
    word = m.group(1).lstrip("\"'“‘([").lower()
    if word.isdigit() and not before[:m.start()].rpartition("\n")[2].strip():
        return False                          # "1." numbering a list item
    if word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
        return False                          # "Dr." or the initial in "J. Smith"
    if at_end and word[-1:].isdigit():
        return False                          # "costs 3." may go on as "3.5"
    return True
