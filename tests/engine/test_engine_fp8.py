"""The engine with an FP8 KV cache (``kv_cache_dtype="fp8"``): pool sizing at one byte an element, the scales the
first forward calibrates, and whole sessions (sinks, windows, freed NaN blocks, rebased windows) against the
float64 windowed oracle (transformers) and against the same engine with float pages."""

from __future__ import annotations

import random

import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.attention.fp8 import E4M3, E4M3_MAX, KV_SCALE_HEADROOM
from tests.engine.oracle import hf_windowed_logprobs

# E4M3 keys and values move the tiny models' log-probabilities (|log p| ~ 5) by 0.004-0.012 here.
LOGPROB_BOUND = 0.03


def make_engine(path, kv="fp8", attention="torch", num_blocks=200, dtype="float32", **policy):
    policy = {"sinks": 3, "window": 13, "block_size": 4, "positions": "absolute", **policy}
    return Engine(EngineConfig(model=path, kv_cache_dtype=kv, attention=attention, num_blocks=num_blocks,
                               dtype=dtype, max_chunk_tokens=24, max_batch_tokens=64, policy=KVPolicy(**policy)))


def drive(engine, rng, steps, poison=False):
    """Two sessions over ``steps`` steps; returns the first one's tokens and the log-probabilities it got."""
    sid, other = engine.open_session(), engine.open_session()
    tokens, logprobs = [], []
    for _ in range(steps):
        chunk = [rng.randrange(128) for _ in range(rng.randint(1, 12))]
        out, _ = engine.step([StepInput(sid, token_ids=chunk, max_new_tokens=2, prompt_logprobs=True),
                              StepInput(other, token_ids=[rng.randrange(128)], max_new_tokens=1)])
        logprobs += [(len(tokens) + i, lp) for i, lp in enumerate(out.prompt_logprobs) if lp is not None]
        tokens += chunk + out.token_ids
        if poison:  # freed blocks read back as NaN (0x7f in E4M3) if anything ever touched them
            free = torch.tensor(engine.scheduler.pool.free_block_ids(), dtype=torch.long)
            for k, v, _ in engine.runner.kv_caches:
                k.view(torch.uint8)[free] = 0x7F
                v.view(torch.uint8)[free] = 0x7F
    return tokens, logprobs


def test_pool_holds_twice_the_blocks_at_the_same_memory(llama, monkeypatch):
    path, _ = llama
    monkeypatch.setattr("metronome.engine.engine.available_memory_bytes", lambda device: 64 << 20)
    stats = {}
    for kv in ("auto", "fp8"):
        engine = Engine(EngineConfig(model=path, dtype="bfloat16", kv_cache_dtype=kv, kv_memory_fraction=0.5,
                                     policy=KVPolicy(sinks=4, window=64, block_size=16)))
        assert engine.runner.kv_caches[0][0].dtype == (E4M3 if kv == "fp8" else torch.bfloat16)
        assert engine.runner.kv_caches[0][0].shape[0] == engine.stats().kv_blocks_total + 2  # null + scratch
        stats[kv] = engine.stats()
        engine.close()
    bf16, fp8 = stats["auto"], stats["fp8"]
    assert bf16.kv_bytes_per_block == 2 * fp8.kv_bytes_per_block == 2 * 2 * 2 * 2 * 16 * 16  # K+V, layers, heads, dim
    assert fp8.kv_blocks_total == 2 * bf16.kv_blocks_total
    assert fp8.blocks_per_session == bf16.blocks_per_session  # the reservation formula does not change
    assert fp8.capacity == fp8.kv_blocks_total // fp8.blocks_per_session >= 2 * bf16.capacity


