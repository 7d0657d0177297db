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
