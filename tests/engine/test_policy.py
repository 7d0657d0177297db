from metronome.config import KVPolicy
from metronome.engine.policy import SinkWindow, Unbounded, retention_for


def test_sink_window_releases_only_blocks_wholly_behind_the_window():
    p = SinkWindow(sinks=4, window=8, block_size=4)
    # Length 20: the next query (t = 20) attends to [12, 20]; blocks 0..2 hold tokens 0..11.
    assert p.releasable_until(20) == 3
    # Length 21: window starts at 13, block 3 (12..15) still holds token 13.
    assert p.releasable_until(21) == 3
    assert p.releasable_until(24) == 4
    assert p.releasable_until(5) == 0


def test_unbounded_releases_nothing():
    assert Unbounded().releasable_until(10**6) == 0
    assert isinstance(retention_for(KVPolicy(window=None)), Unbounded)


def test_oldest_attended_token_respects_sinks():
    p = SinkWindow(sinks=4, window=8, block_size=4)
    assert p.oldest_attended_token(6) == 4
    assert p.oldest_attended_token(100) == 92
