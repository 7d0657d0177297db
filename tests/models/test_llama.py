"""The decoder's logits head: alignment of its rows for the GPU's products."""

from __future__ import annotations

import pytest
import torch

from metronome.models.llama import HEAD_ROW_MULTIPLE
from metronome.models.loader import load_model
from tests.conftest import make_checkpoint


@pytest.mark.parametrize("family", ["llama", "llama-tied"])
def test_the_head_is_padded_with_zero_rows_it_shares_storage_with(tmp_path, family):
    make_checkpoint(tmp_path, family, vocab_size=100)
    model, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    before = model.head_weight().clone()
    ids = torch.tensor([0, 57, 99])
    embedded = model.embed(ids)
    assert model.align_head_()
    padded = model.aligned_head
    assert padded.shape == (HEAD_ROW_MULTIPLE * 2, 64) and not padded[100:].any()
    assert torch.equal(padded[:100], before)
    assert model.head_weight().data_ptr() == padded.data_ptr() and model.head_weight().shape == (100, 64)
    assert torch.equal(model.embed(ids), embedded)   # a tied embedding reads the same rows
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(torch.nn.functional.linear(hidden, padded)[:, :100], hidden @ before.T)


def test_an_aligned_vocabulary_is_left_as_it_is(tmp_path):
    make_checkpoint(tmp_path, "llama", vocab_size=HEAD_ROW_MULTIPLE * 2)
    model, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    weight = model.head_weight()
    assert not model.align_head_()
    assert model.aligned_head is None and model.head_weight() is weight
