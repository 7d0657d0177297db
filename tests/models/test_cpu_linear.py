"""Linear weights packed for oneDNN (``models/cpu_linear.py``): the product against float64, and whole
sessions through an engine with packed weights against transformers' windowed oracle."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.errors import ConfigError
from metronome.models.cpu_linear import PackedLinear, pack_linears_, packable
from tests.engine.oracle import hf_windowed_logprobs
from tests.engine.test_engine_fp8 import drive

needs_mkldnn = pytest.mark.skipif(not packable(torch.float32), reason="torch built without oneDNN")


@needs_mkldnn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (3, 5, 48), (300, 48)])
def test_packed_product_matches_float64(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(shape)
    ref = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                     None if linear.bias is None else linear.bias.double())
    out = PackedLinear(linear)(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packable(torch.bfloat16), reason="this CPU has no bf16 instructions for oneDNN to pack")
def test_packed_bf16_product_within_bf16_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False).to(torch.bfloat16)
    x = torch.randn(9, 256, dtype=torch.bfloat16)
    ref = x.double() @ linear.weight.double().t()
    out = PackedLinear(linear)(x).double()
    assert ((out - ref).norm() / ref.norm()).item() < 2 ** -7


@needs_mkldnn
def test_pack_replaces_every_linear_and_keeps_the_rest():
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4)))
    assert pack_linears_(block) == 2
    assert [type(m).__name__ for m in block.modules()].count("Linear") == 0
    assert isinstance(block[2][1], nn.LayerNorm)


@needs_mkldnn
def test_engine_with_packed_weights_matches_the_windowed_oracle(llama):
    path, model = llama
    engine = Engine(EngineConfig(model=path, dtype="float32", cpu_linear="packed", num_blocks=200,
                                 max_chunk_tokens=24, max_batch_tokens=64,
                                 policy=KVPolicy(sinks=3, window=13, block_size=4, positions="absolute")))
    layer = engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and isinstance(layer.mlp.down_proj, PackedLinear)
    tokens, logprobs = drive(engine, random.Random(5), 6)
    ref = hf_windowed_logprobs(model, tokens, 3, 13)
    assert max(abs(lp - ref[pos - 1, tokens[pos]].item()) for pos, lp in logprobs) < 1e-3


SMALL = dict(num_blocks=64, max_chunk_tokens=24, max_batch_tokens=64, policy=KVPolicy(sinks=3, window=13, block_size=4))


def test_auto_leaves_float32_to_aten(llama):
    engine = Engine(EngineConfig(model=llama[0], dtype="float32", **SMALL))
    assert type(engine.model.model.layers[0].mlp.down_proj) is nn.Linear


def test_cpu_linear_setting_is_checked(llama):
    with pytest.raises(ConfigError, match="cpu_linear"):
        EngineConfig(cpu_linear="fast")
    if not packable(torch.bfloat16):
        with pytest.raises(ConfigError, match="cannot pack"):
            Engine(EngineConfig(model=llama[0], dtype="bfloat16", cpu_linear="packed", **SMALL))
