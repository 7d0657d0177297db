"""A session's typed input counted in the model's tokens before it reaches the engine thread.

Why: the adapter tokenizes a tick's text and a session's instructions on the engine thread, which every
session's tick waits on; 1 MB of text costs seconds there before the ``max_input_tokens`` check refuses
it. Here the text is counted on a thread of its own with the tokenizer's batch encoder (the Rust
tokenizers release the GIL in ``encode_batch``, so the engine thread runs on meanwhile), while a
StreamStep's messages arrive; input over the limit is refused (``input_too_large``) without the engine
thread seeing it. What passes is at most ``max_input_tokens`` tokens, which the adapter may tokenize.
A tick's pieces are counted apart and summed: a boundary can merge a token or two, and the chat framing
the adapter adds around the text is larger than that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

INPUT_TOO_LARGE = "input_too_large"


def batch_counter(tokenizer) -> Callable[[list[str]], list[int]] | None:
    """Token counts for a list of texts (no special tokens); None when the model has no tokenizer."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:   # a fast (Rust) tokenizer: encode_batch runs without the GIL
        return lambda texts: [len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]
    return lambda texts: [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


class InputBudget:
    """Counts text in tokens on its own thread; ``charge`` a tick's pieces, then ``refusals`` for the tick."""

    def __init__(self, tokenizer, max_input_tokens: int, max_instruction_tokens: int) -> None:
        self.max_input_tokens = max_input_tokens
        self.max_instruction_tokens = max_instruction_tokens
        self._count = batch_counter(tokenizer)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metronome-tokens")

    async def _counts(self, texts: list[str]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._count, texts)

    async def charge(self, tally: dict[str, int], pieces: Iterable[tuple[str, str]]) -> None:
        """Add the tokens of each (sid, text) piece to ``tally[sid]``."""
        pieces = [(sid, text) for sid, text in pieces if text]
        if not pieces or self._count is None:
            return
        for (sid, _), n in zip(pieces, await self._counts([text for _, text in pieces])):
            tally[sid] = tally.get(sid, 0) + n

    def refusals(self, tally: dict[str, int]) -> dict[str, str]:
        """sid -> why, for the sessions whose text this tick is over ``max_input_tokens``."""
        limit = self.max_input_tokens
        return {sid: f"this tick's text is {n} tokens; at most {limit} fit in one tick (send shorter text)"
                for sid, n in tally.items() if n > limit}

    async def instructions_refusal(self, instructions: str) -> str | None:
        """Why ``instructions`` cannot be a session's system prompt, or None when they may fit."""
        if not instructions or self._count is None:
            return None
        (n,) = await self._counts([instructions])
        if n > self.max_instruction_tokens:
            return f"instructions are {n} tokens; at most {self.max_instruction_tokens} fit"
        return None

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False)
