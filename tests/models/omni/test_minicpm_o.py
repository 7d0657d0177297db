"""MiniCPM-o 4.5's decoder on the engine against transformers' Qwen3ForCausalLM (its published LLM class).

The tiny checkpoint below is written in the published MiniCPM-o layout (OpenBMB ``modeling_minicpmo.py``:
``MiniCPMO.llm`` is a ``Qwen3ForCausalLM``, ``apm`` a Whisper encoder, ``audio_projection_layer`` a
linear-ReLU-linear ``MultiModalProjector``, plus ``vpm``/``resampler``/``tts``), with a ``config.json`` of
``model_type`` "minicpmo" whose LLM fields are top-level Qwen3 fields (``MiniCPMOConfig(Qwen3Config)``).
The audio adapter's tests (tests/audio/omni/test_minicpm_o.py) reuse ``build_checkpoint``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.errors import ModelLoadError
from metronome.models.loader import load_model
from metronome.models.omni.minicpm_o import decoder_spec, rename

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<|audio_start|>", "<|audio|>", "<|audio_end|>",
            "<|tts_bos|>", "<|tts_eos|>", "<unit>", "<|listen|>", "<|speak|>", "<|chunk_eos|>", "<|turn_eos|>")
NOT_SPECIAL = ("<think>", "</think>")   # Qwen3 adds them as ordinary tokens
VOCAB = 288                             # 256 bytes + the added tokens, rounded up
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Published MiniCPM-o 4.5 LLM fields (Qwen3-8B) as they appear at the top of its config.json.
QWEN3_8B_FIELDS = dict(vocab_size=151748, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
                       attention_bias=False, tie_word_embeddings=False, use_sliding_window=False,
                       eos_token_id=151645, bos_token_id=151643)


def save_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer (no merges: one token per byte) carrying MiniCPM-o's special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(bytes_to_unicode().values())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in NOT_SPECIAL])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) <= VOCAB
    fast.save_pretrained(path)


class Projector(nn.Module):
    """The published ``MultiModalProjector``: linear1 → ReLU → linear2."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(out_dim, out_dim)

    def forward(self, x):
        return self.linear2(self.relu(self.linear1(x)))


@dataclass
class Reference:
    """transformers modules holding exactly the checkpoint's weights."""

    llm: nn.Module          # Qwen3ForCausalLM
    apm: nn.Module          # WhisperEncoder
    projector: Projector
    audio_config: object    # WhisperConfig
    pool_step: int


def _randomize_biases_and_norms(module: nn.Module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)


