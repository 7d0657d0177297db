"""The CPU decode round in direct calls (``models/cpu_decode_round.py``) against the modules' own path: the same
steps, so the same bits, over rounds that append, gather, rebase and lose sessions."""

from __future__ import annotations

import random

import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.attention.decode_window import DecodeWindow
from metronome.engine.request import SamplingParams
from metronome.models.cpu_decode_round import DirectDecodeRound
from metronome.native import find_compiler

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler to build the CPU kernels with")


def engine_for(path: str, dtype: str, kv: str, direct: bool) -> Engine:
    engine = Engine(EngineConfig(model=path, dtype=dtype, kv_cache_dtype=kv, num_blocks=300, max_chunk_tokens=24,
                                 max_batch_tokens=96, seed=3,
                                 policy=KVPolicy(sinks=3, window=13, block_size=4, rebase_every=8)))
    if not direct:
        engine.runner.direct_rounds = None
    return engine


def transcript(engine: Engine, steps: int = 9) -> tuple[list, list[torch.Tensor]]:
    """Three sessions, one sampling at a temperature; the second leaves after four steps and a fourth joins.
    Returns the outputs and every forward's hidden states (prefills and decode rounds)."""
    forward, hidden = engine.runner.forward, []
    engine.runner.forward = lambda *args, **kw: hidden.append(forward(*args, **kw).clone()) or hidden[-1]
    rng = random.Random(11)
    sids = [engine.open_session() for _ in range(3)]
    warm = SamplingParams(temperature=0.8, top_k=20)
    seen = []
    for step in range(steps):
        if step == 4:
            engine.close_session(sids.pop(1))
            sids.append(engine.open_session())
        inputs = [StepInput(s, token_ids=[rng.randrange(128) for _ in range(rng.randint(1, 9))],
                            max_new_tokens=rng.randint(1, 6), prompt_logprobs=True,
                            sampling=warm if i == 0 else SamplingParams())
                  for i, s in enumerate(sids)]
        for out in engine.step(inputs):
            assert out.ok, out.error
            seen.append((out.session_id, out.token_ids, out.prompt_logprobs))
    return seen, hidden


@pytest.mark.parametrize("family,dtype,kv", [("llama", "float32", "auto"), ("llama-tied", "bfloat16", "auto"),
                                             ("qwen2", "float32", "auto"), ("llama", "float32", "fp8")])
def test_direct_rounds_give_the_modules_bits(checkpoints, family, dtype, kv, monkeypatch):
    path, _ = checkpoints[family]
    direct = engine_for(path, dtype, kv, direct=True)
    assert direct.runner.direct_rounds is not None
    rounds = []
    attend = DecodeWindow.attend_qkv

    def counted(window, qkv, cache, plan):
        rounds.append(plan.direct is not None)
        return attend(window, qkv, cache, plan)

    monkeypatch.setattr(DecodeWindow, "attend_qkv", counted)
    got = transcript(direct)
    monkeypatch.setattr(DecodeWindow, "attend_qkv", attend)
    want = transcript(engine_for(path, dtype, kv, direct=False))
    assert rounds, "no decode round went through the direct calls"
    if kv == "fp8":   # E4M3 pages: the window's share goes through its call; the layers' steps stay direct
        assert not any(rounds)
    else:   # rounds that only append use the direct calls; rounds that gather (joins, rebases) the call
        assert any(rounds) and not all(rounds), rounds
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) > 9
    for i, (hidden, hidden_ref) in enumerate(zip(got[1], want[1])):
        assert torch.equal(hidden, hidden_ref), f"forward {i}"


def test_build_declines_layers_without_a_direct_step(checkpoints):
    def engine(family: str, **settings) -> Engine:
        return Engine(EngineConfig(model=checkpoints[family][0], num_blocks=64, max_chunk_tokens=24,
                                   policy=KVPolicy(sinks=3, window=13, block_size=4), **settings))

    qwen3 = engine("qwen3")    # q/k norms
    torch_ops = engine("llama", cpu_elementwise="torch")
    sdpa = engine("llama", cpu_attention="sdpa")
    assert qwen3.runner.direct_rounds is None
    assert torch_ops.runner.direct_rounds is None
    assert sdpa.runner.direct_rounds is None
    assert DirectDecodeRound.build(qwen3.model, None) is None


def test_a_round_it_was_not_built_for_takes_the_modules(checkpoints, monkeypatch):
    """Operands other than the ones checked at build (another dtype) go through the model's own forward."""
    engine = engine_for(checkpoints["llama"][0], "float32", "auto", direct=True)
    direct = engine.runner.direct_rounds
    called = []
    monkeypatch.setattr(direct, "model", lambda *args: called.append(args) or "modules")
    assert direct(torch.zeros(2, 64, dtype=torch.float64), torch.zeros(2), [], engine.runner.decode_window,
                  object()) == "modules"
    assert len(called) == 1
