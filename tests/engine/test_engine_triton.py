"""The engine with attention="triton" (interpreted on the CPU) against transformers."""

from __future__ import annotations

import random

import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from tests.engine.oracle import Transcript, hf_greedy

pytest.importorskip("triton")
# These drive the kernels through the interpreter with CPU tensors; on a CUDA machine the interpreter is off and
# tests/engine/test_engine_cuda.py runs the same engine paths compiled.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter path (CUDA: test_engine_cuda)")


def test_triton_engine_matches_the_windowed_oracle(checkpoints):
    path, model = checkpoints["qwen3"]
    sinks, window = 3, 13
    engine = Engine(EngineConfig(model=path, attention="triton", num_blocks=200, max_chunk_tokens=24,
                                 max_batch_tokens=64,
                                 policy=KVPolicy(sinks=sinks, window=window, block_size=4, positions="absolute")))
    sid, other = engine.open_session(), engine.open_session()
    rng = random.Random(11)
    transcript = Transcript()
    for _ in range(7):
        chunk = [rng.randrange(128) for _ in range(rng.randint(1, 12))]
        out, _ = engine.step([StepInput(sid, token_ids=chunk, max_new_tokens=2, prompt_logprobs=True),
                              StepInput(other, token_ids=[rng.randrange(128)], max_new_tokens=1)])
        transcript.record(chunk, out)
    assert len(transcript.tokens) > 3 * window
    transcript.assert_matches(model, sinks, window, abs=2e-4)


def test_triton_engine_greedy_equals_generate(checkpoints):
    path, model = checkpoints["llama"]
    engine = Engine(EngineConfig(model=path, attention="triton", num_blocks=100, max_chunk_tokens=24,
                                 max_batch_tokens=64, policy=KVPolicy(sinks=4, window=200, block_size=8,
                                                                      positions="absolute")))
    prompts = [[5, 6, 7], list(range(20, 41)), [9]]
    sids = [engine.open_session() for _ in prompts]
    outs = engine.step([StepInput(s, token_ids=p, max_new_tokens=4) for s, p in zip(sids, prompts)])
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == hf_greedy(model, prompt, 4)


def test_start_up_kernel_warm_up_touches_only_the_scratch_block(checkpoints):
    """``ModelRunner._warm_up_kernels`` runs at start on CUDA; here it runs interpreted on the CPU, to show it
    launches what it should and writes nowhere but the scratch block (the pool is bitwise unchanged)."""
    import torch

    path, _ = checkpoints["qwen2"]
    engine = Engine(EngineConfig(model=path, attention="triton", num_blocks=12, max_chunk_tokens=24,
                                 max_batch_tokens=64, policy=KVPolicy(sinks=4, window=40, block_size=16)))
    sid = engine.open_session()
    engine.step([StepInput(sid, token_ids=list(range(1, 30)), max_new_tokens=2)])   # some keys in the pool
    runner = engine.runner
    before = [(k[:-1].clone(), v[:-1].clone()) for k, v in runner.kv_caches]
    runner._warm_up_kernels()
    for (k0, v0), (k, v) in zip(before, runner.kv_caches):
        assert torch.equal(k0.nan_to_num(3.0), k[:-1].nan_to_num(3.0))
        assert torch.equal(v0.nan_to_num(3.0), v[:-1].nan_to_num(3.0))
    out, = engine.step([StepInput(sid, token_ids=[5, 6], max_new_tokens=2)])
    assert out.error is None and len(out.token_ids) == 2
