"""Engine.close, the context manager, the closed-engine error, and that a dropped engine frees its tensors."""

from __future__ import annotations

import gc
import weakref

import pytest

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.engine.engine import EngineClosed


def build(path: str) -> Engine:
    return Engine(EngineConfig(model=path, policy=KVPolicy(sinks=2, window=8, block_size=4), num_blocks=64,
                               max_chunk_tokens=8, max_batch_tokens=32))


def test_close_frees_the_pool_and_model_and_later_use_is_refused(llama):
    path, _ = llama
    with build(path) as engine:
        sid = engine.open_session()
        out, = engine.step([StepInput(sid, token_ids=[1, 2, 3], max_new_tokens=2)])
        assert out.ok and len(out.token_ids) == 2
        kv = weakref.ref(engine.runner.kv_caches[0][0])
        weight = weakref.ref(next(engine.model.parameters()))
    assert engine.closed and kv() is None and weight() is None
    engine.close()                                    # twice: harmless
    for use in (lambda: engine.step([StepInput(sid, token_ids=[1])]), engine.open_session,
                lambda: engine.close_session(sid), lambda: engine.session_stats(sid), engine.stats):
        with pytest.raises(EngineClosed, match="closed"):
            use()


def test_a_dropped_engine_frees_its_tensors_without_the_cycle_collector(llama):
    path, _ = llama
    engine = build(path)
    sid = engine.open_session()
    engine.step([StepInput(sid, token_ids=[1, 2, 3], max_new_tokens=3)])
    refs = [weakref.ref(engine), weakref.ref(engine.runner.kv_caches[0][0]),
            weakref.ref(next(engine.model.parameters())), weakref.ref(engine.scheduler.sessions[sid].last_hidden)]
    gc.collect()
    gc.disable()
    try:
        del engine
        assert [r() is None for r in refs] == [True] * len(refs)   # freed by reference counts alone
    finally:
        gc.enable()
