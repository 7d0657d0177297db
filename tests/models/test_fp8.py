"""FP8 weights on the CPU: E4M3 rounding bounds, the FP8 linear layer, the vLLM / Hugging Face FP8 checkpoint
layouts, and tiny decoders quantised at load, against transformers' own models (fp32, or with the weights the
test dequantises itself)."""

from __future__ import annotations

import copy
import doctest
import json
import math
import re

import pytest
import torch
from safetensors.torch import save_file

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.attention import fp8 as attention_fp8
from metronome.attention.metadata import PagedAttentionMetadata
from metronome.attention.reference import TorchPagedAttention
from metronome.models import fp8
from metronome.models.fp8 import Fp8Linear, dequantize, quantize, quantize_decoder_, row_scales
from metronome.models.loader import load_model
from tests.conftest import make_checkpoint

E4M3 = torch.float8_e4m3fn
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
# E4M3 weights move the logits of the tiny random decoders (|logit| <= 0.61) by 0.016-0.033 from fp32 (every
# layout, every family here); the stated bound leaves room for the seeds.
LOGIT_BOUND = 0.05


def test_doctests():
    assert doctest.testmod(fp8).failed == 0
    assert doctest.testmod(attention_fp8).failed == 0


@pytest.mark.parametrize("group", [None, 32, 48])
def test_round_trip_within_the_e4m3_bound(group):
    """Every element within half an E4M3 step of itself: 2**-4 relative in the normal range, 2**-10 of the scale
    below it; rows that are all zero stay zero; the largest element of each row maps to 448 (exact but for the
    float32 rounding of amax / 448)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 100, generator=g) * torch.logspace(-3, 2, 24)[:, None]  # five decades of row scales
    w[:, 7] *= 1000  # an outlier column
    w[3] = 0
    codes, scale = quantize(w, group)
    assert codes.dtype == E4M3 and scale.dtype == torch.float32
    assert scale.shape == (24, 1 if group is None else math.ceil(100 / group))
    back = dequantize(codes, scale, group or 100)
    s = scale.repeat_interleave(group or 100, 1)[:, :100]
    assert torch.isfinite(back).all() and (back[3] == 0).all()
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2 ** -4, s * 2 ** -10)).all()
    torch.testing.assert_close(back.abs().amax(1), w.abs().amax(1), rtol=1e-6, atol=0)


def test_fp8_linear_on_the_cpu_is_the_dequantised_product():
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(96, 40, bias=True)
    x = torch.randn(5, 96, generator=g)
    for group in (None, 32):
        layer = Fp8Linear.from_linear(linear, group)
        assert not layer.tensor_cores
        want = torch.nn.functional.linear(x, dequantize(layer.weight, layer.weight_scale, group or 96), linear.bias)
        assert torch.equal(layer(x), want)


def test_quantize_linears_swaps_every_linear_but_the_skipped_and_leaves_fp8_ones():
    g = torch.Generator().manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(),
                              torch.nn.Sequential(torch.nn.Linear(48, 16, bias=False), torch.nn.Linear(16, 8)))
    x = torch.randn(4, 32, generator=g)
    want = [m.weight.detach().clone() for m in (net[0], net[2][0])]
    swapped = fp8.quantize_linears_(net, skip=lambda path, layer: path == "2.1")
    assert swapped == [net[0], net[2][0]] and all(isinstance(m, Fp8Linear) for m in swapped)
    assert type(net[2][1]) is torch.nn.Linear and net[2][0].bias is None
    for layer, w in zip(swapped, want):   # each layer's own weight, within the E4M3 bound
        assert ((layer.dequantized() - w).abs() <= w.abs() * 2 ** -4 + layer.weight_scale * 2 ** -10).all()
    out = net(x)
    assert fp8.quantize_linears_(net, skip=lambda path, layer: path == "2.1") == []   # FP8 layers are left alone
    assert torch.equal(net(x), out)


def test_fused_layers_concatenate_any_layouts():
    g = torch.Generator().manual_seed(2)
    parts = [torch.nn.Linear(64, n, bias=True) for n in (48, 16, 16)]
    for p in parts:
        torch.nn.init.normal_(p.weight, generator=g)
    mixed = [Fp8Linear.from_linear(parts[0], 32), Fp8Linear.from_linear(parts[1]), parts[2]]  # block, channel, float
    fused = Fp8Linear.concat(mixed)
    assert fused.group == 32 and fused.weight_scale.shape == (80, 2)
    third = Fp8Linear.from_linear(parts[2], 32)
    want = torch.cat([mixed[0].dequantized(), mixed[1].dequantized(), third.dequantized()])
    assert torch.equal(fused.dequantized(), want)
    torch.testing.assert_close(fused.bias, torch.cat([p.bias for p in parts]))


def test_row_scales_of_every_checkpoint_layout():
    n, k = 5, 70
    per_tensor, group = row_scales(torch.tensor(0.5), n, k, None)
    assert torch.equal(per_tensor, torch.full((n, 1), 0.5)) and group == k
    assert torch.equal(row_scales(torch.arange(5.0)[:, None], n, k, None)[0], torch.arange(5.0)[:, None])
    blocks = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    rows, group = row_scales(blocks, n, k, (4, 32))
    assert group == 32 and torch.equal(rows, blocks[[0, 0, 0, 0, 1]])
    with pytest.raises(Exception, match="fits neither"):
        row_scales(torch.ones(3, 3), n, k, (4, 32))


# ----------------------------------------------------------------------------------- tiny decoders
def decoder_logits(net, ids: list[int]) -> torch.Tensor:
    """All-position logits of one sequence through the engine's decoder (one forward, reference attention)."""
    spec, t, bs = net.spec, len(ids), 64
    caches = [(torch.zeros(2, bs, spec.num_kv_heads, spec.head_dim), torch.zeros(2, bs, spec.num_kv_heads,
                                                                                  spec.head_dim))
              for _ in range(spec.num_layers)]
    meta = PagedAttentionMetadata(block_size=bs, sinks=0, window=None, sink_blocks=0, query_lens=[t], context_lens=[t],
                                  query_start=torch.tensor([0, t]), context_lens_t=torch.tensor([t]),
                                  block_tables=torch.tensor([[1]], dtype=torch.int32), window_first=torch.tensor([0]),
                                  slot_mapping=bs + torch.arange(t))
    attention = TorchPagedAttention(spec.num_heads)
    with torch.no_grad():
        hidden = net(net.embed(torch.tensor(ids)), torch.arange(t), caches, attention, attention.prepare(meta))
        return net.compute_logits(hidden)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _test_quantize(w: torch.Tensor, layout: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """The test's own E4M3 quantisation in a checkpoint layout: codes, the stored scale, the dequantised weight."""
    w = w.float()
    if layout == "per-tensor":
        s = w.abs().max() / 448
        return (w / s).to(E4M3), s.reshape(()), (w / s).to(E4M3).float() * s
    if layout == "per-channel":
        s = w.abs().amax(1, keepdim=True) / 448
        return (w / s).to(E4M3), s, (w / s).to(E4M3).float() * s
    (n, k), (bn, bk) = w.shape, block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    s = padded.abs().amax((1, 3)) / 448
    codes = (padded / s[:, None, :, None]).to(E4M3)
    deq = (codes.float() * s[:, None, :, None]).view(nb * bn, kb * bk)[:n, :k]
    return codes.view(nb * bn, kb * bk)[:n, :k].contiguous(), s, deq


def write_fp8_checkpoint(path, model, layout: str, block=(32, 32), lm_head: bool = False) -> dict:
    """Rewrite ``path`` (a saved transformers checkpoint of ``model``) as an FP8 checkpoint of ``layout``, as
    vLLM / Hugging Face store them; returns the state dict with the weights dequantised."""
    stored, deq = {}, {}
    for name, w in model.state_dict().items():
        if LINEAR.match(name) or (lm_head and name == "lm_head.weight"):
            codes, scale, back = _test_quantize(w, layout, block)
            prefix = name.removesuffix(".weight")
            stored[name] = codes
            stored[prefix + (".weight_scale_inv" if layout == "block" else ".weight_scale")] = scale
            stored[prefix + ".input_scale"] = torch.tensor(1.0)  # a static activation scale: unused here
            deq[name] = back
        else:
            stored[name], deq[name] = w.contiguous(), w
    for i in range(model.config.num_hidden_layers):  # calibrated KV scales some checkpoints carry: unused
        for kind in ("k_scale", "v_scale"):
            stored[f"model.layers.{i}.self_attn.{kind}"] = torch.tensor(1.0)
    for f in path.glob("*.safetensors*"):
        f.unlink()
    save_file(stored, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     **({"weight_block_size": list(block)} if layout == "block" else {})}
    (path / "config.json").write_text(json.dumps(config))
    return deq


@pytest.mark.parametrize("layout,family", [("per-tensor", "llama"), ("per-channel", "qwen2"), ("block", "qwen3")])
def test_fp8_checkpoints_load_and_match_transformers(tmp_path, layout, family):
    model = make_checkpoint(tmp_path, family, intermediate_size=80)  # 80: blocks of 32 end part-way
    deq = write_fp8_checkpoint(tmp_path, model, layout, lm_head=layout == "per-channel")
    net, _ = load_model(str(tmp_path), torch.float32, "cpu")
    qkv = net.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == E4M3
    assert qkv.weight_scale.shape[1] == (2 if layout == "block" else 1)
    assert isinstance(net.model.layers[1].mlp.down_proj, Fp8Linear)
    assert net.lm_head.weight.dtype == torch.float32  # an FP8 LM head loads dequantised
    dequantised = copy.deepcopy(model)
    dequantised.load_state_dict(deq)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    got = decoder_logits(net, ids)
    torch.testing.assert_close(got, hf_logits(dequantised, ids), atol=1e-4, rtol=1e-4)
    assert (got - hf_logits(model, ids)).abs().max() <= LOGIT_BOUND


def test_fp8_checkpoint_without_scales_is_refused(tmp_path):
    from metronome import ModelLoadError
    from safetensors.torch import load_file

    model = make_checkpoint(tmp_path, "llama")
    write_fp8_checkpoint(tmp_path, model, "per-channel")
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="up_proj"):
        load_model(str(tmp_path), torch.float32, "cpu")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_quantised_at_load_logits_close_to_fp32(tmp_path, family):
    model = make_checkpoint(tmp_path, family)
    net, _ = load_model(str(tmp_path), torch.float32, "cpu")
    quantize_decoder_(net)
    layer = net.model.layers[0]
    assert all(isinstance(m, Fp8Linear) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj))
    ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    want = hf_logits(model, ids)
    error = (decoder_logits(net, ids) - want).abs().max().item()
    assert 0 < error <= LOGIT_BOUND, error


