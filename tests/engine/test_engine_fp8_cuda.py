"""The engine on a CUDA device with FP8 weights and FP8 KV pages: the compiled kernels, decode graphs, and
SmolLM2's perplexity with its real weights against bf16. Skipped without a GPU."""

from __future__ import annotations

import math
import random

import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.models.fp8 import Fp8Linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# SmolLM2-135M's perplexity with FP8 weights, or with FP8 KV, must stay within 3 % of bf16's; with both, 5 %.
# Simulated on the CPU (float32, the same E4M3 roundings, 4096 tokens): weights +2.5 % (+1.6 % of it the
# weights, the rest the per-token activations of the tensor-core product), KV +1.1 %, both +3.5 %.
PERPLEXITY_TOLERANCE = {("fp8", "auto"): 0.03, (None, "fp8"): 0.03, ("fp8", "fp8"): 0.05}


def drive(engine, steps=8, seed=5):
    """Three sessions of random chunks and decode; every input log-probability, in order."""
    sids = [engine.open_session() for _ in range(3)]
    rng = random.Random(seed)
    logprobs = []
    for _ in range(steps):
        chunks = [[rng.randrange(128) for _ in range(rng.randint(1, 30))] for _ in sids]
        outs = engine.step([StepInput(s, token_ids=c, max_new_tokens=3, prompt_logprobs=True)
                            for s, c in zip(sids, chunks)])
        for out in outs:
            assert out.error is None
            logprobs += [lp for lp in out.prompt_logprobs if lp is not None]
    return torch.tensor(logprobs)


def test_triton_fp8_kv_matches_the_reference_backend(checkpoints):
    """float32 compute: the compiled kernel over E4M3 pages against the torch reference over the same pages."""
    path, _ = checkpoints["qwen2"]
    runs = [drive(Engine(EngineConfig(model=path, device="cuda", attention=a, kv_cache_dtype="fp8", num_blocks=300,
                                      max_chunk_tokens=32, max_batch_tokens=128, cuda_graphs=a == "triton",
                                      policy=KVPolicy(sinks=4, window=24, block_size=16, positions="absolute"))))
            for a in ("torch", "triton")]
    torch.testing.assert_close(runs[1], runs[0], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("positions", ["absolute", "rebased"])
def test_bf16_fp8_engine_with_graphs_close_to_float32(checkpoints, positions):
    """bf16 with FP8 weights on the tensor cores, E4M3 pages and captured decode rounds: the captured rounds
    replay the eager ones exactly, and the log-probabilities stay near the float32 engine's."""
    path, _ = checkpoints["qwen3"]

    def run(dtype: str, fp8: bool, graphs: bool):
        engine = Engine(EngineConfig(model=path, device="cuda", dtype=dtype, num_blocks=300, max_chunk_tokens=32,
                                     max_batch_tokens=128, quantization="fp8" if fp8 else None,
                                     kv_cache_dtype="fp8" if fp8 else "auto", cuda_graphs=graphs,
                                     policy=KVPolicy(sinks=4, window=40, block_size=16, positions=positions,
                                                     rebase_every=16 if positions == "rebased" else None)))
        assert (engine.runner.graphs is not None) == graphs
        if fp8:
            layer = engine.model.model.layers[0]
            assert isinstance(layer.mlp.gate_up_proj, Fp8Linear) and layer.mlp.gate_up_proj.tensor_cores
        return drive(engine)

    fp8 = run("bfloat16", fp8=True, graphs=True)
    assert torch.isfinite(fp8).all()
    torch.testing.assert_close(fp8, run("bfloat16", fp8=True, graphs=False), atol=1e-3, rtol=1e-3)
    # The oracle is float32 without FP8. Single log-probabilities of the tiny random model (~ -5) are
    # heavy-tailed: bf16 alone moves the worst of 365 by 0.3-0.4 on the H200, so the bounds are on the
    # mean and the 99th percentile. Measured there: bf16 alone mean 0.005, FP8 mean 0.021-0.025, p99 0.12-0.22.
    error = (fp8 - run("float32", fp8=False, graphs=False)).abs()
    assert error.mean() <= 0.05
    assert error.quantile(0.99) <= 0.3


@pytest.mark.slow
def test_smollm2_perplexity_with_fp8_close_to_bf16():
    """SmolLM2-135M-Instruct (its real weights, the packaged checkpoint) on 4096 tokens of English prose, in chunks
    of 256 through a sink + window session (S = 16, W = 1024): FP8 weights, FP8 KV, and both."""
    from metronome.experiments.quality import perplexity, text_tokens
    from metronome.models.loader import load_tokenizer, resolve_checkpoint

    try:
        checkpoint = resolve_checkpoint("smollm2-135m")
    except Exception as exc:  # the first use converts the GGUF (needs the gguf package)
        pytest.skip(f"the packaged SmolLM2 checkpoint is not available here: {exc}")
    tokens, _ = text_tokens(load_tokenizer(checkpoint), 4096)

    def ppl(quantization, kv):
        engine = Engine(EngineConfig(model=str(checkpoint), device="cuda", dtype="bfloat16", num_blocks=400,
                                     quantization=quantization, kv_cache_dtype=kv,
                                     policy=KVPolicy(sinks=16, window=1024, block_size=16)))
        sid = engine.open_session()
        logprobs = []
        for k in range(0, len(tokens), 256):
            out, = engine.step([StepInput(sid, token_ids=tokens[k:k + 256], prompt_logprobs=True)])
            assert out.error is None
            logprobs += out.prompt_logprobs
        engine.close()
        return perplexity(logprobs)

    base = ppl(None, "auto")
    assert math.isfinite(base) and base < 30
    for (quantization, kv), tolerance in PERPLEXITY_TOLERANCE.items():
        assert ppl(quantization, kv) <= base * (1 + tolerance), (quantization, kv)
