"""Incremental detokenisation: token ids arrive a few per tick, text deltas leave, never a broken character.

Byte-level BPE splits one character over several tokens (an emoji is often 2-4), so decoding each
tick's tokens alone would emit U+FFFD halves. The detokeniser decodes a short window of earlier
tokens together with the new ones and emits only the text past the window, holding back a trailing
incomplete character until the token that completes it arrives. State is the window plus the held
tokens: bounded, whatever the session's age.

>>> tok = AutoTokenizer.from_pretrained(smollm2_dir)                 # doctest: +SKIP
>>> tok.encode("ok 🎉", add_special_tokens=False)                   # doctest: +SKIP
[2231, 15107, 232, 227]
>>> d = IncrementalDetokenizer(tok)                                  # doctest: +SKIP
>>> [d.push([t]) for t in [2231, 15107, 232, 227]]                   # doctest: +SKIP
['ok', '', '', ' 🎉']       # the emoji's byte tokens are held until it is complete
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``push(ids) -> str`` returns the text the new tokens add; ``flush()`` empties what is held.

    ``context`` earlier tokens are re-decoded with the new ones, so merges and leading spaces come
    out as in a one-shot decode. At most ``max_held`` tokens wait for an incomplete character;
    beyond that they are emitted anyway (with U+FFFD) so invalid byte runs cannot grow the state.
    """

    def __init__(self, tokenizer, context: int = 4, max_held: int = 8, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.context = context
        self.max_held = max_held
        self.skip_special_tokens = skip_special_tokens
        self._tokens: list[int] = []
        self._prefix = 0  # start of the re-decoded window
        self._read = 0    # tokens before this index have been emitted

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def push(self, token_ids: Sequence[int]) -> str:
        self._tokens.extend(int(t) for t in token_ids)
        if len(self._tokens) == self._read:
            return ""
        return self._emit(force=False)

    def flush(self) -> str:
        """Emit whatever is held (even an incomplete character) and forget the window."""
        text = self._emit(force=True) if len(self._tokens) > self._read else ""
        self._tokens, self._prefix, self._read = [], 0, 0
        return text

    @property
    def held(self) -> int:
        """Tokens decoded but not yet emitted as text."""
        return len(self._tokens) - self._read

    def _emit(self, force: bool) -> str:
        end = len(self._tokens)
        after = self._decode(self._tokens[self._prefix:end])
        if not force:
            # Emit up to the last token boundary where the text is whole; a push of several tokens can
            # complete some characters and start another.
            while end > self._read and after.endswith(REPLACEMENT):
                end -= 1
                after = self._decode(self._tokens[self._prefix:end])
            if end == self._read:
                if self.held < self.max_held:
                    return ""  # the first new character is not complete yet
                end = len(self._tokens)  # an invalid byte run: give it up rather than grow the state
                after = self._decode(self._tokens[self._prefix:end])
        before = self._decode(self._tokens[self._prefix:self._read])
        delta = after[len(before):]
        self._read = end
        self._prefix = max(self._prefix, self._read - self.context)
        # Forget what is behind the window so the state stays bounded.
        del self._tokens[:self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        return delta