def test_engine_greedy_tokens_with_fp8_weights(tmp_path):
    """Greedy decode with ``quantization="fp8"``: at every step the chosen token is within two logit bounds of the
    fp32 model's best (so wherever fp32's top two are further apart, the tokens are the same)."""
    model = make_checkpoint(tmp_path, "llama")
    engine = Engine(EngineConfig(model=str(tmp_path), quantization="fp8", num_blocks=100, max_chunk_tokens=32,
                                 policy=KVPolicy(sinks=4, window=200, block_size=8, positions="absolute")))
    assert isinstance(engine.model.model.layers[1].mlp.gate_up_proj, Fp8Linear)
    prompts = [[5, 6, 7], list(range(20, 41)), [9]]
    sids = [engine.open_session() for _ in prompts]
    outs = engine.step([StepInput(s, token_ids=p, max_new_tokens=8) for s, p in zip(sids, prompts)])
    same = 0
    for out, prompt in zip(outs, prompts):
        logits = hf_logits(model, prompt + out.token_ids[:-1])[len(prompt) - 1:]
        for row, token in zip(logits, out.token_ids):
            assert row.max() - row[token] <= 2 * LOGIT_BOUND
            same += int(row.argmax()) == token
    assert same >= 20  # of 24: where fp32's margin is wider than the bound, nothing may change