def build_checkpoint(path: Path, seed: int = 0, pool_step: int = 5, max_source_positions: int = 1500,
                     drop: tuple[str, ...] = ()) -> Reference:
    """Write a tiny MiniCPM-o checkpoint dir (config.json, model.safetensors, tokenizer); ``drop``: names left out."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(seed)
    llm_fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, tie_word_embeddings=False,
                      use_sliding_window=False, eos_token_id=2, bos_token_id=1)
    llm = Qwen3ForCausalLM(Qwen3Config(**llm_fields)).float().eval()
    audio_config = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                                 num_mel_bins=80, max_source_positions=max_source_positions, decoder_layers=1,
                                 decoder_attention_heads=4, decoder_ffn_dim=64, vocab_size=64)
    apm = WhisperEncoder(audio_config).float().eval()
    projector = Projector(audio_config.encoder_ffn_dim // 4, llm_fields["hidden_size"]).float().eval()
    for module in (llm, apm, projector):
        _randomize_biases_and_norms(module)

    tensors = {f"llm.{k}": v for k, v in llm.state_dict().items()}
    tensors |= {f"apm.{k}": v for k, v in apm.state_dict().items()}
    tensors |= {f"audio_projection_layer.{k}": v for k, v in projector.state_dict().items()}
    # The other towers: a few tensors under their published prefixes (the decoder and the adapter skip them).
    tensors |= {"vpm.embeddings.patch_embedding.weight": torch.randn(8, 3, 2, 2),
                "resampler.query": torch.randn(4, 64), "tts.emb_text.weight": torch.randn(10, 8)}
    tensors = {k: v.contiguous() for k, v in tensors.items() if k not in drop}
    save_file(tensors, str(path / "model.safetensors"))

    config = dict(llm_fields, model_type="minicpmo", architectures=["MiniCPMO"], version="4.5",
                  audio_pool_step=pool_step, audio_chunk_length=1.0, query_num=64, stream_input=False,
                  init_vision=True, init_audio=True, init_tts=True,
                  audio_config={k: v for k, v in audio_config.to_dict().items() if k != "transformers_version"},
                  vision_config={"hidden_size": 8, "model_type": "siglip"}, tts_config={"hidden_size": 8})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_tokenizer(path)
    return Reference(llm, apm, projector, audio_config, pool_step)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("minicpmo")
    return path, build_checkpoint(path)


def make_engine(path, window: int = 256, sinks: int = 4) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", num_blocks=96, max_chunk_tokens=64,
                               policy=KVPolicy(sinks=sinks, window=window, block_size=16)))


# ---------------------------------------------------------------------------------------------- config
def test_published_qwen3_8b_fields_give_the_8b_decoder_spec():
    spec = decoder_spec(dict(QWEN3_8B_FIELDS, model_type="minicpmo", audio_config={"d_model": 1024},
                             audio_pool_step=5))
    assert (spec.model_type, spec.num_layers, spec.hidden_size, spec.intermediate_size) == ("qwen3", 36, 4096, 12288)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (32, 8, 128, 151748)
    assert spec.qk_norm and not spec.qkv_bias and not spec.tie_word_embeddings
    assert spec.inv_freq[1] == pytest.approx(1e6 ** (-2 / 128))


def test_weight_names_follow_the_published_layout():
    assert rename("llm.model.layers.3.self_attn.q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert rename("llm.lm_head.weight") == "lm_head.weight"
    for other in ("apm.layers.0.fc1.weight", "audio_projection_layer.linear2.bias", "vpm.post_layernorm.weight",
                  "resampler.kv_proj.weight", "tts.model.layers.0.mlp.up_proj.weight"):
        assert rename(other) is None
    with pytest.raises(ModelLoadError, match="unexpected weight 'model.norm.weight'"):
        rename("model.norm.weight")   # same name as a decoder parameter, but outside llm.*


# ---------------------------------------------------------------------------------------------- decoder
def hf_logits(llm, embeds: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return llm(inputs_embeds=embeds[None]).logits[0]


def test_decoder_matches_qwen3_over_a_multi_chunk_session_with_spliced_audio(tiny):
    """Header tokens, then ticks of [audio-start, 10 audio rows, audio-end] embeddings (random rows stand in
    for the encoder's), then an instruction: every step's last-position logits equal Qwen3ForCausalLM's on the
    whole prefix (window 256 > the sequence), and the greedy continuation equals transformers'."""
    path, ref = tiny
    engine = make_engine(path)
    embed = ref.llm.get_input_embeddings()
    g = torch.Generator().manual_seed(1)

    def ids(*tokens):
        return torch.tensor(tokens)

    with torch.no_grad():
        chunks = [embed(ids(257, 115, 121, 115, 10, 72, 105, 258, 10))]                  # header
        for _ in range(3):                                                              # three ticks of audio
            audio = torch.randn(10, 64, generator=g) * 0.05
            chunks.append(torch.cat([embed(ids(260)), audio, embed(ids(262))]))
        chunks.append(embed(ids(72, 105, 258, 10, 257, 97, 10)))                       # instruction + prefix
    sid = engine.open_session()
    seen = []
    for chunk in chunks:
        out, = engine.step([StepInput(sid, embeds=chunk, return_hidden=True)])
        seen.append(chunk)
        got = engine.model.compute_logits(out.hidden[None])[0]
        want = hf_logits(ref.llm, torch.cat(seen))[-1]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    # Greedy decode continues from the last input (its first token comes from the logits checked above).
    out, = engine.step([StepInput(sid, max_new_tokens=6)])
    context = torch.cat(seen)
    want_tokens = []
    with torch.no_grad():
        for _ in range(6):
            token = int(hf_logits(ref.llm, context)[-1].argmax())
            want_tokens.append(token)
            context = torch.cat([context, embed(ids(token))])
    assert out.token_ids == want_tokens


def test_load_model_dispatches_minicpmo(tiny):
    path, ref = tiny
    net, checkpoint = load_model(str(path), torch.float32, "cpu")
    assert Path(checkpoint) == path and net.spec.model_type == "qwen3" and net.spec.vocab_size == VOCAB
    torch.testing.assert_close(net.model.embed_tokens.weight, ref.llm.model.embed_tokens.weight)
    torch.testing.assert_close(net.lm_head.weight, ref.llm.lm_head.weight)


# ---------------------------------------------------------------------------------------------- errors
def test_a_missing_llm_weight_is_named(tmp_path):
    build_checkpoint(tmp_path, drop=("llm.model.layers.1.mlp.down_proj.weight",))
    with pytest.raises(ModelLoadError, match="missing.*layers.1.mlp.down_proj"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_an_unknown_tensor_is_refused(tiny, tmp_path):
    path, _ = tiny
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(64)   # a stray name outside the published layout
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="unexpected weight 'model.norm.weight'"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_a_config_without_llm_fields_is_refused(tiny, tmp_path):
    path, _ = tiny
    config = json.loads((path / "config.json").read_text())
    del config["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        load_model(str(tmp_path), torch.float32, "cpu")
