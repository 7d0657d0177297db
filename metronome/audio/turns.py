"""Turn bookkeeping shared by the adapters that frame a session as chat turns (energy, cascade).

Both adapters stop an assistant answer at the model's own stop token and close the assistant turn on
the next tick; these two helpers are the pieces of that they have in common.

>>> class Chat: assistant_suffix = [2, 198]            # SmolLM2: <|im_end|> "\\n"
>>> answer_close(Chat(), [504, 2])                      # the model emitted <|im_end|> itself
[198]
>>> answer_close(Chat(), [504])                         # it did not: the whole suffix closes the turn
[2, 198]
"""

from __future__ import annotations

from typing import Sequence


def default_stop_tokens(tokenizer, chat) -> tuple[int, ...]:
    """The tokenizer's EOS and the token that ends an assistant turn (``<|im_end|>`` for ChatML), deduplicated."""
    stops = [tokenizer.eos_token_id] + list(chat.assistant_suffix[:1])
    return tuple(dict.fromkeys(int(t) for t in stops if t is not None))


def answer_close(chat, token_ids: Sequence[int]) -> list[int]:
    """Tokens that close an assistant turn whose last decoded tokens were ``token_ids``: the template's
    assistant suffix, minus its first token when the model emitted that token (its stop token) already."""
    close = list(chat.assistant_suffix)
    if token_ids and close[:1] == [int(token_ids[-1])]:
        close = close[1:]
    return close


def session_header(chat, instructions: str, max_input_tokens: int) -> list[int]:
    """The system turn a session starts with (what the sinks pin); ValueError when it would take more
    than half of one tick's input (the rest is left for the first tick's own turn)."""
    header = chat.header(instructions)
    limit = max_input_tokens // 2
    if len(header) > limit:
        raise ValueError(f"instructions are {len(header)} tokens with their chat framing; at most {limit} fit")
    return header
