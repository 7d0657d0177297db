"""FP8 weights on a CUDA device with FP8 tensor cores (compute capability >= 8.9): the layer's products with
per-token activation scales, block checkpoints rescaled per channel, and the grouped MoE GEMM over E4M3
experts in bf16. Skipped elsewhere (the CPU tests cover the same layers dequantised)."""

from __future__ import annotations

import pytest
import torch

from metronome.models.fp8 import Fp8Linear, dequantize, per_channel_for_tensor_cores_, quantize, scaled_mm_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not scaled_mm_available(torch.device("cuda")),
                                reason="needs FP8 tensor cores (CUDA, compute capability >= 8.9)")


@pytest.mark.parametrize("rows", [1, 37, 100, 300])
def test_tensor_core_linear_within_the_activation_rounding_bound(rows):
    """Each product the layer chooses by row count (streamed, tiled on Hopper, cuBLAS), against float64 over the
    same E4M3 weights: each activation is off by at most half an E4M3 step
    (2**-4 of itself, or 2**-10 of its row's scale), so an output by at most ``2**-4 |x| @ |W|.T`` plus that
    floor times ``|W|`` summed, plus bf16's rounding of the output (2**-8 of it)."""
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(1024, 768, bias=True)
    torch.nn.init.normal_(linear.weight, std=0.03, generator=g)
    layer = Fp8Linear.from_linear(linear.cuda())
    assert layer.tensor_cores
    x = (torch.randn(rows, 1024, generator=g) * torch.logspace(-1, 1, 1024)).to("cuda", torch.bfloat16)
    got = layer(x).double()
    w = layer.dequantized().double()
    xd = x.double()
    want = xd @ w.T + layer.bias.double()
    row_scale = xd.abs().amax(1, keepdim=True) / 448
    bound = 2 ** -4 * xd.abs() @ w.abs().T + 2 ** -10 * row_scale * w.abs().sum(1) + 2 ** -8 * want.abs() + 1e-3
    assert ((got - want).abs() <= bound).all()
    # In aggregate: the activations' independent roundings (each at most 2**-4 of itself) move the output's
    # norm by at most 2**-4 of it in expectation, however few the rows.
    assert (got - want).norm() <= 2 ** -4 * want.norm()


def test_block_scaled_layers_rescale_per_channel_for_the_tensor_cores():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(384, 512, generator=g) * torch.logspace(-2, 0, 512)
    codes, scale = quantize(w, 128)
    net = torch.nn.Sequential(Fp8Linear(codes.cuda(), scale.cuda(), 128, None))
    assert not net[0].tensor_cores  # block scales: the tensor cores cannot take them
    block = net[0].dequantized().cpu()
    per_channel_for_tensor_cores_(net)
    assert net[0].tensor_cores and net[0].weight_scale.shape == (384, 1)
    s = net[0].weight_scale.cpu()
    # One more E4M3 rounding: within half a step at the row's scale.
    assert ((net[0].dequantized().cpu() - block).abs() <= torch.maximum(block.abs() * 2 ** -4, s * 2 ** -10)).all()


