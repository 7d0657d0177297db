"""Moshi's temporal transformer on the engine against transformers' ``MoshiForConditionalGeneration``.

The reference is transformers' own Moshi on a tiny random configuration, saved with ``save_pretrained``;
our decoder loads the same directory. One position per 80 ms frame, fed as summed embeddings (text +
16 audio codebooks), as the adapter does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.errors import ModelLoadError
from metronome.models.loader import load_model

VOCAB = 128          # the tiny model's text vocabulary (and its tiny tokenizer's)
CODEBOOK = 32        # Mimi codebook size = Moshi's audio vocabulary (the extra id CODEBOOK is "initial")
NUM_CODEBOOKS = 8

TINY_MIMI = dict(hidden_size=16, num_filters=4, upsampling_ratios=[8, 6, 5, 4], num_hidden_layers=1,
                 intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, codebook_size=CODEBOOK,
                 codebook_dim=8, num_quantizers=NUM_CODEBOOKS, vector_quantization_hidden_dimension=8,
                 upsample_groups=4, sliding_window=20, max_position_embeddings=200, use_cache=True)


def tiny_moshi_config():
    from transformers import MoshiConfig

    return MoshiConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, ffn_dim=64, num_codebooks=NUM_CODEBOOKS,
                       audio_encoder_config=dict(TINY_MIMI),
                       depth_decoder_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                 ffn_dim=32))


def make_moshi_checkpoint(path, seed: int = 0, tokenizer: bool = False):
    """Save a random tiny Moshi (+ optionally the SmolLM2 tokenizer); returns the reference in eval mode."""
    from transformers import MoshiForConditionalGeneration

    torch.manual_seed(seed)
    model = MoshiForConditionalGeneration(tiny_moshi_config()).eval()
    with torch.no_grad():  # random norm weights so the norms' weight path matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():  # Mimi's codebooks start at zero: every code would be 0
            if name.endswith("codebook.embed_sum"):
                b.normal_()
    model.save_pretrained(path)
    if tokenizer:
        save_tiny_tokenizer(path)
    return model


def save_tiny_tokenizer(path) -> None:
    """A word-level tokenizer of VOCAB entries; ids 0-3 are <unk> <s> </s> <pad>, as in Kyutai's text vocabulary."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    words = specials + [f"w{i}" for i in range(VOCAB - len(specials))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)


@pytest.fixture(scope="module")
def moshi(tmp_path_factory):
    path = tmp_path_factory.mktemp("moshi")
    return str(path), make_moshi_checkpoint(path)


def frame_embeds(ref, text: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """transformers' input embedding for frames: text [T] + 16 codebooks [16, T] (Moshi's 8, then the user's 8)."""
    with torch.no_grad():
        e = ref.decoder.model.embed_tokens(text)
        for k in range(codes.shape[0]):
            e = e + ref.embed_tokens[k](codes[k])
    return e


def random_frames(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, VOCAB + 1, (n,), generator=g)
    codes = torch.randint(0, CODEBOOK + 1, (2 * NUM_CODEBOOKS, n), generator=g)
    return text, codes


def engine(path: str, window: int = 64, sinks: int = 4) -> Engine:
    return Engine(EngineConfig(model=path, dtype="float32", policy=KVPolicy(sinks=sinks, window=window, block_size=8),
                               num_blocks=64, max_chunk_tokens=8))


def test_frames_on_the_engine_match_transformers(moshi):
    """≥ 3 ticks of one frame each, then a 3-frame chunk: hidden states and text logits equal transformers'."""
    path, ref = moshi
    text, codes = random_frames(7)
    embeds = frame_embeds(ref, text, codes)
    with torch.no_grad():
        out = ref.decoder(inputs_embeds=embeds[None])
    want_hidden, want_logits = out.last_hidden_state[0], out.logits[0]

    eng = engine(path)
    sid = eng.open_session()
    got = []
    for t in range(4):  # one frame per tick, as Moshi runs
        got.append(eng.step([StepInput(sid, embeds=embeds[t:t + 1], return_hidden=True)])[0].hidden)
    got.append(eng.step([StepInput(sid, embeds=embeds[4:7], return_hidden=True)])[0].hidden)
    for t in range(4):
        torch.testing.assert_close(got[t], want_hidden[t], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[4], want_hidden[6], rtol=1e-4, atol=1e-5)
    logits = eng.model.compute_logits(torch.stack(got))
    torch.testing.assert_close(logits, want_logits[[0, 1, 2, 3, 6]], rtol=1e-4, atol=1e-5)
    assert logits.shape[-1] == VOCAB


def test_sessions_batched_in_one_step_match_alone(moshi):
    """Two sessions of different ages in one engine step give each its own transformers hidden state."""
    path, ref = moshi
    eng = engine(path)
    a, b = eng.open_session(), eng.open_session()
    ta, ca = random_frames(3, seed=2)
    tb, cb = random_frames(2, seed=3)
    ea, eb = frame_embeds(ref, ta, ca), frame_embeds(ref, tb, cb)
    eng.step([StepInput(a, embeds=ea[:2])])
    outs = eng.step([StepInput(a, embeds=ea[2:3], return_hidden=True), StepInput(b, embeds=eb, return_hidden=True)])
    with torch.no_grad():
        wa = ref.decoder(inputs_embeds=ea[None]).last_hidden_state[0, -1]
        wb = ref.decoder(inputs_embeds=eb[None]).last_hidden_state[0, -1]
    torch.testing.assert_close(outs[0].hidden, wa, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[1].hidden, wb, rtol=1e-4, atol=1e-5)


def test_initial_text_token_embeds(moshi):
    """The text table has vocab_size + 1 rows: the initial token (id vocab_size) embeds like transformers'."""
    path, ref = moshi
    net, _ = load_model(path, torch.float32, "cpu")
    ids = torch.tensor([0, VOCAB - 1, VOCAB])
    torch.testing.assert_close(net.embed(ids), ref.decoder.model.embed_tokens(ids))
    assert net.spec.model_type == "moshi" and net.spec.intermediate_size == 32


def test_missing_weights_are_named(tmp_path, moshi):
    from safetensors.torch import load_file, save_file

    path, _ = moshi
    (tmp_path / "config.json").write_text((Path(path) / "config.json").read_text())
    tensors = load_file(str(Path(path) / "model.safetensors"))
    del tensors["decoder.model.layers.1.mlp.fc2.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="layers.1.mlp.fc2.weight"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_bad_config_is_refused(tmp_path, moshi):
    path, _ = moshi
    config = json.loads((Path(path) / "config.json").read_text())
    config["ffn_dim"] = 63
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path), torch.float32, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention", ["triton", "torch"])
def test_frames_on_the_cuda_engine_match_transformers(moshi, attention):
    """The CUDA path (fused Triton RoPE, CUDA graphs at start) gives transformers' hidden states too."""
    path, ref = moshi
    text, codes = random_frames(6, seed=4)
    embeds = frame_embeds(ref, text, codes)
    with torch.no_grad():
        want = ref.decoder(inputs_embeds=embeds[None]).last_hidden_state[0]
    eng = Engine(EngineConfig(model=path, device="cuda", dtype="float32", attention=attention, num_blocks=64,
                              max_chunk_tokens=8, policy=KVPolicy(sinks=4, window=64, block_size=16)))
    sid = eng.open_session()
    got = [eng.step([StepInput(sid, embeds=embeds[t:t + 1].cuda(), return_hidden=True)])[0].hidden.cpu()
           for t in range(6)]
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-3, atol=1e-4)
