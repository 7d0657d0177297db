"""The worker's config and the adapter context it builds over its engine."""

from __future__ import annotations

import pytest

from metronome import Engine, EngineConfig, KVPolicy
from metronome.models.fp8 import Fp8Linear
from metronome.serving.worker.config import WorkerConfig, adapter_context


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_adapter_context_carries_the_engines_quantization(chat_checkpoint, quantization):
    config = WorkerConfig(EngineConfig(model=chat_checkpoint, policy=KVPolicy(sinks=4, window=64, block_size=16),
                                       num_blocks=16, max_chunk_tokens=64, quantization=quantization),
                          adapter="energy", budget_ms=2000.0, port=0)
    engine = Engine(config.engine)
    assert isinstance(engine.model.model.layers[0].mlp.down_proj, Fp8Linear) == (quantization == "fp8")
    assert adapter_context(config, engine).quantization == quantization
