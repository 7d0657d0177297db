"""StepInput.return_hidden: the final-normed hidden state of the last input position."""

import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput


def test_return_hidden_matches_transformers_last_hidden_state(llama):
    path, ref = llama
    engine = Engine(EngineConfig(model=str(path), dtype="float32", policy=KVPolicy(sinks=0, window=None),
                                 num_blocks=64))
    sid = engine.open_session()
    ids = [5, 9, 17, 33, 2, 11]
    first, = engine.step([StepInput(sid, token_ids=ids[:4], return_hidden=True)])
    second, = engine.step([StepInput(sid, token_ids=ids[4:], return_hidden=True)])
    with torch.no_grad():
        want = ref.model(torch.tensor([ids])).last_hidden_state[0]
    torch.testing.assert_close(first.hidden, want[3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second.hidden, want[5], rtol=1e-4, atol=1e-4)


def test_return_hidden_with_decoding_is_refused(llama):
    path, _ = llama
    engine = Engine(EngineConfig(model=str(path), dtype="float32", policy=KVPolicy(sinks=0, window=None),
                                 num_blocks=64))
    sid = engine.open_session()
    out, = engine.step([StepInput(sid, token_ids=[1, 2], max_new_tokens=2, return_hidden=True)])
    assert out.error and "return_hidden" in out.error


def test_empty_embeds_and_stale_hidden_requests_are_refused_per_session(llama):
    """Zero-row embeds and return_hidden with nothing new are refused on that session; the others run."""
    path, ref = llama
    engine = Engine(EngineConfig(model=str(path), dtype="float32", policy=KVPolicy(sinks=0, window=None),
                                 num_blocks=64))
    a, b = engine.open_session(), engine.open_session()
    hidden = engine.spec.hidden_size
    engine.step([StepInput(a, token_ids=[1, 2, 3]), StepInput(b, token_ids=[4, 5, 6])])
    out_a, out_b = engine.step([StepInput(a, embeds=torch.zeros(0, hidden), return_hidden=True),
                                StepInput(b, token_ids=[7], return_hidden=True)])
    assert out_a.error and "at least one row" in out_a.error
    assert out_b.ok
    with torch.no_grad():
        want = ref.model(torch.tensor([[4, 5, 6, 7]])).last_hidden_state[0, -1]
    torch.testing.assert_close(out_b.hidden, want, rtol=1e-4, atol=1e-4)
    stale, = engine.step([StepInput(a, return_hidden=True)])
    assert stale.error and "needs new input" in stale.error
    assert engine.session_stats(a).num_tokens == 3   # refused steps changed nothing
