"""The engine on a CUDA device (both attention backends) against transformers; skipped without a GPU."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from tests.engine.oracle import Transcript, hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("attention", ["triton", "torch"])
def test_cuda_engine_matches_the_windowed_oracle(checkpoints, attention):
    path, model = checkpoints["qwen2"]
    sinks, window = 4, 24
    engine = Engine(EngineConfig(model=path, device="cuda", attention=attention, num_blocks=300,
                                 max_chunk_tokens=32, max_batch_tokens=128,
                                 policy=KVPolicy(sinks=sinks, window=window, block_size=16, positions="absolute")))
    assert_follows_oracle(engine, model, sinks, window, sessions=3, steps=10, vocab=128, seed=5)


def assert_follows_oracle(engine, model, sinks, window, *, sessions, steps, vocab, seed):
    """Random chunks of ids below ``vocab`` into ``sessions`` sessions for ``steps`` steps, three tokens decoded
    each; every session's tokens and prompt logprobs against transformers over the sink + window mask."""
    sids = [engine.open_session() for _ in range(sessions)]
    rng = random.Random(seed)
    transcripts = {s: Transcript() for s in sids}
    for _ in range(steps):
        chunks = {s: [rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for s in sids}
        outs = engine.step([StepInput(s, token_ids=chunks[s], max_new_tokens=3, prompt_logprobs=True) for s in sids])
        for s, out in zip(sids, outs):
            assert out.error is None and all(t < vocab for t in out.token_ids)
            transcripts[s].record(chunks[s], out)
    for transcript in transcripts.values():
        transcript.assert_matches(model, sinks, window, abs=1e-3)


@pytest.mark.parametrize("family", ["llama", "llama-tied"])
def test_a_vocabulary_off_the_head_alignment_decodes_as_transformers_does(tmp_path, family):
    """A vocabulary of 100 rows: the engine multiplies by a head padded to 128 rows (the weight and a tied
    embedding become views of it) and reads the logits of the 100; tokens and prompt logprobs follow
    transformers over the sink + window mask, with decode rounds in CUDA graphs."""
    from tests.conftest import make_checkpoint

    model = make_checkpoint(tmp_path, family, vocab_size=100)
    sinks, window = 4, 24
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", attention="triton", num_blocks=300,
                                 max_chunk_tokens=32, max_batch_tokens=128,
                                 policy=KVPolicy(sinks=sinks, window=window, block_size=16, positions="absolute")))
    padded = engine.model.aligned_head
    assert padded is not None and padded.shape[0] == 128 and not padded[100:].any()
    assert engine.model.head_weight().data_ptr() == padded.data_ptr()
    assert_follows_oracle(engine, model, sinks, window, sessions=2, steps=6, vocab=100, seed=3)
    engine.close()


def test_cuda_bf16_engine_follows_generate(checkpoints):
    path, model = checkpoints["llama"]
    engine = Engine(EngineConfig(model=path, device="cuda", dtype="bfloat16", num_blocks=100,
                                 max_chunk_tokens=32, max_batch_tokens=128,
                                 policy=KVPolicy(sinks=4, window=256, block_size=16, positions="absolute")))
    prompt = list(range(10, 30))
    sid = engine.open_session()
    out, = engine.step([StepInput(sid, token_ids=prompt, max_new_tokens=6)])
    # bf16 rounding may flip near-ties late in the continuation; the first tokens must agree.
    assert out.token_ids[:2] == hf_greedy(model, prompt, 2)


@pytest.mark.parametrize("window", [40, None])
def test_decode_graphs_replay_what_eager_computes(checkpoints, window):
    """Captured decode rounds (padded buckets, scratch slot) give the eager engine's tokens and logprobs;
    unbounded too, whose graph tables span the position limit and are staged cut to the live blocks."""
    path, _ = checkpoints["qwen3"]

    def run(graphs: bool):
        engine = Engine(EngineConfig(model=path, device="cuda", attention="triton", cuda_graphs=graphs,
                                     num_blocks=400, max_chunk_tokens=32, max_batch_tokens=256,
                                     policy=KVPolicy(sinks=4 if window else 0, window=window, block_size=16)))
        assert (engine.runner.graphs is not None) == graphs
        rng = random.Random(3)
        sids = [engine.open_session() for _ in range(5)]
        outs = []
        for step in range(12):
            live = sids[: 2 + step % 4]  # batch sizes 2..5 hit padded buckets
            outs.append(engine.step([StepInput(s, token_ids=[rng.randrange(128) for _ in range(rng.randint(1, 9))],
                                               max_new_tokens=4, prompt_logprobs=True) for s in live]))
        return outs

    eager, graphed = run(False), run(True)
    for a_step, b_step in zip(eager, graphed):
        for a, b in zip(a_step, b_step):
            assert a.token_ids == b.token_ids
            assert a.prompt_logprobs == pytest.approx(b.prompt_logprobs, abs=1e-4, nan_ok=True)


