import pytest
from hypothesis import given, settings, strategies as st

from metronome.config import KVPolicy
from metronome.engine.blocks import NULL_BLOCK, BlockPool, blocks_per_session
from metronome.engine.policy import retention_for
from metronome.engine.session import Session
from metronome.engine.blocks import sink_block_count


def test_pool_never_hands_out_the_null_block():
    pool = BlockPool(5)
    got = [pool.allocate() for _ in range(4)]
    assert NULL_BLOCK not in got and sorted(got) == [1, 2, 3, 4]
    assert pool.allocate() is None
    with pytest.raises(ValueError):
        pool.release(NULL_BLOCK)


def test_reservations_are_bounded_by_the_pool():
    pool = BlockPool(11)
    pool.reserve(6)
    assert not pool.can_reserve(5)
    with pytest.raises(ValueError):
        pool.reserve(5)
    pool.unreserve(6)
    assert pool.can_reserve(10)


@settings(max_examples=60, deadline=None)
@given(sinks=st.integers(0, 40), window=st.integers(1, 100), bs_log=st.integers(0, 5),
       max_chunk=st.integers(1, 40), chunks=st.lists(st.integers(0, 40), min_size=1, max_size=60),
       decode=st.integers(0, 5))
def test_a_session_never_holds_more_than_the_formula(sinks, window, bs_log, max_chunk, chunks, decode):
    """Drive the session's block table as the engine does; the peak must stay within the one formula."""
    policy = KVPolicy(sinks=sinks, window=window, block_size=1 << bs_log, positions="absolute")
    bs = policy.block_size
    limit = blocks_per_session(policy, max_chunk, max_model_len=10**9)
    retention = retention_for(policy)
    s = Session(1, reservation=limit, sink_count=sink_block_count(policy), block_size=bs, opened_seq=0)
    next_block = iter(range(1, 10**9))
    pending = 0
    for chunk in chunks:
        chunk = min(chunk, max_chunk)
        appends = [pending + chunk] + [1] * max(0, decode - 1) if decode else [pending + chunk]
        for n in appends:
            if n == 0:
                continue
            for _ in range(s.blocks_needed_for(s.num_tokens + n)):
                s.append_block(next(next_block))
            assert s.live_blocks <= limit
            s.num_tokens += n
            s.release_window_blocks_below(retention.releasable_until(s.num_tokens))
        pending = 1 if decode else 0
    # Every token the next query may attend to still has a block.
    t = s.num_tokens
    for j in [*range(min(sinks, t)), *range(max(sinks, t - window), t)]:
        assert s.physical(j // bs) is not None


def test_formula_examples():
    assert blocks_per_session(KVPolicy(sinks=16, window=1024, block_size=16), 256, 8192) == 1 + 80 + 1
    assert blocks_per_session(KVPolicy(window=None, block_size=16), 256, 8192) == 512
    # A window larger than the model's context can never hold more than the context.
    assert blocks_per_session(KVPolicy(sinks=4, window=10_000, block_size=16), 256, 1024) == 64
