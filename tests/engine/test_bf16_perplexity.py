"""bfloat16 loses (almost) nothing: the packaged SmolLM2's perplexity on the quality experiment's text through
the engine, bf16 against fp32, with the window wide (W = 1024) and narrow (W = 128). Where the CPU lacks native
bf16, torch emulates it: slower, the same numbers. E4M3 KV pages (``kv_cache_dtype="fp8"``) and E4M3 weights
(``quantization="fp8"``, through the CPU's C product) under bf16 each stay within 3 % of bf16, the bound the GPU's
tests hold them to."""

from __future__ import annotations

from importlib import resources

import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.experiments.quality import perplexity
from metronome.models.loader import load_model

pytestmark = pytest.mark.slow

TOKENS, CHUNK = 256, 128


def engine_perplexity(net, checkpoint, dtype: str, window: int, tokens: list[int], kv: str = "auto",
                      quantization: str | None = None) -> float:
    engine = Engine(EngineConfig(model=str(checkpoint), policy=KVPolicy(sinks=16, window=window), dtype=dtype,
                                 num_blocks=120, max_chunk_tokens=CHUNK, kv_cache_dtype=kv,
                                 quantization=quantization),
                    model=net, checkpoint=checkpoint)
    sid = engine.open_session()
    logprobs = []
    for start in range(0, len(tokens), CHUNK):
        out, = engine.step([StepInput(sid, token_ids=tokens[start:start + CHUNK], prompt_logprobs=True)])
        assert out.error is None
        logprobs += out.prompt_logprobs
    return perplexity(logprobs)


def test_bf16_perplexity_within_two_percent_of_fp32():
    text = resources.files("metronome.experiments").joinpath("data/nettle_manual.txt").read_text()
    ppl = {}
    for dtype in ("float32", "bfloat16"):
        net, checkpoint = load_model("smollm2-135m", getattr(torch, dtype), "cpu")
        if dtype == "float32":
            from metronome.models.loader import load_tokenizer

            tokens = load_tokenizer(checkpoint)(text)["input_ids"][:TOKENS]
        for window in (1024, 128):
            ppl[dtype, window] = engine_perplexity(net, checkpoint, dtype, window, tokens)
            if dtype == "bfloat16":
                ppl["e4m3", window] = engine_perplexity(net, checkpoint, dtype, window, tokens, kv="fp8")
    net, checkpoint = load_model("smollm2-135m", torch.bfloat16, "cpu")    # quantised in place by the engine
    for window in (1024, 128):
        ppl["fp8 weights", window] = engine_perplexity(net, checkpoint, "bfloat16", window, tokens, quantization="fp8")
    for window in (1024, 128):
        fp32, bf16 = ppl["float32", window], ppl["bfloat16", window]
        assert 1.0 < fp32 < 100.0, ppl
        assert abs(bf16 / fp32 - 1.0) <= 0.02, f"W = {window}: bf16 {bf16:.3f} vs fp32 {fp32:.3f}"
        for lossy in ("e4m3", "fp8 weights"):
            assert ppl[lossy, window] != bf16 and abs(ppl[lossy, window] / bf16 - 1.0) <= 0.03, (window, ppl)
    assert ppl["float32", 128] != ppl["float32", 1024]   # the narrow window really dropped context
