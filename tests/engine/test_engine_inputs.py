"""Bad input is reported on its own session's output and never disturbs the others; input forms agree."""

from __future__ import annotations

import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, SamplingParams, SessionNotFound, StepInput
from tests.engine.oracle import hf_greedy


@pytest.fixture(scope="module")
def engine(llama):
    path, _ = llama
    return Engine(EngineConfig(model=path, policy=KVPolicy(sinks=4, window=64, block_size=8), num_blocks=300,
                               max_chunk_tokens=16, max_batch_tokens=64))


def test_each_bad_input_gets_its_own_error_and_the_good_session_is_untouched(engine, llama):
    _, model = llama
    good, fresh, spare = engine.open_session(), engine.open_session(), engine.open_session()
    prompt = [5, 6, 7, 8]
    bad_inputs = [
        (StepInput(good, token_ids=prompt, max_new_tokens=4), None),
        (StepInput(9999, token_ids=[1]), "unknown session"),
        (StepInput(spare, token_ids=[1, 500]), "not an integer in"),
        (StepInput(spare, token_ids=[1, -1]), "not an integer in"),
        (StepInput(spare, token_ids=[1.5]), "not an integer in"),
        (StepInput(spare, token_ids=list(range(17))), "exceeds max_chunk_tokens=16"),
        (StepInput(spare, token_ids=[1], embeds=torch.zeros(1, 64)), "not both"),
        (StepInput(spare, embeds=torch.zeros(2, 3)), "shape"),
        (StepInput(spare, embeds=torch.full((2, 64), float("nan"))), "NaN"),
        (StepInput(spare, token_ids=[1], max_new_tokens=-1), "max_new_tokens"),
        (StepInput(fresh, max_new_tokens=3), "nothing to decode from"),
        (StepInput(good, token_ids=[1]), "more than once"),
    ]
    outs = engine.step([inp for inp, _ in bad_inputs])
    for out, (_, expected) in zip(outs, bad_inputs):
        if expected is None:
            assert out.error is None and out.token_ids == hf_greedy(model, prompt, 4)
        else:
            assert out.error is not None and expected in out.error
            assert out.token_ids == []
    # The refused sessions are still usable.
    out, = engine.step([StepInput(spare, token_ids=[3, 4], max_new_tokens=2)])
    assert out.ok and out.token_ids == hf_greedy(model, [3, 4], 2)
    for sid in (good, fresh, spare):
        engine.close_session(sid)
    with pytest.raises(SessionNotFound):
        engine.close_session(good)


def test_nonfinite_embeds_refuse_only_their_own_session(engine, llama):
    """The step checks every input's embeds together: the sessions with a NaN or an infinity in any row (the
    first, the last) are refused, the finite ones beside them (before and after, of other lengths) run as they
    would alone, and an input that breaks an earlier rule is refused for that rule."""
    _, model = llama
    ids = [[11, 12, 13], [14], [15, 16]]
    table = model.get_input_embeddings()
    finite = [table(torch.tensor(x)).detach() for x in ids]
    with_inf = finite[0].clone()
    with_inf[0, 7] = float("inf")
    with_nan = torch.cat([finite[1], torch.full((1, 64), float("nan"))])
    sids = [engine.open_session() for _ in range(6)]
    outs = engine.step([StepInput(sids[0], embeds=finite[0], max_new_tokens=2),
                        StepInput(sids[1], embeds=with_inf, max_new_tokens=2),
                        StepInput(sids[2], embeds=finite[1], max_new_tokens=2),
                        StepInput(sids[3], embeds=with_nan, max_new_tokens=2),
                        StepInput(sids[5], token_ids=[1], embeds=with_nan),
                        StepInput(sids[4], embeds=finite[2], max_new_tokens=2)])
    assert [o.error is not None and "NaN or infinite" in o.error for o in outs] == [False, True, False, True, False,
                                                                                     False]
    assert "not both" in outs[4].error
    outs = outs[:4] + outs[5:]
    for out, x in zip((outs[0], outs[2], outs[4]), ids):
        assert out.token_ids == hf_greedy(model, x, 2)
    for sid in sids:
        engine.close_session(sid)


def test_embeds_vouched_finite_are_not_checked(engine, llama):
    """``embeds_finite`` hands the check to the caller: the engine does not read those embeds before the step (a
    NaN it would have refused goes through, into that session alone), the unvouched input beside them is still
    refused, and a finite session in the same step decodes what it decodes alone."""
    _, model = llama
    nan = torch.full((1, 64), float("nan"))
    ids = [11, 12, 13]
    finite = model.get_input_embeddings()(torch.tensor(ids)).detach()
    a, b, c = engine.open_session(), engine.open_session(), engine.open_session()
    out_a, out_b, out_c = engine.step([StepInput(a, embeds=nan, embeds_finite=True, max_new_tokens=2),
                                       StepInput(b, embeds=nan, max_new_tokens=2),
                                       StepInput(c, embeds=finite, embeds_finite=True, max_new_tokens=3)])
    assert out_a.error is None
    assert "NaN or infinite" in out_b.error
    assert out_c.token_ids == hf_greedy(model, ids, 3)
    for sid in (a, b, c):
        engine.close_session(sid)


