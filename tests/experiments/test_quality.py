"""Quality: perplexity through the engine against transformers on a tiny model, the probe's
schedule and scoring on synthetic ticks, and a short probe run (tiny model, stub ASR)."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from metronome.experiments import speech
from metronome.experiments.quality import (CPU, engine_logprobs, hf_logprobs, perplexity, ppl_configs, probe_times,
                                          run_probe, score_probes)
from metronome.experiments.quality_report import accuracy_by_age, analyse, rolling_nll, write_report
from metronome.audio.adapter import PreparedInput
from metronome.models.loader import load_model, load_tokenizer


@pytest.fixture(scope="module")
def tiny(chat_checkpoint):
    net, ckpt = load_model(chat_checkpoint, torch.float32, "cpu")
    preset = replace(CPU, model=chat_checkpoint, text_tokens=96, chunk_tokens=16, window=32, sinks=(4,),
                     probe_window=32, probe_tokens_per_tick=3, probe_first_s=3.0, probe_every_s=6.0,
                     answer_ticks=2)
    return net, ckpt, load_tokenizer(ckpt), preset


def test_dense_engine_perplexity_matches_transformers_and_the_window_changes_it(tiny):
    net, ckpt, tok, preset = tiny
    tokens = [int(x) for x in np.random.default_rng(0).integers(100, 40000, preset.text_tokens)]
    ref = hf_logprobs(ckpt, tokens, "cpu")
    configs = {c["name"]: c for c in ppl_configs(preset.window, preset.sinks)}
    assert list(configs) == ["dense", "S=0 absolute", "S=0 rebased", "S=4 absolute", "S=4 rebased"]
    dense = engine_logprobs(net, tokens, configs["dense"], preset)
    assert dense[0] is None and ref[0] is None
    torch.testing.assert_close(torch.tensor(dense[1:]), torch.tensor(ref[1:]), atol=2e-4, rtol=1e-4)
    window = engine_logprobs(net, tokens, configs["S=0 absolute"], preset)
    # Inside the first window every token sees its whole past: identical to dense; after it, not.
    torch.testing.assert_close(torch.tensor(window[1:preset.window]), torch.tensor(dense[1:preset.window]),
                               atol=2e-4, rtol=1e-4)
    assert max(abs(a - b) for a, b in zip(window[preset.window + 2:], dense[preset.window + 2:])) > 1e-3
    # RoPE is relative: with no sinks, re-rotating the window (rebased) leaves every prediction as it was.
    rebased = engine_logprobs(net, tokens, configs["S=0 rebased"], preset)
    torch.testing.assert_close(torch.tensor(rebased[1:]), torch.tensor(window[1:]), atol=2e-4, rtol=1e-4)


def test_perplexity_and_rolling_nll():
    assert perplexity([None, math.log(0.25), math.log(0.25)]) == pytest.approx(4.0)
    assert math.isnan(perplexity([None]))
    pos, nll = rolling_nll([None, -1.0, -1.0, -3.0, -3.0], 2)
    assert pos.tolist() == [1, 2, 3, 4] and nll.tolist() == [1.0, 1.0, 2.0, 3.0]


def test_probe_schedule_scoring_and_accuracy_by_age():
    assert probe_times(40.0, 3.0, 10.0, tail_s=8.0) == [3.0, 13.0, 23.0]
    probes = [{"index": 0, "question": "What is the capital of France?", "answers": ["paris"], "start_s": 2.0,
               "end_s": 3.5},
              {"index": 1, "question": "Which planet do we live on?", "answers": ["earth"], "start_s": 10.0,
               "end_s": 11.2}]
    ticks = [{"t_s": 2.0 * (k + 1), "transcript": "", "text": "blah ", "tokens": 10 * k} for k in range(10)]
    ticks[0]["transcript"] = "filler sentence that ended before the question"
    ticks[2] = {"t_s": 6.0, "transcript": "What is the capital of France?", "text": "The capital is ", "tokens": 20}
    ticks[3]["text"] = "Paris."
    ticks[6] = {"t_s": 14.0, "transcript": "Which planet do we live on?", "text": "Mars", "tokens": 60}
    ticks[7] = {"t_s": 16.0, "transcript": "more reading", "text": " earth", "tokens": 70}   # next utterance: cut
    scored = score_probes(ticks, probes, answer_ticks=3)
    assert [s["tick"] for s in scored] == [2, 6]
    assert scored[0]["reply"] == "The capital is Paris.blah " and scored[0]["correct"] and scored[0]["heard_ok"]
    assert scored[1]["reply"] == "Mars" and not scored[1]["correct"] and scored[1]["context_tokens"] == 60
    assert accuracy_by_age(scored, [0, 5, 20]) == [{"from_s": 0, "to_s": 5, "asked": 1, "correct": 1},
                                                   {"from_s": 5, "to_s": 20, "asked": 1, "correct": 0}]
    assert speech.answered("Seven days.", speech.QUESTIONS[9]) and not speech.answered("", speech.QUESTIONS[0])


class StubAsrAdapter:
    """A cascade look-alike without Whisper: each utterance (sound followed by 0.5 s of silence) is heard as
    the same question; free-running decode of ``max_tokens`` every tick."""

    name, sample_rate = "stub", 16000

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.state = {}

    def open_session(self, sid, mode, instructions):
        self.state[sid] = {"speaking": False, "quiet": 0, "first": True}

    def close_session(self, sid):
        self.state.pop(sid, None)

    def prepare(self, batch):
        out = []
        for tick in batch:
            s = self.state[tick.session_id]
            transcript = ""
            for frame in np.array_split(tick.pcm, max(1, tick.pcm.size // 1600)):
                loud = frame.size and float(np.abs(frame).max()) > 0.01
                if loud:
                    s["speaking"], s["quiet"] = True, 0
                elif s["speaking"]:
                    s["quiet"] += frame.size
                    if s["quiet"] >= 8000:
                        s["speaking"], transcript = False, "What is the capital of France?"
            ids = self.tok.encode(transcript, add_special_tokens=False) if transcript else []
            if s["first"]:
                ids, s["first"] = self.tok.encode("system header", add_special_tokens=False) + ids, False
            out.append(PreparedInput(token_ids=ids or None, max_new_tokens=tick.max_tokens, transcript=transcript))
        return out

    def on_output(self, sid, token_ids, finished):
        return self.tok.decode(token_ids)


@pytest.mark.skipif(not speech.have_espeak(), reason="espeak-ng is not installed")
def test_probe_smoke_run_and_report(tiny, tmp_path):
    net, ckpt, tok, preset = tiny
    probe = run_probe(net, tok, preset, progress=False, session_s=16.0, adapter=StubAsrAdapter(tok))
    assert [p["start_s"] for p in probe["probes"]] == [3.0]        # 3 s, then 9 s would leave < 8 s
    assert set(probe["arms"]) == {"sinks", "none", "dense"}
    for arm, st in probe["arms"].items():
        assert st["ended"] is None and len(st["ticks"]) == 8
        tokens = [t["tokens"] for t in st["ticks"]]
        assert tokens == sorted(tokens) and tokens[-1] > 3 * 8     # the context grows every tick
        assert st["scored"][0]["tick"] is not None                  # the question was heard after it ended
    raw = {"preset": preset.to_dict(), "machine": {}, "probe": probe, "perplexity": {
        "tokens": 40, "chars": 100, "hf_reference": None,
        "configs": [{**c, "ppl": 10.0 + i, "logprobs": [None] + [-2.0] * 39}
                    for i, c in enumerate(ppl_configs(preset.window, preset.sinks))]}}
    a = analyse(raw)
    assert a["probe"]["sinks"]["asked"] == 1 and a["perplexity"][1]["ratio_to_dense"] == pytest.approx(1.1)
    summary = write_report(raw, tmp_path)
    assert "| window only, S=0 | absolute | 11.00 | 1.100 |" in summary and "## (b) Spoken-question probe" in summary