@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("fp8_activations", [False, True], ids=["w8a16", "w8a8"])
def test_grouped_moe_with_fp8_experts_in_bf16(group, fp8_activations):
    """The compiled grouped GEMM at decode and prefill loads (the default tiles), E4M3 experts. Weight-only: within
    bf16's tolerance of float64 over the dequantised experts. With E4M3 activations (the default here): close to
    the oracle that rounds the same rows onto E4M3 (bf16 rounding of the SiLU·up rows first moves a few codes one
    step), and within E4M3's precision of the exact one."""
    from metronome.models.fp8 import ExpertScales
    from metronome.models.moe_triton import grouped_moe
    from tests.models.test_moe_fp8 import _oracle_fp8_activations
    from tests.models.test_moe_triton import _oracle, _routing

    e, h, inter, k = 16, 256, 128, 4
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    down = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    (gu, gu_s), (dn, dn_s) = quantize(gate_up, group), quantize(down, group)
    scales = ExpertScales(gu_s.cuda(), dn_s.cuda(), group or h, group or inter)
    gu_f, dn_f = dequantize(gu, gu_s, group or h), dequantize(dn, dn_s, group or inter)
    for t in (8, 700):
        x = torch.randn(t, h, generator=g).to("cuda", torch.bfloat16)
        ids, w = _routing(t, e, k, seed=t)
        w = w.to(torch.bfloat16)
        got = grouped_moe(x, gu.cuda(), dn.cuda(), ids, w, scales=scales,
                          fp8_activations=fp8_activations).double().cpu()
        exact = _oracle(x.float(), gu_f, dn_f, ids, w.float())
        if not fp8_activations:
            torch.testing.assert_close(got, exact, atol=3e-2, rtol=3e-2)
            continue
        rounded = _oracle_fp8_activations(x.float(), gu_f, dn_f, ids, w.float())
        assert (got - rounded).norm() / exact.norm() < 2 ** -6
        assert (got - exact).norm() / exact.norm() < 2 ** -4


@pytest.mark.parametrize("rows", [8, 48, 128, 300])
def test_quantised_rows_give_the_layers_own_product(rows):
    """Rows quantised ahead by a fused kernel (``QuantizedRows``) take the same product as bf16 rows the layer
    quantises itself, to the bit, on each path that multiplies E4M3 rows (streamed, tiled, cuBLAS); a layer
    whose product at that row count widens its codes instead takes the dequantised rows."""
    from metronome.models.fp8 import QuantizedRows, quantize_rows, takes_e4m3_rows, warpgroup_mma_available

    tiled = "tiled-w8a8" if warpgroup_mma_available(torch.device("cuda")) else "scaled-mm"
    expected = {(8, 3072): "streamed-w8a8", (8, 768): "streamed-w8a16", (48, 3072): "streamed-w8a8",
                (48, 768): "streamed-w8a8", (128, 3072): tiled, (128, 768): tiled, (300, 3072): "scaled-mm",
                (300, 768): "scaled-mm"}
    g = torch.Generator().manual_seed(rows)
    for n in (3072, 768):   # wide (E4M3 rows from the streamed range) and narrow (bf16 rows up to 32)
        linear = torch.nn.Linear(1024, n, bias=True)
        torch.nn.init.normal_(linear.weight, std=0.03, generator=g)
        layer = Fp8Linear.from_linear(linear.cuda())
        assert layer.product(rows, torch.bfloat16) == expected[rows, n]
        x = torch.randn(rows, 1024, generator=g).to("cuda", torch.bfloat16)
        quantized = QuantizedRows(*quantize_rows(x), torch.bfloat16)
        got = layer(quantized)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        if takes_e4m3_rows(layer, rows, torch.bfloat16):
            assert torch.equal(got, layer(x))
        else:
            assert torch.equal(got, layer(quantized.dequantized()))


def test_norm_before_a_moe_block_hands_it_the_experts_codes():
    """The residual add + RMSNorm before a MoE block of E4M3 experts writes the router's rows and the experts' E4M3
    codes in one pass; the block then gives, to the bit, what it gives for the norm's plain rows (which it
    quantises itself)."""
    from metronome.models.fp8 import QuantizedRows
    from metronome.models.moe import MoeForCausalLM
    from tests.models.test_moe import _hf_config, _spec

    spec = _spec(_hf_config(hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
                            num_hidden_layers=1))
    torch.manual_seed(0)
    layer = MoeForCausalLM(spec, per_expert=False).model.layers[0]
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.05)
    layer = layer.to("cuda", torch.bfloat16)
    layer.mlp.experts.quantize_fp8_()
    norm, block = layer.post_attention_layernorm, layer.mlp
    x, delta = (torch.randn(40, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    residual, rows = norm.add_norm(x, delta, block)
    plain_residual, plain = norm.add_norm(x, delta, None)
    assert isinstance(rows, QuantizedRows) and torch.equal(rows.values, plain)
    assert torch.equal(residual, plain_residual)
    with torch.no_grad():
        assert torch.equal(block(rows), block(plain))
