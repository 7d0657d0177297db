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


AMX = "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
AVX2 = "flags\t\t: fpu sse2 avx avx2 fma\n"


@pytest.mark.parametrize("flags,device,dtype", [
    (AMX, "cpu", "bfloat16"), (AVX2, "cpu", "float32"),
    ("flags\t\t: avx2 avx512f avx512_bf16\n", "cpu", "bfloat16"),   # AVX512-BF16 without AMX (AMD Zen 4)
    (AMX, "cuda", "float32"),                                        # other devices: float32 unless asked
])
def test_auto_dtype_is_bf16_only_where_the_cpu_runs_it_natively(monkeypatch, tmp_path, flags, device, dtype):
    import metronome.config
    import metronome.cpu as cpu

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: Some CPU\n{flags}\nprocessor\t: 1\n")
    real = cpu.read_capability
    monkeypatch.setattr(cpu, "read_capability", lambda cpuinfo=str(info): real(cpuinfo))
    monkeypatch.setattr(metronome.config, "auto_dtype", cpu.auto_dtype)   # undo the tests' float32 default
    assert EngineConfig(device=device).dtype == dtype
    assert EngineConfig(device=device, dtype="auto").dtype == dtype
    for explicit in ("float32", "bfloat16"):                          # an explicit dtype always wins
        assert EngineConfig(device=device, dtype=explicit).dtype == explicit


def test_the_capability_line_names_the_cpu_and_its_bf16(tmp_path):
    from metronome.cpu import read_capability

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum\n{AMX}")
    line = read_capability(str(info)).describe()
    assert "Intel(R) Xeon(R) Platinum" in line and "AMX-BF16" in line and "native bf16" in line
    assert "no native bf16" in read_capability(str(tmp_path / "missing")).describe()


def test_the_cpu_kernels_are_refused_where_they_cannot_run():
    with pytest.raises(ConfigError, match="device is cuda"):
        EngineConfig(device="cuda", cpu_attention="kernel")
    with pytest.raises(ConfigError, match="fp8"):
        EngineConfig(quantization="fp8", cpu_linear="kernel")
    with pytest.raises(ConfigError, match="cpu_attention"):
        EngineConfig(cpu_attention="fast")
    assert EngineConfig(device="cuda").cpu_linear == "auto"     # auto never asks for the kernels off the CPU
