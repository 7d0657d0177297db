"""Which adapter and frame budget a checkpoint gets when the CLI is told ``--adapter auto``."""

import json

import pytest

from metronome.audio.registry import ADAPTERS, MODEL_TYPE_ADAPTERS, resolve_adapter


def checkpoint(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(tmp_path)


@pytest.mark.parametrize("model_type,adapter,budget", [
    ("moshi", "moshi", 80.0), ("minicpmo", "minicpm_o", 1000.0), ("qwen2_5_omni", "qwen2_5_omni", 2000.0),
    ("qwen3_omni_moe_thinker", "qwen3_omni", 2000.0), ("llama", "cascade", 500.0)])
def test_auto_follows_the_checkpoint_model_type(tmp_path, model_type, adapter, budget):
    assert resolve_adapter(checkpoint(tmp_path, model_type), "auto", None) == (adapter, budget)


def test_explicit_choices_win_and_unknown_ones_are_refused(tmp_path):
    path = checkpoint(tmp_path, "moshi")
    assert resolve_adapter(path, "energy", None) == ("energy", 2000.0)
    assert resolve_adapter(path, "auto", 40.0) == ("moshi", 40.0)
    with pytest.raises(ValueError, match="adapter must be"):
        resolve_adapter(path, "nope", None)


def test_unreadable_configs_and_packaged_names_fall_back_to_the_cascade(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert resolve_adapter(str(tmp_path), "auto", None) == ("cascade", 500.0)
    assert resolve_adapter("smollm2-135m", "auto", None) == ("cascade", 500.0)


def test_every_mapped_adapter_is_registered():
    assert set(MODEL_TYPE_ADAPTERS.values()) <= set(ADAPTERS)