def test_products_by_row_count_layer_width_and_device():
    """Decode rounds stream the weight (E4M3 activations for wide layers or past ``WIDENED_MAX_ROWS`` rows, where
    there are FP8 tensor cores and bf16 activations), larger rounds take the tiled product, prefill goes to
    cuBLAS, the CPU dequantises."""
    from metronome.models.fp8 import STREAMED_MAX_ROWS, TILED_MAX_ROWS, WIDENED_MAX_ROWS, choose_product

    bf16, gpu = torch.bfloat16, dict(cuda=True, per_channel=True, fp8_tensor_cores=True, tiled=True)
    assert choose_product(1, 4096, 4096, bf16, **gpu) == "streamed-w8a16"                  # narrow: o, down
    assert choose_product(1, 4096, 24576, bf16, **gpu) == "streamed-w8a8"                   # wide: gate_up
    assert choose_product(WIDENED_MAX_ROWS, 4096, 4096, bf16, **gpu) == "streamed-w8a16"      # the boundaries
    assert choose_product(WIDENED_MAX_ROWS + 1, 4096, 4096, bf16, **gpu) == "streamed-w8a8"
    assert choose_product(1, 4096, 8192, bf16, **gpu) == "streamed-w8a8"                    # twice as wide
    assert choose_product(1, 4096, 8176, bf16, **gpu) == "streamed-w8a16"
    assert choose_product(STREAMED_MAX_ROWS, 4096, 4096, bf16, **gpu) == "streamed-w8a8"
    assert choose_product(STREAMED_MAX_ROWS + 1, 4096, 4096, bf16, **gpu) == "tiled-w8a8"
    assert choose_product(TILED_MAX_ROWS, 4096, 24576, bf16, **gpu) == "tiled-w8a8"
    assert choose_product(TILED_MAX_ROWS + 1, 4096, 4096, bf16, **gpu) == "scaled-mm"
    assert choose_product(STREAMED_MAX_ROWS + 1, 4096, 4096, bf16, **dict(gpu, tiled=False)) == "scaled-mm"  # Ada
    assert choose_product(STREAMED_MAX_ROWS + 1, 4096, 4100, bf16, **gpu) == "dequantized"  # not whole MMA tiles
    assert choose_product(40, 4096, 24576, torch.float16, **gpu) == "streamed-w8a16"
    no_fp8 = dict(gpu, fp8_tensor_cores=False)   # e.g. an A100: no E4M3 in Triton there, so no streamed product
    assert choose_product(1, 4096, 24576, bf16, **no_fp8) == "dequantized"
    assert choose_product(STREAMED_MAX_ROWS + 1, 4096, 4096, bf16, **no_fp8) == "dequantized"
    assert choose_product(1, 4096, 4096, bf16, **dict(gpu, per_channel=False)) == "dequantized"  # block scales
    assert choose_product(1, 4096, 4096, bf16, cuda=False, per_channel=True, fp8_tensor_cores=False) == "dequantized"


