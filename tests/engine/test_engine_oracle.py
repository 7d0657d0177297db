"""The engine against transformers on tiny random Llama / Qwen2 / Qwen3 checkpoints."""

from __future__ import annotations

import math
import random

import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from tests.conftest import FAMILIES
from tests.engine.oracle import Transcript, hf_greedy


def engine_for(path, **policy):
    return Engine(EngineConfig(model=path, policy=KVPolicy(**policy), num_blocks=400, max_chunk_tokens=40,
                               max_batch_tokens=96))


@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_sessions_match_generate(checkpoints, family):
    """Window larger than the sequence: greedy tokens equal generate's, prompt logprobs equal its logits."""
    path, model = checkpoints[family]
    engine = engine_for(path, sinks=4, window=300, block_size=4, positions="absolute")
    rng = random.Random(family)
    # Three sessions of different lengths, several steps each; chunks and decode lengths vary.
    plans = [[(rng.randint(1, 40), rng.randint(0, 6)) for _ in range(steps)] for steps in (4, 2, 3)]
    sids = [engine.open_session() for _ in plans]
    contexts = [[] for _ in plans]
    for step in range(max(len(p) for p in plans)):
        inputs, expected = [], []
        for sid, plan, ctx in zip(sids, plans, contexts):
            if step >= len(plan):
                continue
            n_in, n_out = plan[step]
            chunk = [rng.randrange(128) for _ in range(n_in)]
            before = list(ctx)
            ctx.extend(chunk)
            gen = hf_greedy(model, ctx, n_out)
            expected.append((sid, before, chunk, gen))
            ctx.extend(gen)
            inputs.append(StepInput(sid, token_ids=chunk, max_new_tokens=n_out, prompt_logprobs=True))
        outputs = engine.step(inputs)
        for out, (sid, before, chunk, gen) in zip(outputs, expected):
            assert out.error is None
            assert out.token_ids == gen, f"session {sid} step {step}"
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([before + chunk])).logits[0], -1)
            for i, token in enumerate(chunk):
                pos = len(before) + i
                if pos == 0:
                    assert out.prompt_logprobs[i] is None
                else:
                    assert out.prompt_logprobs[i] == pytest.approx(logp[pos - 1, token].item(), abs=2e-4)


@pytest.mark.parametrize("sinks,window,block_size", [(4, 16, 4), (3, 21, 8), (0, 8, 4), (16, 32, 16), (1, 5, 2)])
def test_windowed_absolute_logits_equal_masked_forward(checkpoints, sinks, window, block_size):
    path, model = checkpoints["qwen2"]
    engine = engine_for(path, sinks=sinks, window=window, block_size=block_size, positions="absolute")
    sid, other = engine.open_session(), engine.open_session()
    rng = random.Random(sinks * 1000 + window)
    transcript = Transcript()
    for step in range(20):
        chunk = [rng.randrange(128) for _ in range(rng.randint(1, 23))]
        out, _ = engine.step([StepInput(sid, token_ids=chunk, max_new_tokens=rng.choice([0, 0, 3]),
                                        prompt_logprobs=True),
                              StepInput(other, token_ids=[rng.randrange(128) for _ in range(5)], max_new_tokens=1)])
        assert out.error is None
        transcript.record(chunk, out)
    assert len(transcript.tokens) > 4 * window  # far beyond the window, across many block boundaries
    transcript.assert_matches(model, sinks, window, abs=2e-4)


def test_rebased_equals_absolute_without_sinks(checkpoints):
    """With no sinks only relative positions matter, so re-rotating the window must change nothing."""
    path, model = checkpoints["llama"]
    absolute = engine_for(path, sinks=0, window=24, block_size=4, positions="absolute")
    rebased = engine_for(path, sinks=0, window=24, block_size=4, positions="rebased", rebase_every=8)
    a, r = absolute.open_session(), rebased.open_session()
    rng = random.Random(7)
    for _ in range(15):
        chunk = [rng.randrange(128) for _ in range(rng.randint(1, 20))]
        oa, = absolute.step([StepInput(a, token_ids=chunk, max_new_tokens=2, prompt_logprobs=True)])
        orb, = rebased.step([StepInput(r, token_ids=chunk, max_new_tokens=2, prompt_logprobs=True)])
        assert orb.token_ids == oa.token_ids
        assert orb.prompt_logprobs == pytest.approx(oa.prompt_logprobs, abs=2e-4)
    assert rebased.scheduler.sessions[r].position_base > 0  # it really did rebase


