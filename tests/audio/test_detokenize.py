"""Incremental detokenisation: deltas add up to the one-shot decode, never split a character, stay bounded."""

from __future__ import annotations

import pytest

from metronome.audio.detokenize import REPLACEMENT, IncrementalDetokenizer

TEXTS = ["The capital of France is Paris.", "héllo 世界 🎉 done", "ok 🎉🎉 👩‍👩‍👧 ünïcödé", "  spaced\n\nlines  "]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("per_push", [1, 2, 3])
def test_deltas_add_up_and_never_split_a_character(smollm2_tokenizer, text, per_push):
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(smollm2_tokenizer)
    deltas = [d.push(ids[i:i + per_push]) for i in range(0, len(ids), per_push)]
    deltas.append(d.flush())
    assert "".join(deltas) == smollm2_tokenizer.decode(ids) == text
    assert not any(REPLACEMENT in delta for delta in deltas)


def test_special_tokens_are_skipped(smollm2_tokenizer):
    d = IncrementalDetokenizer(smollm2_tokenizer)
    im_end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert d.push(smollm2_tokenizer.encode(" Paris", add_special_tokens=False) + [im_end]) == " Paris"


def test_state_is_bounded_over_a_long_stream(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("word 🎉 " * 400, add_special_tokens=False)
    d = IncrementalDetokenizer(smollm2_tokenizer, context=4, max_held=8)
    out = []
    for i in range(0, len(ids), 3):
        out.append(d.push(ids[i:i + 3]))
        assert len(d._tokens) <= 4 + 3 + 8
    assert "".join(out) + d.flush() == "word 🎉 " * 400


def test_invalid_bytes_do_not_grow_the_state(smollm2_tokenizer):
    # A run of lone UTF-8 lead-byte tokens never completes; after max_held tokens they are emitted anyway.
    lead = smollm2_tokenizer.encode("🎉", add_special_tokens=False)[0]
    d = IncrementalDetokenizer(smollm2_tokenizer, max_held=4)
    texts = [d.push([lead]) for _ in range(20)]
    assert d.held < 4 and any(texts)
