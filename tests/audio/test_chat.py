"""Chat-template pieces agree with the template rendered in one go."""

from __future__ import annotations

import pytest

from metronome.audio.chat import ChatTemplate
from metronome.errors import ConfigError


def render_ids(tok, messages, gen=False):
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=gen)


def test_pieces_rebuild_a_whole_conversation(smollm2_tokenizer):
    tok = smollm2_tokenizer
    chat = ChatTemplate(tok)
    words = tok.encode("hello there", add_special_tokens=False)
    answer = tok.encode("Hi!", add_special_tokens=False)
    streamed = (chat.header("Be brief.") + chat.user_prefix + words + chat.user_suffix + chat.generation_prompt
                + answer + chat.assistant_suffix)
    whole = render_ids(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"},
                             {"role": "assistant", "content": "Hi!"}])
    assert streamed == whole


def test_default_header_is_the_templates_own_system_prompt(smollm2_tokenizer):
    chat = ChatTemplate(smollm2_tokenizer)
    lone = render_ids(smollm2_tokenizer, [{"role": "user", "content": "x"}])
    assert chat.header("") == lone[:len(chat.default_header)]
    assert "SmolLM" in smollm2_tokenizer.decode(chat.header(""))


def test_user_turn_is_exactly_the_templates(smollm2_tokenizer):
    tok = smollm2_tokenizer
    chat = ChatTemplate(tok)
    system = [{"role": "system", "content": "S"}]
    for respond in (True, False):
        full = render_ids(tok, system + [{"role": "user", "content": "What is 2+2?"}], respond)
        assert chat.header("S") + chat.user_turn("What is 2+2?", respond) == full
    assert tok.decode(chat.user_turn("hi")) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_tokenizer_without_template_is_refused(smollm2_tokenizer):
    class Bare:
        chat_template = None

    with pytest.raises(ConfigError, match="no chat template"):
        ChatTemplate(Bare())
