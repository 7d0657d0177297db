"""ModelRunner functions: the rebase's slot list (``window_slots``) against ``Session.physical`` token by token."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given, settings, strategies as st

from metronome.engine import runner
from metronome.engine.runner import window_slots
from metronome.engine.session import Session


def test_doctests():
    assert doctest.testmod(runner).failed == 0


def session_with(num_tokens: int, sinks: int, window: int, block_size: int, first_block: int) -> Session:
    """A session holding ``num_tokens`` tokens whose blocks below the window's first have been freed."""
    s = Session(session_id=first_block, reservation=0, sink_count=-(-sinks // block_size), block_size=block_size,
                opened_seq=0)
    for i in range(-(-num_tokens // block_size)):
        s.append_block(first_block + 7 * i)        # scattered physical ids
    s.num_tokens = num_tokens
    s.release_window_blocks_below(max(sinks, num_tokens - window) // block_size)
    return s


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 4, 16]), sinks=st.integers(0, 20), window=st.integers(1, 80),
       lengths=st.lists(st.integers(1, 200), min_size=1, max_size=6))
def test_window_slots_are_each_tokens_physical_slot(block_size, sinks, window, lengths):
    spans = []
    for i, n in enumerate(lengths):
        s = session_with(n, sinks, window, block_size, first_block=1000 * i)
        lo = max(sinks, n - window)
        if lo < n:
            spans.append((s, lo, n))
    if not spans:
        return
    slots, span = window_slots(spans, block_size)
    want = [s.physical(t // block_size) * block_size + t % block_size for s, lo, hi in spans for t in range(lo, hi)]
    assert slots.tolist() == want
    assert span.tolist() == [i for i, (_, lo, hi) in enumerate(spans) for _ in range(lo, hi)]


def test_a_span_reaching_a_freed_block_is_refused():
    s = session_with(100, sinks=4, window=20, block_size=4, first_block=0)
    with pytest.raises(ValueError, match="not all in live blocks"):
        window_slots([(s, 40, 100)], 4)


def test_a_span_starting_in_a_released_gap_is_refused_not_read_from_the_sinks():
    s = Session(session_id=1, reservation=0, sink_count=1, block_size=4, opened_seq=0)
    for b in range(10, 16):
        s.append_block(b)
    s.num_tokens = 24
    s.release_window_blocks_below(3)          # logical blocks 1 and 2 are gone; the row is [10, 13, 14, 15]
    with pytest.raises(ValueError, match="not all in live blocks"):
        window_slots([(s, 8, 16)], 4)          # logical block 2: released
    assert window_slots([(s, 12, 24)], 4)[0].tolist() == [52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63]


def test_metadata_refuses_a_new_token_without_a_live_block():
    """The engine allocates before a forward; a token past the session's blocks is a bookkeeping bug, caught
    on the host instead of becoming a negative cache slot."""
    from types import SimpleNamespace

    import torch

    from metronome.engine.policy import SinkWindow
    from metronome.engine.runner import ModelRunner
    from metronome.engine.scheduler import InvariantError

    s = session_with(8, sinks=0, window=64, block_size=4, first_block=3)    # two blocks: tokens 0-7

    class Segment:
        session, token_ids, embeds = s, [1, 2, 3], None

        def __len__(self):
            return 3

    runner = SimpleNamespace(block_size=4, sink_blocks=0, retention=SinkWindow(sinks=0, window=64, block_size=4),
                             to_device=lambda t: t)
    s.num_tokens = 5                                   # tokens 5-7: inside the second block
    meta, positions = ModelRunner._metadata(runner, [Segment()])
    assert meta.slot_mapping.tolist() == [10 * 4 + 1, 10 * 4 + 2, 10 * 4 + 3] and positions.tolist() == [5, 6, 7]
    s.num_tokens = 6                                   # token 8 would need a third block
    with pytest.raises(InvariantError, match="no live block"):
        ModelRunner._metadata(runner, [Segment()])
    assert torch.is_tensor(meta.block_tables)