def test_each_layers_scales_start_16_bytes_aligned(tmp_path):
    """Three KV heads give 6 scales (24 bytes) a layer: packed end to end, every other layer's would start 8 bytes
    off the alignment Triton specialises pointers on, and compile kernels of its own in the first tick."""
    from tests.conftest import make_checkpoint

    make_checkpoint(tmp_path, "llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    runner = make_engine(str(tmp_path)).runner
    assert runner.kv_scales.shape == (2, 2, 3)
    for layer in range(2):
        scales = runner.kv_caches[layer][2]
        assert scales.is_contiguous() and scales.shape == (2, 3) and scales.data_ptr() % 16 == 0


def test_first_forward_calibrates_the_scales(llama):
    path, _ = llama
    engine = make_engine(path)
    runner = engine.runner
    assert runner.kv_scales.shape == (2, 2, 2) and (runner.kv_scales == 1).all() and not runner.kv_calibrated
    sid = engine.open_session()
    engine.step([StepInput(sid, token_ids=list(range(5, 25)))])
    assert runner.kv_calibrated and torch.isfinite(runner.kv_scales).all() and (runner.kv_scales != 1).all()
    # Every head's largest first-forward element maps to 448 / headroom; the scales stay fixed afterwards.
    slots = torch.tensor([engine.scheduler.sessions[sid].physical(j // 4) * 4 + j % 4 for j in range(20)])
    for k, v, _ in runner.kv_caches:
        for cache in (k, v):
            stored = cache.view(-1, 2, 16)[slots].float().abs().amax((0, 2))
            torch.testing.assert_close(stored, torch.full((2,), E4M3_MAX / KV_SCALE_HEADROOM), rtol=2 ** -4, atol=0)
    before = runner.kv_scales.clone()
    engine.step([StepInput(sid, token_ids=list(range(40, 60)), max_new_tokens=3)])
    assert torch.equal(runner.kv_scales, before)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_sessions_match_the_windowed_oracle(checkpoints, family):
    """Sinks, a window ending mid-block, chunks and decode, freed blocks poisoned with NaN, two sessions."""
    path, model = checkpoints[family]
    tokens, logprobs = drive(make_engine(path), random.Random(11), 7, poison=True)
    assert len(tokens) > 3 * 13
    ref = hf_windowed_logprobs(model, tokens, 3, 13)
    error = max(abs(lp - ref[pos - 1, tokens[pos]].item()) for pos, lp in logprobs)
    assert 0 < error <= LOGPROB_BOUND


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path (CUDA: test_engine_fp8_cuda.py)")
def test_triton_kernel_matches_the_reference_backend(checkpoints):
    """The same session through the Triton kernel (interpreted) and the torch reference: the same calibrated
    scales and pages, so the two differ only by float32 summation order."""
    path, _ = checkpoints["qwen3"]
    got = [drive(make_engine(path, attention=a), random.Random(5), 4) for a in ("torch", "triton")]
    assert got[0][0] == got[1][0]
    torch.testing.assert_close(torch.tensor([lp for _, lp in got[1][1]]), torch.tensor([lp for _, lp in got[0][1]]),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cpu_decode_rounds_over_e4m3_pages_attend_in_the_window_as_the_reference_does(checkpoints, dtype):
    """On the CPU the decode rounds over E4M3 pages go through the step's decode window (codes gathered once, the
    scales applied by the C kernel, or by SDPA for a float16 model, which the kernel does not take); the same sessions
    through the reference (every round gathered and dequantised) get the same tokens and, up to sums, the same
    log-probabilities."""
    path, _ = checkpoints["qwen3"]
    runs = []
    for windowed in (True, False):
        engine = make_engine(path, dtype=dtype)
        assert engine.runner.decode_window is not None
        assert (engine.runner.decode_window.kernel is None) == (dtype == "float16")
        if not windowed:
            engine.runner.decode_window = None
        runs.append(drive(engine, random.Random(5), 6))
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(torch.tensor([lp for _, lp in runs[0][1]]), torch.tensor([lp for _, lp in runs[1][1]]),
                               atol=1e-4, rtol=1e-4)


def test_rebased_windows_rotate_fp8_keys(checkpoints):
    """Rebasing re-rotates stored E4M3 keys in place (the per-head scale stays: rotation is linear); the session
    stays within the E4M3 bound of the same engine with float pages."""
    path, _ = checkpoints["llama"]
    policy = dict(positions="rebased", rebase_every=8)
    runs = []
    for kv in ("auto", "fp8"):
        engine = make_engine(path, kv=kv, **policy)
        runs.append(drive(engine, random.Random(3), 8))
        assert any(s.position_base > 0 for s in engine.scheduler.sessions.values())  # windows did move
    assert runs[0][0][:20] == runs[1][0][:20]
    error = max(abs(a - b) for (_, a), (_, b) in zip(runs[0][1], runs[1][1]))
    assert 0 < error <= LOGPROB_BOUND


def test_rerotation_kernel_saturates_fp8_keys():
    """The Triton re-rotation (interpreted) of E4M3 keys equals rotating the dequantised codes and rounding
    back, saturating at ±448 where a rotated pair leaves the range."""
    pytest.importorskip("triton")
    from metronome.models.rope import Rotary
    from metronome.models.rope_triton import rerotate_keys_

    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled there, else interpreted
    g = torch.Generator().manual_seed(0)
    keys = (torch.randn(6, 2, 16, generator=g) * 100).to(E4M3)
    keys[0, 0, 0] = keys[0, 0, 8] = 448.0  # this pair rotates out of range
    rotary = Rotary(tuple((1e4 ** (-torch.arange(0, 16, 2) / 16)).tolist()), 1.0, "cpu")
    cos, sin = rotary.shift_tables(torch.tensor([-37, 5]))
    slots, rows = torch.tensor([1, 2, 0]), torch.tensor([0, 0, 1], dtype=torch.int32)
    want = rotary.apply(keys[slots].float(), cos[rows.long()], sin[rows.long()]).clamp(-448, 448).to(E4M3)
    keys = keys.to(device)
    rerotate_keys_(keys, slots.to(device), rows.to(device), cos[:, :8].contiguous().to(device),
                   sin[:, :8].contiguous().to(device))
    keys = keys.cpu()
    assert torch.equal(keys[slots].float(), want.float())
    assert keys[0, 0].float().abs().max() == 448
