"""The models benchmark's code path, at tiny shapes on the CPU (``--smoke``), and its real shapes."""

import json

import pytest

import torch

from bench.models_gpu import MODELS, main, parse, weight_count
from bench.models_gpu import QWEN2_5_OMNI as SHAPES
from bench.models_gpu import qwen2_5_omni_config as omni_config
from metronome.models.fp8 import Fp8Linear


def test_smoke_run_reports_the_tick_split_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    results = main(["--model", "qwen2_5_omni", "--smoke", "--sessions", "1,3"])
    written = json.loads((tmp_path / "models_qwen2_5_omni.json").read_text())
    rows = written["rows"]
    assert [r["N"] for r in rows] == [1, 3]                # CPU times say nothing: the smoke sweep never stops
    fit = [r["N"] for r in rows if r["tick_ms"] <= written["limit_ms"]]
    assert written["capacity_at_0.3B"] == results["capacity_at_0.3B"] == max(fit, default=0)
    for r in rows:
        assert r["input_rows"] == 52                       # <|audio_bos|> + 50 embeddings of 2 s + <|audio_eos|>
        assert 0 < r["features_ms"] <= r["encoder_ms"] < r["tick_ms"]
        assert r["prefill_ms"] > 0 and r["decode_ms"] > 0
        assert r["tick_ms"] >= r["encoder_ms"] + r["prefill_ms"] * 0.5


def encoder(arm):
    return arm.frontend.encoder


@pytest.mark.parametrize("model, tower", [("qwen2_5_omni", encoder), ("qwen3_omni", encoder),
                                          ("minicpm_o", lambda arm: arm.tower)])
def test_fp8_quantises_the_audio_tower_as_the_worker_does_unless_bf16_tower(model, tower):
    towers = []
    for extra in ([], ["--bf16-tower"]):
        args = parse(["--model", model, "--smoke", "--quantization", "fp8", "--layer-tokens", "", *extra])
        arm = MODELS[model].arm(args, torch.device("cpu"))
        towers.append(tower(arm))
        arm.close()
    fp8, plain = towers
    assert any(isinstance(m, Fp8Linear) for m in fp8.modules())
    assert not any(isinstance(m, Fp8Linear) for m in plain.modules())
    assert weight_count(fp8) == weight_count(plain) > 0      # the E4M3 codes are counted as weights


def test_the_real_shape_is_the_published_7b_thinker():
    from metronome.models.omni.qwen2_5_omni import text_spec

    spec = text_spec(omni_config("qwen2.5-omni-7b"))
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == \
        (28, 3584, 28, 4, 128)
    assert (spec.intermediate_size, spec.vocab_size, spec.qkv_bias, spec.tie_word_embeddings) == \
        (18944, 152064, True, False)
    audio = SHAPES["qwen2.5-omni-7b"]["audio"]
    assert (audio["encoder_layers"], audio["d_model"], audio["encoder_attention_heads"], audio["encoder_ffn_dim"],
            audio["num_mel_bins"], audio["output_dim"]) == (32, 1280, 20, 5120, 128, 3584)
    # transformers documents its Qwen2.5-Omni config defaults as the 7B checkpoint's: a second source.
    from transformers import Qwen2_5OmniAudioEncoderConfig, Qwen2_5OmniTextConfig

    text, ours = Qwen2_5OmniTextConfig(), SHAPES["qwen2.5-omni-7b"]["text"]
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads")
    assert all(getattr(text, k) == ours[k] for k in keys)
    assert text.rope_parameters["rope_theta"] == ours["rope_theta"]
    default_audio = Qwen2_5OmniAudioEncoderConfig()
    assert all(getattr(default_audio, k) == v for k, v in audio.items())


@pytest.mark.parametrize("model, rows_key, prefix, split", [
    ("qwen3_omni", "sweep", "median_", ("encoder_ms", "prefill_ms", "decode_ms")),
    ("minicpm_o", "sweep", "", ("encoder_ms", "prefill_ms", "decode_ms")),
    ("moshi", "rows", "", ("encoder_ms", "mimi_encode_ms", "prefill_ms", "depth_ms", "mimi_decode_ms")),
])
def test_every_model_runs_its_smoke_shape_and_writes_its_rows(tmp_path, capsys, model, rows_key, prefix, split):
    out = tmp_path / "raw.json"
    main(["--model", model, "--smoke", "--sessions", "1,2", "--out", str(out)])
    assert "capacity (tick <=" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["model"] == model and written["shape"] == "smoke"
    assert [r["N"] for r in written[rows_key]] == [1, 2]
    assert written["capacity_at_0.3B"] in (0, 1, 2)
    for r in written[rows_key]:
        assert r[f"{prefix}tick_ms"] >= r[f"{prefix}prefill_ms"] > 0 and all(r[f"{prefix}{k}"] > 0 for k in split)
        assert len(r["ticks"]) == 1
    if model == "qwen3_omni":
        assert all(r["prefill_rows"] == 28 for r in written[rows_key])   # <|audio_start|> + 26 rows (2 s) + end
        assert {"torch_ms", "loop_ms"} <= set(written["moe_layer"][0])
        assert written["compare"] and {"loop", "torch"} <= set(written["compare"][0])
    if model == "minicpm_o":
        assert written["budget_ms"] == 1000.0
        assert all(r["prefill_tokens_per_session"] == 12 for r in written[rows_key])   # 10 pooled rows + markers
    if model == "moshi":
        # every session spoke one 80-ms frame of PCM16 at 24 kHz each measured tick
        assert all(t["audio_bytes"] == 2 * 1920 for r in written[rows_key] for t in r["ticks"])


