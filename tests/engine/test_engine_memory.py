"""Bounded memory, NaN poisoning of freed blocks, admission, and the Unbounded baseline's preemption."""

from __future__ import annotations

import random

import pytest
import torch

from metronome import AdmissionError, Engine, EngineConfig, KVPolicy, StepInput
from tests.engine.oracle import hf_greedy


def make_engine(path, num_blocks=400, **policy):
    return Engine(EngineConfig(model=path, policy=KVPolicy(**policy), num_blocks=num_blocks,
                               max_chunk_tokens=24, max_batch_tokens=128))


def poison_free_blocks(engine: Engine) -> None:
    free = torch.tensor(engine.scheduler.pool.free_block_ids(), dtype=torch.long)
    for k, v in engine.runner.kv_caches:
        k[free] = float("nan")
        v[free] = float("nan")


def drive(engine, sid, rng, steps, poison=False):
    outs = []
    for _ in range(steps):
        chunk = [rng.randrange(128) for _ in range(rng.randint(1, 24))]
        out, = engine.step([StepInput(sid, token_ids=chunk, max_new_tokens=2, prompt_logprobs=True)])
        outs.append(out)
        if poison:
            poison_free_blocks(engine)
    return outs


def test_freed_blocks_filled_with_nan_never_reach_an_output(llama):
    path, _ = llama
    clean, poisoned = (make_engine(path, sinks=3, window=20, block_size=4, positions="absolute") for _ in range(2))
    a, b = clean.open_session(), poisoned.open_session()
    poison_free_blocks(poisoned)
    ref = drive(clean, a, random.Random(1), 25)
    got = drive(poisoned, b, random.Random(1), 25, poison=True)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        assert g.prompt_logprobs == pytest.approx(r.prompt_logprobs, abs=1e-5, nan_ok=False)


def test_memory_stays_within_the_reservation_and_closing_returns_everything(llama):
    path, _ = llama
    window = 32
    engine = make_engine(path, sinks=4, window=window, block_size=8, positions="rebased")
    sid, other = engine.open_session(), engine.open_session()
    reservation = engine.stats().blocks_per_session
    rng = random.Random(2)
    peak = 0
    while engine.scheduler.sessions[sid].num_tokens < 20 * window:
        engine.step([StepInput(sid, token_ids=[rng.randrange(128) for _ in range(rng.randint(1, 24))],
                               max_new_tokens=rng.randint(0, 4)),
                     StepInput(other, token_ids=[rng.randrange(128)], max_new_tokens=1)])
        peak = max(peak, engine.scheduler.sessions[sid].live_blocks)
        assert engine.stats().kv_blocks_used <= 2 * reservation
    assert peak <= reservation
    stats = engine.session_stats(sid)
    assert stats.num_tokens >= 20 * window and stats.kv_blocks <= stats.reservation == reservation
    assert stats.kv_bytes == stats.kv_blocks * engine.stats().kv_bytes_per_block and stats.position_base > 0
    # Plateau: the held blocks cover sinks + window, not the session's age.
    assert engine.scheduler.sessions[sid].live_blocks <= 1 + (window + 24) // 8 + 2
    engine.close_session(sid)
    engine.close_session(other)
    stats = engine.stats()
    assert (stats.kv_blocks_used, stats.kv_blocks_reserved, stats.sessions) == (0, 0, 0)
    assert engine.scheduler.pool.free_count == stats.kv_blocks_total


def test_the_session_that_would_overcommit_the_pool_is_refused(llama):
    path, _ = llama
    engine = make_engine(path, num_blocks=60, sinks=4, window=32, block_size=8)
    per_session = engine.stats().blocks_per_session
    capacity = engine.stats().capacity
    assert capacity == 59 // per_session
    sids = [engine.open_session() for _ in range(capacity)]
    before = engine.stats()
    with pytest.raises(AdmissionError, match="KV pool full"):
        engine.open_session()
    assert engine.stats() == before
    # Admitted sessions can all run at full size at once: the pool never runs dry under admitted load.
    rng = random.Random(4)
    for _ in range(10):
        outs = engine.step([StepInput(s, token_ids=[rng.randrange(128) for _ in range(24)], max_new_tokens=3)
                            for s in sids])
        assert all(o.error is None and len(o.token_ids) == 3 for o in outs)
    engine.close_session(sids[0])
    engine.open_session()


def test_unbounded_baseline_preempts_the_newest_and_recomputes_it_exactly(llama):
    """A dry pool preempts the newest session (empty frames); once room returns it is recomputed and
    continues exactly where transformers, fed the same context, would."""
    path, model = llama
    engine = make_engine(path, num_blocks=41, window=None, block_size=4)  # 40 blocks = 160 tokens in all
    sids = [engine.open_session() for _ in range(3)]
    contexts = {sid: [] for sid in sids}
    rng = random.Random(5)
    preempted = {sid: 0 for sid in sids}
    restored_and_checked = 0
    for step in range(14):
        if step == 10:
            engine.close_session(sids[0])  # room returns
            sids = sids[1:]
        chunks = {sid: [rng.randrange(128) for _ in range(6)] for sid in sids}
        for sid, out in zip(sids, engine.step([StepInput(s, token_ids=chunks[s], max_new_tokens=3) for s in sids])):
            assert out.error is None
            contexts[sid].extend(chunks[sid])
            if out.preempted:
                preempted[sid] += 1
                assert len(out.token_ids) < 3  # the quiet cliff: the frame comes back short or empty
            else:
                assert out.token_ids == hf_greedy(model, contexts[sid], 3)
                restored_and_checked += step >= 10 and preempted[sid] > 0
            contexts[sid].extend(out.token_ids)
        engine.scheduler.check_invariants()
    assert max(preempted.values()) > 0
    assert max(preempted, key=preempted.get) == max(preempted)  # the newest session paid
    assert restored_and_checked > 0


def test_pool_sized_from_memory_when_num_blocks_is_none(llama):
    path, _ = llama
    engine = Engine(EngineConfig(model=path, policy=KVPolicy(sinks=4, window=32, block_size=8),
                                 kv_memory_fraction=0.01, max_chunk_tokens=24, max_batch_tokens=64))
    stats = engine.stats()
    assert stats.kv_blocks_total > 100 and stats.capacity >= 1
