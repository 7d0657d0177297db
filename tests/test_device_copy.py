"""Host-to-device copies: every input form arrives with its values and the dtype asked for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metronome.device_copy import embed_lists, to_device

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_lists_arrays_and_tensors_arrive_with_their_values(device):
    got = to_device([3, 1, 2], device, torch.long)
    assert got.device.type == device and got.dtype == torch.long and got.tolist() == [3, 1, 2]
    flags = to_device([True, False], device, torch.bool)
    assert flags.dtype == torch.bool and flags.tolist() == [True, False]
    array = np.linspace(-1, 1, 7, dtype=np.float64)
    got = to_device(array, device, torch.float32)
    assert got.dtype == torch.float32 and got.device.type == device
    torch.testing.assert_close(got.cpu(), torch.from_numpy(array).float())
    source = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    got = to_device(source, device)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), source)


@pytest.mark.parametrize("device", DEVICES)
def test_embed_lists_gives_each_list_its_own_rows_from_one_lookup(device):
    table = torch.nn.Embedding(50, 4).to(device)
    lookups = []

    def embed(ids):
        lookups.append(ids)
        return table(ids)

    lists = [[3, 1], [], [7], [1, 2, 3]]
    rows = embed_lists(embed, lists, device)
    assert len(lookups) == 1 and [r.shape[0] for r in rows] == [2, 0, 1, 3]
    for ids, got in zip(lists, rows):
        assert torch.equal(got, table(torch.tensor(ids, dtype=torch.long, device=device)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_copy_queued_behind_work_reads_the_values_given():
    """The pinned staging memory outlives the call: values queued behind a long kernel still arrive intact."""
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        big = big @ big.T / 4096
    copies = [to_device(list(range(k, k + 5)), "cuda", torch.long) for k in range(100)]
    assert [c.tolist() for c in copies] == [list(range(k, k + 5)) for k in range(100)]