def test_one_row_embeds_replay_the_graphs_as_eager_computes(checkpoints):
    """One embeddings row per session (Moshi's frame per tick) runs on the decode graphs, equal to eager."""
    path, _ = checkpoints["llama"]

    def run(graphs: bool):
        engine = Engine(EngineConfig(model=path, device="cuda", attention="triton", cuda_graphs=graphs,
                                     num_blocks=400, max_chunk_tokens=32, max_batch_tokens=256,
                                     policy=KVPolicy(sinks=4, window=40, block_size=16)))
        gen = torch.Generator().manual_seed(5)
        hidden = engine.spec.hidden_size
        sids = [engine.open_session() for _ in range(3)]
        replays = []
        original = engine.runner.graphs.run if graphs else None
        if graphs:
            def counting(segments, input_ids=None):
                replays.append(len(segments))
                return original(segments, input_ids)
            engine.runner.graphs.run = counting
        outs = []
        for step in range(60):  # past the window: freed blocks, the window's wrap
            live = sids[: 1 + step % 3]
            rows = [(torch.randn(1, hidden, generator=gen) * 0.5) for _ in live]
            outs.append([o.hidden.float().cpu() for o in engine.step(
                [StepInput(s, embeds=r.to("cuda", torch.bfloat16), return_hidden=True) for s, r in zip(live, rows)])])
        return outs, replays

    (eager, _), (graphed, replays) = run(False), run(True)
    assert len(replays) == 60
    for a_step, b_step in zip(eager, graphed):
        for a, b in zip(a_step, b_step):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_pipelined_graph_rounds_with_stop_tokens_match_per_round_eager(checkpoints):
    """Greedy rounds with stop tokens (pipelined on the graphs, stops read a round late) give what eager rounds
    synchronised every round give (greedy-equivalent sampling, top_k = 1, takes the per-round path)."""
    from metronome import SamplingParams

    path, _ = checkpoints["llama"]

    def run(graphs: bool):
        engine = Engine(EngineConfig(model=path, device="cuda", attention="triton", cuda_graphs=graphs, seed=7,
                                     num_blocks=300, max_chunk_tokens=32, max_batch_tokens=256,
                                     policy=KVPolicy(sinks=4, window=40, block_size=16)))
        rng = random.Random(9)
        sids = [engine.open_session() for _ in range(4)]
        extra = {} if graphs else {"temperature": 1.0, "top_k": 1}
        params = [SamplingParams(stop_token_ids=(s,), **extra) for s in range(100, 128)]
        outs = []
        for step in range(8):
            outs.append(engine.step([StepInput(s, token_ids=[rng.randrange(128) for _ in range(5)], max_new_tokens=6,
                                               sampling=params[(step + i) % len(params)])
                                     for i, s in enumerate(sids)]))
        return outs

    for a_step, b_step in zip(run(False), run(True)):
        assert [o.token_ids for o in a_step] == [o.token_ids for o in b_step]
        assert [o.finished for o in a_step] == [o.finished for o in b_step]


def test_no_collection_runs_while_graphs_capture(checkpoints):
    """A collection mid-capture that frees another graph (here: an earlier engine dropped in a reference cycle)
    invalidates the capture and leaves the CUDA generator in capture mode for the rest of the process; that
    broke every later GPU test once on the H200. The collector is set to run at almost every allocation."""
    path, _ = checkpoints["qwen2"]
    config = EngineConfig(model=path, device="cuda", attention="triton", num_blocks=300, max_chunk_tokens=32,
                          max_batch_tokens=256, policy=KVPolicy(sinks=4, window=40, block_size=16))
    collections_while_capturing = []

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            collections_while_capturing.append(torch.cuda.is_current_stream_capturing())

    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()   # so that collecting at every allocation walks only this test's objects
    try:
        first = Engine(config)
        assert first.runner.graphs is not None
        cycle = [first]
        cycle.append(cycle)
        del first, cycle
        gc.callbacks.append(on_collection)
        gc.set_threshold(1, 1, 1)
        second = Engine(config)
    finally:
        gc.set_threshold(*thresholds)
        if on_collection in gc.callbacks:
            gc.callbacks.remove(on_collection)
        gc.unfreeze()
    assert collections_while_capturing and not any(collections_while_capturing)
    sid = second.open_session()
    (out,) = second.step([StepInput(sid, token_ids=[1, 2, 3], max_new_tokens=4)])
    assert out.error is None and len(out.token_ids) == 4
    torch.randn(4, device="cuda")   # the generator is not left in capture mode