def test_sessions_rebased_together_match_each_alone(checkpoints):
    """Sessions whose windows move in the same forward (one batched re-rotation, different deltas and
    lengths) get exactly what each gets stepping alone in its own engine, with sinks."""
    path, _ = checkpoints["qwen2"]
    policy = dict(sinks=2, window=20, block_size=4, positions="rebased", rebase_every=4)
    together = engine_for(path, **policy)
    alone = [engine_for(path, **policy) for _ in range(3)]
    sids = [together.open_session() for _ in range(3)]
    solo = [e.open_session() for e in alone]
    rng = random.Random(3)
    for _ in range(12):
        chunks = [[rng.randrange(128) for _ in range(rng.randint(1, 13))] for _ in range(3)]
        outs = together.step([StepInput(s, token_ids=c, max_new_tokens=3, prompt_logprobs=True)
                              for s, c in zip(sids, chunks)])
        for i, (engine, sid, chunk) in enumerate(zip(alone, solo, chunks)):
            ref, = engine.step([StepInput(sid, token_ids=chunk, max_new_tokens=3, prompt_logprobs=True)])
            assert outs[i].token_ids == ref.token_ids
            assert outs[i].prompt_logprobs == pytest.approx(ref.prompt_logprobs, abs=2e-5)
    bases = [together.scheduler.sessions[s].position_base for s in sids]
    assert min(bases) > 0 and len(set(bases)) > 1        # all moved, by different amounts


def test_rebased_runs_past_the_position_limit_while_absolute_sessions_end_cleanly(tmp_path):
    from tests.conftest import make_checkpoint

    make_checkpoint(tmp_path, "llama", max_position_embeddings=64)
    engine = Engine(EngineConfig(model=str(tmp_path), num_blocks=200, max_chunk_tokens=8, max_batch_tokens=64,
                                 policy=KVPolicy(sinks=4, window=16, block_size=4, positions="rebased")))
    forever = engine.open_session()
    doomed = engine.open_session(positions="absolute")
    bystander = engine.open_session(positions="absolute")
    rng = random.Random(3)
    doomed_error = None
    for step in range(90):
        inputs = [StepInput(forever, token_ids=[rng.randrange(128) for _ in range(5)], max_new_tokens=3,
                            prompt_logprobs=True)]
        if doomed_error is None or step % 10 == 0:
            inputs.append(StepInput(doomed, token_ids=[rng.randrange(128) for _ in range(5)], max_new_tokens=3))
        if step % 30 == 0:
            inputs.append(StepInput(bystander, token_ids=[rng.randrange(128)], max_new_tokens=1))
        outs = {o.session_id: o for o in engine.step(inputs)}
        f = outs[forever]
        assert f.error is None and len(f.token_ids) == 3
        known = f.prompt_logprobs[1:] if step == 0 else f.prompt_logprobs  # a session's first token has none
        assert all(lp is not None and math.isfinite(lp) for lp in known)
        session = engine.scheduler.sessions[forever]
        assert session.num_tokens - session.position_base + 8 + 1 <= 64
        if doomed in outs and outs[doomed].error:
            doomed_error = doomed_error or outs[doomed].error
        if bystander in outs:
            assert outs[bystander].error is None
    assert engine.scheduler.sessions[forever].num_tokens >= 10 * 64
    assert doomed_error is not None and "position limit" in doomed_error
    # The ended session frees its KV at once; it stays refusable until closed.
    assert engine.scheduler.sessions[doomed].live_blocks == 0
    engine.close_session(doomed)
