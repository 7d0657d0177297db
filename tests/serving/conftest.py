"""Serving fixtures: a tiny random Llama that speaks through the real SmolLM2 tokenizer (chat template included)."""

from __future__ import annotations

import pytest

from tests.conftest import make_checkpoint

# vocab_size matches the SmolLM2 tokenizer, so every id it produces is a valid input to the tiny model.
CHAT_VOCAB = 49152


def save_smollm2_tokenizer(path) -> None:
    from transformers import AutoTokenizer

    from metronome.models.embedded import embedded_checkpoint

    AutoTokenizer.from_pretrained(embedded_checkpoint("smollm2-135m")).save_pretrained(path)


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory) -> str:
    """A checkpoint dir: random tiny Llama (2 layers, hidden 64) + the packaged SmolLM2 tokenizer.

    Loads in about a second; the first use on a machine converts the packaged SmolLM2 once (~40 s, cached).
    """
    path = tmp_path_factory.mktemp("chat-llama")
    make_checkpoint(path, "llama", vocab_size=CHAT_VOCAB, max_position_embeddings=2048)
    save_smollm2_tokenizer(path)
    return str(path)