def test_no_attention_kernel_compiles_after_start_up(checkpoints):
    """Every attention kernel variant and the re-rotation are compiled when the engine starts, not at their
    first use inside a step: a first launch compiles for about a second, and on the served path that was a
    one-off 1.4-s tick. Batches here go from one short prefill to long decode contexts that split the KV
    and rebase, with block tables of every width in between."""
    from metronome.attention import triton_paged
    from metronome.models import rope_triton

    def compiled() -> set[str]:
        kernels = (triton_paged._paged_attn_fwd, triton_paged._paged_attn_combine, rope_triton._rerotate_keys)
        return {f"{fn.fn.__name__}: {key}" for fn in kernels for entry in fn.device_caches.values() for key in entry[0]}

    path, _ = checkpoints["qwen2"]
    engine = Engine(EngineConfig(model=path, device="cuda", attention="triton", num_blocks=1200,
                                 max_chunk_tokens=64, max_batch_tokens=1024,
                                 policy=KVPolicy(sinks=4, window=320, block_size=16)))
    at_start = compiled()
    assert at_start
    rng = random.Random(11)
    sids = [engine.open_session() for _ in range(24)]
    for step in range(16):
        live = sids[: 1 + (step * 5) % 24]
        outs = engine.step([StepInput(s, token_ids=[rng.randrange(128) for _ in range(rng.choice([1, 3, 40, 64]))],
                                      max_new_tokens=8) for s in live])
        assert all(o.error is None for o in outs)
    # The first step is one session's short chunk (no split); by the end the windows are full and rebase, one
    # session alone in some steps (a one-row cos/sin table), and a few dozen programs per launch split the KV.
    assert max(engine.session_stats(s).num_tokens for s in sids) > 320 + 80
    assert compiled() - at_start == set(), f"compiled at start: {sorted(at_start)}"


def test_rebased_windows_on_cuda_match_the_cpu_engine(checkpoints):
    """Sessions whose windows rebase together (the Triton in-place re-rotation on CUDA) get the tokens and
    logprobs the CPU engine's gather/rotate/scatter gives, float32 on both."""
    path, _ = checkpoints["qwen2"]

    def engine(device: str) -> Engine:
        return Engine(EngineConfig(model=path, device=device, dtype="float32", num_blocks=400, max_chunk_tokens=40,
                                   max_batch_tokens=96, policy=KVPolicy(sinks=2, window=20, block_size=16,
                                                                        positions="rebased", rebase_every=4)))

    cuda, cpu = engine("cuda"), engine("cpu")
    pairs = [(cuda.open_session(), cpu.open_session()) for _ in range(3)]
    rng = random.Random(3)
    for _ in range(12):
        chunks = [[rng.randrange(128) for _ in range(rng.randint(1, 13))] for _ in pairs]
        on_gpu = cuda.step([StepInput(g, token_ids=c, max_new_tokens=3, prompt_logprobs=True)
                            for (g, _), c in zip(pairs, chunks)])
        on_cpu = cpu.step([StepInput(h, token_ids=c, max_new_tokens=3, prompt_logprobs=True)
                           for (_, h), c in zip(pairs, chunks)])
        for a, b in zip(on_gpu, on_cpu):
            assert a.token_ids == b.token_ids
            assert a.prompt_logprobs == pytest.approx(b.prompt_logprobs, abs=1e-3)
    bases = [cuda.session_stats(g).position_base for g, _ in pairs]
    assert min(bases) > 0 and len(set(bases)) > 1  # all moved, by different amounts


def test_a_step_returns_with_its_work_queued_and_its_timing_waits_for_it(checkpoints):
    """A prefill-only step does not wait for the device: behind a long kernel queued first, the stream still has
    work when the step returns; its hidden state, used in stream order, is the one a synchronised step gives; its
    timing is read from events once the work is done, and covers only the step (not the kernel before it)."""
    path, _ = checkpoints["llama"]
    engine = Engine(EngineConfig(model=path, device="cuda", num_blocks=100, max_chunk_tokens=32,
                                 policy=KVPolicy(sinks=4, window=64, block_size=16)))
    prompt = list(range(10, 30))
    want_sid, sid = engine.open_session(), engine.open_session()
    want, = engine.step([StepInput(want_sid, token_ids=prompt, return_hidden=True)])
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)   # one spinning kernel of about a second, queued before the step
    out, = engine.step([StepInput(sid, token_ids=prompt, return_hidden=True)])
    assert not torch.cuda.current_stream().query()
    assert 0 < engine.last_timing.prefill_ms < 500
    assert torch.cuda.current_stream().query()   # reading the timing waited for the step
    torch.testing.assert_close(out.hidden, want.hidden)
