import pytest

from metronome import ConfigError, EngineConfig, KVPolicy


def test_position_mode_defaults_follow_the_window():
    assert KVPolicy(window=1024).positions == "rebased"
    assert KVPolicy(window=None).positions == "absolute"


@pytest.mark.parametrize("kwargs", [
    dict(block_size=12), dict(block_size=0), dict(sinks=-1), dict(window=0),
    dict(positions="relative"), dict(window=None, positions="rebased"), dict(rebase_every=0),
])
def test_bad_policies_are_refused_with_a_clear_error(kwargs):
    with pytest.raises(ConfigError):
        KVPolicy(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(dtype="int4"), dict(num_blocks=1), dict(max_chunk_tokens=0),
    dict(max_chunk_tokens=512, max_batch_tokens=256), dict(kv_memory_fraction=0.0), dict(attention="flash"),
    dict(quantization="int8"), dict(quantization="FP8"), dict(kv_cache_dtype="bfloat16"), dict(kv_cache_dtype=None),
])
def test_bad_engine_configs_are_refused(kwargs):
    with pytest.raises(ConfigError):
        EngineConfig(**kwargs)