def test_profile_adds_the_profiled_ticks_at_the_chosen_n_only(tmp_path):
    out = tmp_path / "raw.json"
    main(["--model", "moshi", "--smoke", "--sessions", "1,2", "--profile", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert "profile" not in rows[0]
    profile = rows[1]["profile"]
    assert len(profile["tick_ms"]) == 1 and profile["tick_ms"][0] > 0
    assert profile["kernels"] == [] and profile["kernel_ms_per_tick"] == 0   # the CPU launches no kernels
    assert profile["idle"] == {"uncovered_ms_per_tick": 0, "idle_ms_per_tick": 0, "gaps": []}


def test_idle_gaps_are_the_stretches_no_kernel_covers_named_by_their_neighbours():
    from bench.models_gpu import idle_gaps

    # µs: "b" runs inside "a" (no gap), 10 µs before "c" is under the floor, then 500 µs idle before "d".
    first = [(0, 100, "a"), (20, 60, "b"), (110, 200, "c"), (700, 800, "d")]
    second = [(0, 100, "c"), (1100, 1200, "d"), (1300, 1400, "a")]   # 1 ms idle, then 100 µs
    idle = idle_gaps([first, second], floor_us=20)
    assert idle["gaps"] == [{"between": "c -> d", "ms_per_tick": 0.75, "per_tick": 1.0},
                            {"between": "d -> a", "ms_per_tick": 0.05, "per_tick": 0.5}]
    assert idle["idle_ms_per_tick"] == 0.8
    assert idle["uncovered_ms_per_tick"] == 0.805   # the 10 µs under the floor too
    assert idle_gaps([[]]) == {"uncovered_ms_per_tick": 0, "idle_ms_per_tick": 0, "gaps": []}


def test_kernel_names_keep_what_tells_torchs_elementwise_kernels_apart():
    from bench.models_gpu import kernel_group

    add = ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, "
           "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)")
    copy = "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(int)"
    assert "CUDAFunctor_add" in kernel_group(add) and kernel_group(add) != kernel_group(copy)
    assert kernel_group("_paged_attn_fwd") == "_paged_attn_fwd"
    softmax = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, float const*, int)"
    assert kernel_group(softmax) == "at::native::cunn_SoftMaxForward<4, float>"
    assert kernel_group("void cutlass::Kernel2<cutlass_80_tensorop_s16816gemm>(Params)") == "cutlass::Kernel2"


def test_fp8_decoders_are_made_a_layer_at_a_time_as_the_engine_would_quantise_them():
    """``random_decoder(each_layer=quantize_layers_)`` (what ``--quantization fp8`` builds, so Qwen3-Omni fits an
    80 GB card): each layer is E4M3 when handed over, and the model holds what the whole bf16 model quantised by
    the engine holds, tensor for tensor in name, shape and dtype; the engine's pass then changes nothing."""
    from bench.models_gpu import QWEN3_OMNI, qwen3_omni_spec
    from metronome.experiments.random_weights import random_decoder
    from metronome.models.fp8 import quantize_decoder_, quantize_layers_
    from metronome.models.moe import MoeForCausalLM

    spec = qwen3_omni_spec(QWEN3_OMNI["smoke"]["text"])
    handed = []

    def quantised(layer):
        quantize_layers_(layer)
        handed.append(sorted(type(m).__name__ for m in layer.modules() if isinstance(m, (torch.nn.Linear, Fp8Linear))))

    made = random_decoder(MoeForCausalLM, spec, "cpu", torch.bfloat16, per_expert=False, each_layer=quantised)
    whole = quantize_decoder_(random_decoder(MoeForCausalLM, spec, "cpu", torch.bfloat16, per_expert=False))
    assert len(handed) == spec.num_layers
    for names in handed:    # attention's qkv and o in E4M3; the router (nn.Linear) kept
        assert names == ["Fp8Linear", "Fp8Linear", "Linear"]
    layout = lambda net: {k: (tuple(v.shape), v.dtype) for k, v in net.state_dict().items()}   # noqa: E731
    assert layout(made) == layout(whole)
    assert any(v.dtype == torch.float8_e4m3fn for v in made.state_dict().values())
    before = {k: v.data_ptr() for k, v in made.state_dict().items()}
    quantize_decoder_(made)
    assert {k: v.data_ptr() for k, v in made.state_dict().items()} == before