def test_embeddings_input_equals_token_input(engine, llama):
    _, model = llama
    a, b = engine.open_session(), engine.open_session()
    ids = [11, 12, 13, 14, 15]
    embeds = model.get_input_embeddings()(torch.tensor(ids)).detach()
    oa, ob = engine.step([StepInput(a, token_ids=ids, max_new_tokens=3), StepInput(b, embeds=embeds, max_new_tokens=3)])
    assert oa.token_ids == ob.token_ids == hf_greedy(model, ids, 3)
    # The sampled token leads the next step for both; contexts stay identical.
    oa, ob = engine.step([StepInput(a, token_ids=ids, max_new_tokens=2), StepInput(b, embeds=embeds, max_new_tokens=2)])
    assert oa.token_ids == ob.token_ids
    engine.close_session(a)
    engine.close_session(b)


def test_one_forward_puts_ids_and_embeddings_rows_in_each_sessions_order(engine, llama):
    """Embeddings only, a pending token then embeddings, and token ids only, in one forward: each session's
    rows reach the model in its own order (the runner gathers them from one lookup and one copy)."""
    _, model = llama
    table = model.get_input_embeddings()
    first, second, third = [11, 12, 13], [14, 15, 16, 17], [18, 19]
    a, b, c = engine.open_session(), engine.open_session(), engine.open_session()
    pending, = engine.step([StepInput(b, embeds=table(torch.tensor(first)).detach(), max_new_tokens=1)])
    oc, ob, oa = engine.step([
        StepInput(c, embeds=table(torch.tensor(third)).detach(), max_new_tokens=3),
        StepInput(b, embeds=table(torch.tensor(second)).detach(), max_new_tokens=3),
        StepInput(a, token_ids=second, max_new_tokens=3)])
    assert oa.token_ids == hf_greedy(model, second, 3)
    assert ob.token_ids == hf_greedy(model, first + pending.token_ids + second, 3)
    assert oc.token_ids == hf_greedy(model, third, 3)
    for sid in (a, b, c):
        engine.close_session(sid)


def test_decode_only_steps_continue_from_the_context(engine, llama):
    _, model = llama
    sid = engine.open_session()
    engine.step([StepInput(sid, token_ids=[20, 21, 22], max_new_tokens=0)])
    first, = engine.step([StepInput(sid, max_new_tokens=2)])
    second, = engine.step([StepInput(sid, max_new_tokens=2)])
    assert first.token_ids + second.token_ids == hf_greedy(model, [20, 21, 22], 4)
    engine.close_session(sid)


def test_prompt_logprobs_after_an_ingest_only_step_use_the_previous_context(engine, llama):
    _, model = llama
    sid = engine.open_session()
    engine.step([StepInput(sid, token_ids=[30, 31], max_new_tokens=0)])
    out, = engine.step([StepInput(sid, token_ids=[32, 33], prompt_logprobs=True)])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([[30, 31, 32, 33]])).logits[0], -1)
    assert out.prompt_logprobs == pytest.approx([logp[1, 32].item(), logp[2, 33].item()], abs=2e-4)
    engine.close_session(sid)


def test_stop_tokens_end_the_step_and_join_the_context(engine, llama):
    _, model = llama
    sid = engine.open_session()
    expected = hf_greedy(model, [40, 41, 42], 6)
    stop = expected[2]
    out, = engine.step([StepInput(sid, token_ids=[40, 41, 42], max_new_tokens=6,
                                  sampling=SamplingParams(stop_token_ids=(stop,)))])
    assert out.finished and out.token_ids == expected[:expected.index(stop) + 1]
    # The stop token joins the context: pending for the next step, or (pipelined rounds) already written.
    session = engine.scheduler.sessions[sid]
    assert session.num_tokens + (session.pending_token is not None) == 3 + len(out.token_ids)
    assert session.pending_token in (None, stop)
    nxt, = engine.step([StepInput(sid, max_new_tokens=3)])
    assert nxt.token_ids == hf_greedy(model, [40, 41, 42] + out.token_ids, 3)
    engine.close_session(sid)


def test_pipelined_rounds_stop_where_per_round_decoding_stops(llama):
    """Greedy rounds read stop tokens a round late (pipelined); greedy-equivalent sampling (top_k = 1) takes the
    per-round path. Sessions stopping at their first, a middle or their last token, or not at all, over several
    steps: the same tokens, the same ``finished``, and the same continuation next step."""
    path, _ = llama

    def run(sampling_of):
        e = Engine(EngineConfig(model=path, policy=KVPolicy(sinks=2, window=24, block_size=4), num_blocks=300,
                                max_chunk_tokens=16, max_batch_tokens=64))
        sids = [e.open_session() for _ in range(5)]
        outs = []
        for step in range(6):
            inputs = [StepInput(sid, token_ids=[(7 * step + 3 * i) % 120 + 1 for _ in range(1 + (i + step) % 4)],
                                max_new_tokens=2 + (i + step) % 5, sampling=sampling_of(i, step))
                      for i, sid in enumerate(sids)]
            outs.append([(o.token_ids, o.finished) for o in e.step(inputs)])
        return outs

    # Stop tokens chosen from what the sessions actually decode, so stops land at many positions.
    plain = run(lambda i, step: SamplingParams())
    stops = {t for step in plain for tokens, _ in step for t in tokens[::3]}
    pipelined = run(lambda i, step: SamplingParams(stop_token_ids=tuple(sorted(stops))[i::2]))
    per_round = run(lambda i, step: SamplingParams(temperature=1.0, top_k=1, stop_token_ids=tuple(sorted(stops))[i::2]))
    assert pipelined == per_round
    assert any(f for step in pipelined for _, f in step) and not all(f for step in pipelined for _, f in step)


