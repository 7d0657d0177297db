"""The interaction models' decoders with FP8 weights and FP8 KV pages (``quantization="fp8"``,
``kv_cache_dtype="fp8"``): logits over a multi-chunk session and greedy decode against the same tiny checkpoints
in float32, whose own tests hold them to transformers. Greedy tokens after the session agree."""

from __future__ import annotations

import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.models.fp8 import Fp8Linear

# E4M3 weights and pages move these tiny random decoders' logits by at most this fraction of their largest
# logit (seen 0.7-4.4 %: 3 mantissa bits through 2 layers, the MoE experts included).
RELATIVE_BOUND = 0.1


def _qwen3_omni(path):
    from tests.models.omni.test_qwen3_omni import make_qwen3_omni

    make_qwen3_omni(path, tokenizer=False)
    return 500


def _qwen2_5_omni(path):
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    from tests.models.omni.test_qwen2_5_omni import perturb, tiny_thinker_config

    torch.manual_seed(0)
    config = Qwen2_5OmniConfig(thinker_config=tiny_thinker_config().to_dict(), enable_audio_output=False)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    perturb(model)
    model.save_pretrained(path)
    return 240


def _minicpm_o(path):
    from tests.models.omni.test_minicpm_o import VOCAB, build_checkpoint

    build_checkpoint(path)
    return VOCAB


def _moshi(path):
    from tests.models.omni.test_moshi import VOCAB, make_moshi_checkpoint

    make_moshi_checkpoint(path)
    return VOCAB


@pytest.mark.parametrize("build", [_qwen3_omni, _qwen2_5_omni, _minicpm_o, _moshi],
                         ids=["qwen3_omni", "qwen2_5_omni", "minicpm_o", "moshi"])
def test_fp8_decoder_close_to_float(tmp_path, build):
    vocab = build(tmp_path)
    engines = [Engine(EngineConfig(model=str(tmp_path), dtype="float32", num_blocks=64, max_chunk_tokens=32,
                                   quantization=q, kv_cache_dtype=kv,
                                   policy=KVPolicy(sinks=4, window=48, block_size=8, positions="absolute")))
               for q, kv in ((None, "auto"), ("fp8", "fp8"))]
    assert any(isinstance(m, Fp8Linear) for m in engines[1].model.modules())
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (9, 30, 17)]  # past the window
    sids = [e.open_session() for e in engines]
    for chunk in chunks:
        logits = [e.model.compute_logits(e.step([StepInput(s, token_ids=chunk, return_hidden=True)])[0].hidden[None])[0]
                  for e, s in zip(engines, sids)]
        float_logits, fp8_logits = logits
        assert (fp8_logits - float_logits).abs().max() <= RELATIVE_BOUND * float_logits.abs().max()
    decoded = [e.step([StepInput(s, max_new_tokens=4)])[0].token_ids for e, s in zip(engines, sids)]
    assert decoded[0] == decoded[1]
