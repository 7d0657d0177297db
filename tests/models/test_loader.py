import json

import pytest
import torch

from metronome import ModelLoadError
from metronome.models.loader import load_model
from tests.conftest import make_checkpoint


def test_sharded_checkpoints_load_every_weight(tmp_path):
    ref = make_checkpoint(tmp_path, "qwen3")
    ref.save_pretrained(tmp_path, max_shard_size="100KB")  # rewrite as many shards
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    net, _ = load_model(str(tmp_path), torch.float32, "cpu")
    fused = net.model.layers[0].self_attn.qkv_proj.weight
    attn = ref.model.layers[0].self_attn
    torch.testing.assert_close(fused, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    torch.testing.assert_close(net.model.layers[1].self_attn.k_norm.weight, ref.model.layers[1].self_attn.k_norm.weight)


def test_missing_weights_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_checkpoint(tmp_path, "llama")
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="down_proj"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unsupported_architectures_are_refused(tmp_path):
    make_checkpoint(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path), torch.float32, "cpu")


@pytest.mark.parametrize("what", ["missing", "no-config"])
def test_paths_that_are_not_checkpoints_are_refused(tmp_path, what):
    path = tmp_path / "nope" if what == "missing" else tmp_path
    with pytest.raises(ModelLoadError):
        load_model(str(path), torch.float32, "cpu")