def test_the_layer_quantises_rows_only_for_the_w8a8_product(monkeypatch):
    """``Fp8Linear.forward`` hands the streamed product bf16 rows (W8A16) or E4M3 rows with their scales (W8A8), and
    the tiled product E4M3 rows with their scales, as ``choose_product`` says (the CPU never reaches these branches on its own)."""
    import metronome.models.fp8 as fp8
    import metronome.models.fp8_tiled_triton as fp8_tiled_triton
    import metronome.models.fp8_triton as fp8_triton

    layer = fp8.Fp8Linear.from_linear(torch.nn.Linear(64, 32, bias=False)).to(torch.bfloat16)
    seen = []

    def product(x, codes, scale, bias, *, x_scale=None, out_dtype=None, split_k=None):
        seen.append((x.dtype, x_scale is not None, out_dtype))
        return torch.zeros(x.shape[0], codes.shape[0], dtype=out_dtype)

    def tiled(x, x_scale, codes, scale, bias, *, out_dtype):
        seen.append((x.dtype, x_scale is not None, out_dtype))
        return torch.zeros(x.shape[0], codes.shape[0], dtype=out_dtype)

    monkeypatch.setattr(fp8_triton, "fp8_weight_linear", product)
    monkeypatch.setattr(fp8_tiled_triton, "fp8_tiled_linear", tiled)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    for chosen, expected in (("streamed-w8a16", (torch.bfloat16, False)), ("streamed-w8a8", (fp8.E4M3, True)),
                             ("tiled-w8a8", (fp8.E4M3, True))):
        monkeypatch.setattr(fp8, "choose_product", lambda *a, chosen=chosen, **k: chosen)
        assert layer(x).shape == (3, 32)
        assert seen.pop() == (*expected, torch.bfloat16)


