"""The decoder's logits head: alignment of its rows for the GPU's products."""

from __future__ import annotations

import pytest
import torch

from metronome.models.llama import HEAD_ROW_MULTIPLE
from metronome.models.loader import load_model
from tests.conftest import make_checkpoint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "llama-tied"])
def test_a_padded_head_gives_the_logits_of_the_vocabulary(tmp_path, family, dtype):
    """Zero rows after the vocabulary in one storage with the head's weight (and a tied embedding); the logits
    come from the padded product, the vocabulary's columns only, as the unpadded head gives them."""
    make_checkpoint(tmp_path, family, vocab_size=100)
    model, _ = load_model(str(tmp_path), dtype, torch.device("cpu"))
    hidden = torch.randn(3, 64).to(dtype)
    ids = torch.tensor([0, 57, 99])
    want_logits, want_embedded = model.compute_logits(hidden), model.embed(ids)
    assert model.align_head_()
    padded = model.aligned_head
    assert padded.shape == (2 * HEAD_ROW_MULTIPLE, 64) and not padded[100:].any()
    assert model.head_weight().data_ptr() == padded.data_ptr() and model.head_weight().shape == (100, 64)
    assert not padded.requires_grad
    logits = model.compute_logits(hidden)
    assert logits.shape == (3, 100) and logits.dtype == torch.float32
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5   # another CPU kernel may round bf16 products apart
    torch.testing.assert_close(logits, want_logits, rtol=tolerance, atol=tolerance)
    assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))
    assert torch.equal(model.embed(ids), want_embedded)   # a tied embedding reads the same rows
    assert not model.align_head_()                        # once: a second engine over the model pads nothing


def test_an_aligned_vocabulary_is_left_as_it_is(tmp_path):
    make_checkpoint(tmp_path, "llama", vocab_size=HEAD_ROW_MULTIPLE * 2)
    model, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    weight = model.head_weight()
    assert not model.align_head_()
    assert model.aligned_head is None and model.head_weight() is weight
