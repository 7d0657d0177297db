"""Chat-turn framing taken from the tokenizer's own chat template.

A streaming session cannot render its whole conversation at once: audio arrives tick by tick and
becomes the *content* of a user turn whose end is only known later. So the template is rendered
once with sentinel contents and cut into the pieces a stream needs. For SmolLM2's ChatML template::

    header("Be brief.")   <|im_start|>system\\nBe brief.<|im_end|>\\n
    user_prefix           <|im_start|>user\\n
    user_suffix           <|im_end|>\\n
    generation_prompt     <|im_start|>assistant\\n
    assistant_suffix      <|im_end|>\\n

so a spoken turn is ``user_prefix + audio tokens... + user_suffix + generation_prompt`` and the
model's answer ends with its stop token ``<|im_end|>`` followed by the rest of ``assistant_suffix``.
Typed text turns go through ``apply_chat_template`` itself (tokenised exactly as the template says).
"""

from __future__ import annotations

from metronome.errors import ConfigError

# Sentinel contents: strings no template rewrites and no real message contains.
_SYS, _USER, _ASSISTANT = "\u2063SYS\u2063", "\u2063USER\u2063", "\u2063ASSISTANT\u2063"


def _after(text: str, prefix: str, what: str) -> str:
    if not text.startswith(prefix):
        raise ConfigError(f"the chat template does not render {what} as an extension of the previous turns; "
                          "streaming turns need a template that appends messages")
    return text[len(prefix):]


class ChatTemplate:
    """Token pieces of a tokenizer's chat template (see the module docstring for SmolLM2's)."""

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template; the adapter frames turns with it")
        self.tokenizer = tokenizer
        system = {"role": "system", "content": _SYS}
        user = {"role": "user", "content": _USER}
        sys_text = self._render([system])
        su_text = self._render([system, user])
        user_turn = _after(su_text, sys_text, "a user turn")
        if _USER not in user_turn:
            raise ConfigError("the chat template drops the user message content")
        prefix, suffix = user_turn.split(_USER, 1)
        self.user_prefix = self._encode(prefix)
        self.user_suffix = self._encode(suffix)
        prompted = self._render([system, user], add_generation_prompt=True)
        self.generation_prompt = self._encode(_after(prompted, su_text, "the generation prompt"))
        answered = _after(self._render([system, user, {"role": "assistant", "content": _ASSISTANT}]), su_text,
                          "an assistant turn")
        self.assistant_suffix = self._encode(answered.split(_ASSISTANT, 1)[1] if _ASSISTANT in answered else "")
        # With no instructions, keep whatever the template puts before a lone user turn (SmolLM2's
        # default system prompt): that is the context the model was tuned with.
        lone = self._render([user])
        cut = lone.index(_USER) - len(prefix)
        self.default_header = self._encode(lone[:cut]) if cut >= 0 and lone[cut:].startswith(prefix) else []

    def _render(self, messages, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _ids(self, messages, add_generation_prompt: bool = False) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                       add_generation_prompt=add_generation_prompt))

    def header(self, instructions: str = "") -> list[int]:
        """The session's first tokens: the system turn with ``instructions`` (or the template's default)."""
        if not instructions:
            return list(self.default_header)
        return self._ids([{"role": "system", "content": instructions}])

    def user_turn(self, text: str, respond: bool = True) -> list[int]:
        """A complete user turn holding ``text``, plus the generation prompt when ``respond``.

        Rendered by ``apply_chat_template`` after a fixed system turn, which is then cut off, so the
        template neither inserts its default system prompt again nor sees a conversation it rejects.
        """
        system = [{"role": "system", "content": _SYS}]
        base = self._ids(system)
        full = self._ids(system + [{"role": "user", "content": text}], respond)
        if full[:len(base)] == base:
            return full[len(base):]
        # Tokenisation merged across the cut (not the case for special-token templates): frame by pieces.
        ids = self.user_prefix + self._encode(text) + self.user_suffix
        return ids + self.generation_prompt if respond else ids