def test_sampling_is_seeded_and_top_k_one_is_greedy(llama):
    path, model = llama
    def run(params, seed):
        e = Engine(EngineConfig(model=path, policy=KVPolicy(sinks=4, window=64, block_size=8), num_blocks=50,
                                max_chunk_tokens=16, max_batch_tokens=64, seed=seed))
        sid = e.open_session()
        return e.step([StepInput(sid, token_ids=[1, 2, 3], max_new_tokens=8, sampling=params)])[0].token_ids
    hot = SamplingParams(temperature=1.5)
    assert run(hot, 1) == run(hot, 1)
    assert run(SamplingParams(temperature=1.0, top_k=1), 1) == hf_greedy(model, [1, 2, 3], 8)
    assert run(SamplingParams(temperature=0.7, top_p=1e-6), 3) == hf_greedy(model, [1, 2, 3], 8)


def _bounded(path, positions="rebased"):
    return Engine(EngineConfig(model=path, policy=KVPolicy(sinks=4, window=32, block_size=8, positions=positions),
                               num_blocks=300, max_chunk_tokens=16, max_batch_tokens=64))


PIPELINED = staticmethod(lambda stop: SamplingParams(stop_token_ids=(stop,)))       # greedy: pipelined rounds
PER_ROUND = staticmethod(lambda stop: SamplingParams(temperature=1.0, top_k=1, stop_token_ids=(stop,)))


@pytest.mark.parametrize("sampling", [PIPELINED, PER_ROUND], ids=["pipelined", "per-round"])
def test_a_stop_on_the_last_token_stays_pending(llama, sampling):
    """A stop sampled as the step's last token was never fed, on either path: it is pending."""
    path, model = llama
    engine = _bounded(path)
    prompt = [5, 6, 7]
    expected = hf_greedy(model, prompt, 5)
    assert expected.index(expected[4]) == 4              # the stop token first appears as the last one
    sid = engine.open_session()
    out, = engine.step([StepInput(sid, token_ids=prompt, max_new_tokens=5, sampling=sampling(expected[4]))])
    assert out.finished and out.token_ids == expected
    assert engine.scheduler.sessions[sid].pending_token == expected[4]
    nxt, = engine.step([StepInput(sid, max_new_tokens=2)])
    assert nxt.token_ids == hf_greedy(model, prompt + out.token_ids, 2)


@pytest.mark.parametrize("sampling", [PIPELINED, PER_ROUND], ids=["pipelined", "per-round"])
def test_a_stop_at_the_position_limit_finishes_without_failing(llama, sampling):
    """Absolute positions, one position left: a stop sampled there ends the decode; the session lives on."""
    path, _ = llama
    probe = _bounded(path, "absolute")
    limit = probe.max_model_len

    def filled():
        engine = _bounded(path, "absolute")
        sid = engine.open_session()
        n = 0
        while n < limit - 1:
            k = min(16, limit - 1 - n)
            engine.step([StepInput(sid, token_ids=[(n + j) % 100 + 1 for j in range(k)])])
            n += k
        return engine, sid

    engine, sid = filled()
    free, = engine.step([StepInput(sid, max_new_tokens=3)])
    assert free.error and len(free.token_ids) == 2          # without a stop the limit ends the session
    engine, sid = filled()
    out, = engine.step([StepInput(sid, max_new_tokens=3, sampling=sampling(free.token_ids[1]))])
    assert out.token_ids == free.token_ids and out.finished and out.error is None
    assert engine.session_stats(sid).status == "active"


def test_return_hidden_after_a_stop_matches_the_per_round_path(llama):
    """The hidden state after a stop (fed a round late by pipelined rounds) is served once, then refused."""
    path, model = llama
    stop = hf_greedy(model, [40, 41, 42], 6)[2]
    results = []
    for sampling in (PIPELINED, PER_ROUND):
        engine = _bounded(path)
        sid = engine.open_session()
        engine.step([StepInput(sid, token_ids=[40, 41, 42], max_new_tokens=6, sampling=sampling(stop))])
        first, = engine.step([StepInput(sid, return_hidden=True)])
        again, = engine.step([StepInput(sid, return_hidden=True)])
        assert first.error is None and again.error and "return_hidden needs new input" in again.error
        results.append(first.hidden)
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
