"""Random-weight decoders in real shapes (the GPU presets' model): the directory, the engine, the server."""

import asyncio
import json
from pathlib import Path

import pytest

from metronome.experiments import shapes
from metronome.experiments.loadgen import LoadRun
from metronome.experiments.server import start
from metronome.experiments.sweep import prepare_model

TINY_QWEN2 = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=50000, rope_theta=10000.0,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu")


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(shapes.SHAPES, "tiny-qwen2", TINY_QWEN2)
    return "tiny-qwen2"


def test_the_7b_shape_directory_reads_as_qwen2_5_7b(tmp_path):
    from metronome.models.loader import load_spec

    path = shapes.make_shape_checkpoint(tmp_path / "q7", "qwen2.5-7b")
    spec = load_spec(Path(path))
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (28, 4, 128, 152064)
    assert not list((tmp_path / "q7").glob("*.safetensors"))        # nothing but config and tokenizer
    assert json.loads((tmp_path / "q7" / "tokenizer_config.json").read_text())


def test_unknown_shape_and_missing_tokenizer_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown shape 'nope'"):
        shapes.make_shape_checkpoint(tmp_path / "x", "nope")
    monkeypatch.setenv(shapes.TOKENIZER_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        shapes.make_shape_checkpoint(tmp_path / "y", "qwen2.5-7b")


def test_prepare_model_passes_names_through_and_marks_random_shapes(tmp_path, tiny_shape):
    assert prepare_model("smollm2-135m", str(tmp_path), 2048) == {"model": "smollm2-135m"}
    prepared = prepare_model(f"random:{tiny_shape}", str(tmp_path), 2048)
    assert prepared["random_weights"] is True
    assert json.loads((tmp_path / tiny_shape / "config.json").read_text())["hidden_size"] == 64


def test_random_engine_has_the_shape_and_the_tokenizer(tmp_path, tiny_shape):
    from metronome.config import EngineConfig, KVPolicy
    from metronome.engine.request import StepInput

    path = shapes.make_shape_checkpoint(tmp_path / "m", tiny_shape)
    cfg = EngineConfig(model=path, policy=KVPolicy(sinks=4, window=32), device="cpu", dtype="float32", num_blocks=64)
    engine = shapes.random_engine(cfg, path)
    assert engine.model.spec.vocab_size == 50000 and engine.model.spec.num_layers == 2
    ids = engine.tokenizer.encode("hello there", add_special_tokens=False)
    sid = engine.open_session()
    (out,) = engine.step([StepInput(sid, token_ids=ids, max_new_tokens=3)])
    assert out.error is None and len(out.token_ids) == 3
    assert all(0 <= t < 50000 for t in out.token_ids)


async def test_server_serves_a_random_shape_through_the_gateway(tmp_path, tiny_shape):
    """The experiments' server with ``random_weights``: two speech-less clients get ticks with tokens."""
    prepared = prepare_model(f"random:{tiny_shape}", str(tmp_path), 2048)
    spec = dict(device="cpu", dtype="float32", sinks=4, window=32, block_size=16, num_blocks=128,
                max_chunk_tokens=32, budget_ms=250.0, tokens_per_tick=2, sessions=2, seed=0, **prepared)
    worker, server, gateway = await start(spec)
    try:
        result = await asyncio.wait_for(
            LoadRun(gateway=gateway, worker=worker.address, sessions=2, rate=10.0, duration_s=2.0,
                    sample_s=0.5, audio="noise").run(), timeout=30)
    finally:
        await server.stop()
        await worker.stop(0)
    ticks = [t for s in result["sessions"] for t in s["ticks"]]
    assert all(s["refused"] is None and not s["errors"] for s in result["sessions"])
    assert len(ticks) >= 8 and not any(t[5] for t in ticks)          # ~8 ticks each, none preempted
    assert max(k["used"] for k in result["kv"]) > 0
