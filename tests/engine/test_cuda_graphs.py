"""The decode graphs' host side (the replay itself needs CUDA: tests/engine/test_engine_cuda.py)."""

import random

import pytest

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.engine.cuda_graphs import staging_rows
from metronome.engine.request import ForwardSegment


@pytest.mark.parametrize("window", [None, 8])
def test_staging_rows_carry_each_sessions_slot_position_and_live_table(checkpoints, window):
    """Rows of sessions of different lengths: the table cut to the longest live row, padded with -1."""
    path, _ = checkpoints["llama"]
    sinks = 0 if window is None else 2
    engine = Engine(EngineConfig(model=path, policy=KVPolicy(sinks=sinks, window=window, block_size=4),
                                 num_blocks=200, max_chunk_tokens=40))
    rng = random.Random(0)
    sids = [engine.open_session() for _ in range(3)]
    for length, sid in zip((3, 17, 30), sids):
        engine.step([StepInput(sid, token_ids=[rng.randrange(128) for _ in range(length)])])
    sessions = [engine.scheduler.sessions[s] for s in sids]
    segments = [ForwardSegment(s, [11 + i]) for i, s in enumerate(sessions)]
    plan = engine.scheduler.schedule_forward(segments)
    kept = plan.segments
    assert len(kept) == 3
    rows = staging_rows(segments, 4)
    tables = [s.table_row() for s in sessions]
    assert rows.shape == (3, 8 + max(map(len, tables)))
    for i, (s, table) in enumerate(zip(sessions, tables)):
        t = s.num_tokens
        assert list(rows[i, :8]) == [11 + i, t - s.position_base, s.physical(t // 4) * 4 + t % 4, s.window_first,
                                     i, i, 1, t]
        assert list(rows[i, 8:8 + len(table)]) == table and (rows[i, 8 + len(table):] == -1).all()
    if window is None:      # unbounded tables grow with the context: the rows differ in length
        assert len({len(t) for t in tables}) == 3
