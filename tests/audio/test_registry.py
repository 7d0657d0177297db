"""Which adapter a checkpoint gets when the CLI is told ``--adapter auto``, and the frame budget B it runs at."""

import json

import pytest

from metronome.audio.registry import ADAPTERS, MODEL_TYPE_ADAPTERS, default_budget_ms, resolve_adapter
from metronome.config import EngineConfig
from metronome.cpu import auto_dtype
from metronome.serving.worker import WorkerConfig


def checkpoint(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(tmp_path)


@pytest.mark.parametrize("model_type,adapter,budget", [
    ("moshi", "moshi", 80.0), ("minicpmo", "minicpm_o", 1000.0), ("qwen2_5_omni", "qwen2_5_omni", 2000.0),
    ("qwen3_omni_moe_thinker", "qwen3_omni", 2000.0), ("llama", "cascade", 250.0)])
def test_auto_follows_the_checkpoint_model_type(tmp_path, model_type, adapter, budget):
    assert resolve_adapter(checkpoint(tmp_path, model_type), "auto") == adapter
    assert default_budget_ms(adapter, device="cuda", dtype="bfloat16") == budget


def test_explicit_choices_win_and_unknown_ones_are_refused(tmp_path):
    path = checkpoint(tmp_path, "moshi")
    assert resolve_adapter(path, "energy") == "energy"
    with pytest.raises(ValueError, match="adapter must be"):
        resolve_adapter(path, "nope")
    with pytest.raises(ValueError, match="adapter must be"):
        default_budget_ms("nope", device="cpu", dtype="float32")


def test_unreadable_configs_and_packaged_names_fall_back_to_the_cascade(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert resolve_adapter(str(tmp_path), "auto") == "cascade"
    assert resolve_adapter("smollm2-135m", "auto") == "cascade"


@pytest.mark.parametrize("device,dtype,budget", [
    ("cpu", "float32", 500.0), ("cpu", "bfloat16", 250.0), ("cuda", "float32", 250.0), ("cuda:1", "bfloat16", 250.0)])
def test_the_cascade_waits_longer_only_for_a_float32_engine_on_a_cpu(device, dtype, budget):
    assert default_budget_ms("cascade", device=device, dtype=dtype) == budget
    worker = WorkerConfig(engine=EngineConfig(device=device, dtype=dtype), adapter="cascade")
    assert worker.budget_ms == budget and worker.aimd.budget_ms == budget
    assert WorkerConfig(engine=EngineConfig(device=device, dtype=dtype), adapter="cascade", budget_ms=700).budget_ms == 700
    assert WorkerConfig(engine=EngineConfig(device=device, dtype=dtype), adapter="energy").budget_ms == 2000.0


def test_auto_takes_the_dtype_the_engine_picked():
    engine = EngineConfig(dtype="auto")   # float32 under the tests' fixture, whatever this CPU has
    assert WorkerConfig(engine=engine, adapter="cascade").budget_ms == (500.0 if engine.dtype == "float32" else 250.0)
    assert default_budget_ms("cascade", device="cpu", dtype="auto") == (500.0 if auto_dtype("cpu") == "float32"
                                                                         else 250.0)


def test_every_mapped_adapter_is_registered():
    assert set(MODEL_TYPE_ADAPTERS.values()) <= set(ADAPTERS)