def test_quantised_rows_reach_the_e4m3_products_as_they_are(monkeypatch):
    """Rows a fused kernel quantised (``QuantizedRows``) go to the W8A8 products with their own codes and scales,
    not quantised again; a product that takes bf16 rows (here W8A16, and the CPU's dequantised product) gets
    the rows dequantised."""
    import metronome.models.fp8 as fp8
    import metronome.models.fp8_tiled_triton as fp8_tiled_triton
    import metronome.models.fp8_triton as fp8_triton

    linear = torch.nn.Linear(64, 32, bias=False)
    layer = fp8.Fp8Linear.from_linear(linear).to(torch.bfloat16)
    rows = fp8.QuantizedRows(*fp8.quantize_rows(torch.randn(3, 64)), torch.bfloat16)
    assert not fp8.takes_e4m3_rows(layer, 3, torch.bfloat16) and not fp8.takes_e4m3_rows(linear, 3, torch.bfloat16)
    assert torch.equal(layer(rows), layer(rows.dequantized()))   # the CPU: the dequantised product
    seen = []

    def product(x, codes, scale, bias, *, x_scale=None, out_dtype=None, split_k=None):
        seen.append((x, x_scale))
        return torch.zeros(x.shape[0], codes.shape[0], dtype=out_dtype)

    def tiled(x, x_scale, codes, scale, bias, *, out_dtype):
        seen.append((x, x_scale))
        return torch.zeros(x.shape[0], codes.shape[0], dtype=out_dtype)

    monkeypatch.setattr(fp8_triton, "fp8_weight_linear", product)
    monkeypatch.setattr(fp8_tiled_triton, "fp8_tiled_linear", tiled)
    monkeypatch.setattr(fp8, "quantize_rows", lambda x: pytest.fail("rows quantised twice"))
    for chosen in ("streamed-w8a8", "tiled-w8a8"):
        monkeypatch.setattr(fp8, "choose_product", lambda *a, chosen=chosen, **k: chosen)
        assert fp8.takes_e4m3_rows(layer, 3, torch.bfloat16)
        assert layer(rows).shape == (3, 32)
        x, x_scale = seen.pop()
        assert x is rows.codes and x_scale is rows.scale
    monkeypatch.setattr(fp8, "choose_product", lambda *a, **k: "streamed-w8a16")
    layer(rows)
    x, x_scale = seen.pop()
    assert x_scale is None and torch.equal(x, rows.dequantized())


def test_fp8_is_refused_at_start_on_a_gpu_without_e4m3(monkeypatch):
    import metronome.models.fp8 as fp8
    from metronome.errors import ConfigError

    monkeypatch.setattr(fp8, "_capability", lambda index: (8, 0))
    with pytest.raises(ConfigError, match="compute capability 8.9"):
        fp8.check_fp8_device(torch.device("cuda", 0))
    fp8.check_fp8_device(torch.device("cpu"))   # the CPU dequantises


def test_the_warpgroup_mma_is_hoppers_alone(monkeypatch):
    import metronome.models.fp8 as fp8

    for capability, tiled in (((8, 9), False), ((9, 0), True), ((10, 0), False), ((12, 0), False)):
        monkeypatch.setattr(fp8, "_capability", lambda index, c=capability: c)
        assert fp8.warpgroup_mma_available(torch.device("cuda", 0)) is tiled
    assert not fp8.warpgroup_mma_available(torch.device("cpu"))
