"""Audio fixtures: the packaged SmolLM2 tokenizer (real chat template, real byte-level BPE)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from metronome.models.embedded import embedded_checkpoint

    return AutoTokenizer.from_pretrained(embedded_checkpoint("smollm2-135m"))
