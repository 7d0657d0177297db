"""Turn bookkeeping shared by the adapters that frame a session as chat turns (energy, cascade, omni).

They stop an assistant answer at the model's own stop token (or at ``max_response_tokens``) and close
the assistant turn on the next tick; these functions are the pieces of that they have in common.

>>> class Chat: assistant_suffix = [2, 198]            # SmolLM2: <|im_end|> "\\n"
>>> answer_close(Chat(), [504, 2])                      # the model emitted <|im_end|> itself
[198]
>>> answer_close(Chat(), [504])                         # it did not: the whole suffix closes the turn
[2, 198]
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence


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
    return fitting_header(chat.header(instructions), max_input_tokens)


def fitting_header(header: list[int], max_input_tokens: int) -> list[int]:
    """``header`` when it takes at most half of one tick's input, else ValueError (a message for the client)."""
    limit = max_input_tokens // 2
    if len(header) > limit:
        raise ValueError(f"instructions are {len(header)} tokens with their chat framing; at most {limit} fit")
    return header


class TurnState(Protocol):
    """The per-session fields ``decode_budget`` and ``record_output`` read and update.

    ``mode`` is "turn" or "free_running"; ``responding``/``response_tokens``/``close_next`` follow a
    turn-mode answer; ``last_decoded`` is the free-running model's last token (what closes its turn
    when the user speaks); ``detok`` is the session's ``IncrementalDetokenizer``.
    """

    mode: str
    responding: bool
    response_tokens: int
    close_next: list[int]
    last_decoded: list[int]
    detok: object


def decode_budget(state: TurnState, max_tokens: int, max_response_tokens: int, stop_token_ids: tuple[int, ...],
                  live: bool = True) -> tuple[int, tuple[int, ...], bool]:
    """(tokens to decode this tick, stop tokens, whether the answer ends after this tick).

    Free running decodes ``max_tokens`` every tick once ``live`` (the adapter's "the model has heard
    something"), with no stop tokens. Turn mode decodes only while answering, at most what is left of
    ``max_response_tokens``; the tick that uses up the cap ends the answer (``ends_response``).

    >>> class S: mode, responding, response_tokens = "turn", True, 250
    >>> decode_budget(S(), 8, 256, (2,))
    (6, (2,), True)
    """
    if state.mode == "free_running":
        return (max(0, max_tokens) if live else 0), (), False
    left = max_response_tokens - state.response_tokens
    max_new = min(max(0, max_tokens), left) if state.responding else 0
    return max_new, stop_token_ids, state.responding and 0 < max_new >= left


def record_output(state: TurnState, token_ids: list[int], finished: bool,
                  close: Callable[[list[int]], list[int]]) -> str:
    """Record one tick's decoded tokens; return the new text.

    Free running remembers the last token (``close`` of it ends the model's turn when the user
    speaks). Turn mode counts the answer's tokens; when it finishes, the held text is flushed and
    ``close(token_ids)`` is queued to close the assistant turn on the next tick.
    """
    text = state.detok.push(token_ids)
    if state.mode == "free_running":
        if token_ids:
            state.last_decoded = [int(token_ids[-1])]
        return text
    state.response_tokens += len(token_ids)
    if finished:
        text += state.detok.flush()
        if state.responding:
            state.responding = False
            state.close_next = close(token_ids)
    return text
