"""The Qwen2.5-Omni adapter: its audio path and prompt layout against transformers' own thinker and
processor settings (tiny random model, SmolLM2's tokenizer with the Qwen2.5-Omni audio tokens added)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.audio.adapter import AdapterContext, TickAudio
from metronome.audio.omni.qwen2_5_omni import (AudioFrontEnd, AudioMarkers, Qwen25OmniAdapter, build_adapter,
                                               feature_extractor_for, packed_sdpa)
from metronome.audio.pcm import encode_pcm16
from metronome.errors import ConfigError, ModelLoadError
from metronome.models.fp8 import Fp8Linear
from metronome.models.loader import read_config
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc
from metronome.serving.worker import WorkerConfig, serve_worker
from tests.audio.omni.test_tower_fp8 import TOWER_BOUND, relative_error

SYSTEM = "You are a test."
INSTRUCTION = "Describe it."
BLOCK = 32000   # 2 s at 16 kHz: one encoder window of 200 mel frames, 50 embeddings

# Qwen2.5-Omni's chat template, reduced to text and audio contents.
TEMPLATE = (
    "{%- for message in messages %}{%- if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'audio' %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    envelope = np.repeat(10 ** rng.uniform(-3.0, 0, size=n // 400 + 1), 400)[:n]
    return (rng.standard_normal(n) * envelope * 0.3).clip(-1, 1).astype(np.float32)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """(checkpoint dir, transformers' thinker, tokenizer): a tiny Qwen2_5OmniForConditionalGeneration
    with the real audio front-end shape (128 mel bins, 2-s windows) and a tokenizer carrying its tokens."""
    from transformers import (AutoTokenizer, Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration,
                              Qwen2_5OmniThinkerConfig)

    from metronome.models.embedded import embedded_checkpoint

    path = tmp_path_factory.mktemp("qwen2_5_omni_audio")
    tok = AutoTokenizer.from_pretrained(embedded_checkpoint("smollm2-135m"))
    tok.add_special_tokens({"additional_special_tokens": ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    ids = tok.convert_tokens_to_ids(["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"])
    text = dict(vocab_size=len(tok) + 5, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=64, n_window=100, max_source_positions=1500)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[0])
    thinker = Qwen2_5OmniThinkerConfig(text_config=text, audio_config=audio, vision_config=vision,
                                       audio_token_index=ids[0], audio_start_token_id=ids[1],
                                       audio_end_token_id=ids[2], image_token_index=3, video_token_index=4,
                                       vision_start_token_id=5)
    torch.manual_seed(0)
    model = Qwen2_5OmniForConditionalGeneration(Qwen2_5OmniConfig(thinker_config=thinker.to_dict(),
                                                                  enable_audio_output=False)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path, model.thinker.eval(), tok


@pytest.fixture(scope="module")
def engine(omni):
    path, _, _ = omni
    return Engine(EngineConfig(model=str(path), policy=KVPolicy(sinks=8, window=512, block_size=16,
                                                                positions="absolute"),
                               num_blocks=160, max_chunk_tokens=192, max_batch_tokens=1024))


def make_adapter(omni, engine, embed=None, **kwargs) -> Qwen25OmniAdapter:
    path, _, tok = omni
    config = read_config(path)
    frontend = AudioFrontEnd.from_checkpoint(path, config, "cpu", torch.float32)
    return Qwen25OmniAdapter(tok, frontend, AudioMarkers.from_config(config), embed or engine.model.embed,
                             **{"max_input_tokens": 512, **kwargs})


class Spy:
    """An embed function that records the token ids the adapter lays out."""

    def __init__(self, embed):
        self.embed, self.calls = embed, []

    def __call__(self, ids):
        self.calls.append(ids.tolist())
        return self.embed(ids)


def processor_features(extractor, clips):
    """What Qwen2.5-Omni's processor feeds the thinker: 30-s max_length padding plus a frame mask."""
    out = extractor(clips, sampling_rate=16000, padding="max_length", return_attention_mask=True,
                    return_tensors="pt")
    return out["input_features"], out["attention_mask"]


def test_features_and_embeddings_equal_transformers_audio_tower(omni, engine):
    _, thinker, _ = omni
    adapter = make_adapter(omni, engine)
    frontend = adapter.frontend
    assert frontend.block_samples == BLOCK and frontend.tokens_per_block == 50 and frontend.sample_rate == 16000
    clips = [speech_like(2.0, 1), speech_like(0.7, 2), speech_like(4.0, 3)]   # windows of unequal length
    feats, lengths = frontend.extract(clips)
    ref_feats, mask = processor_features(frontend.features, clips)
    assert lengths.tolist() == mask.sum(1).tolist() == [200, 70, 400]
    torch.testing.assert_close(feats, torch.cat([f[:, :n] for f, n in zip(ref_feats, lengths.tolist())], 1))

    ours = frontend.encode(clips)       # one call, packed window attention
    with torch.no_grad():
        ref = thinker.get_audio_features(ref_feats, feature_attention_mask=mask).last_hidden_state
    assert [o.shape[0] for o in ours] == [50, 17, 100]
    torch.testing.assert_close(torch.cat(ours), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("frames", [[200], [200, 70, 400], [1], [199, 201]])
def test_window_bounds_are_what_transformers_computes(omni, engine, frames):
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf

    frontend = make_adapter(omni, engine).frontend
    _, chunk_lengths = hf.chunk_and_pad_features(torch.zeros(1, sum(frames)), torch.tensor(frames), 100)
    assert frontend.window_bounds(frames).tolist() == hf.get_audio_cu_seqlens(chunk_lengths).tolist()


def test_the_tower_is_handed_its_windows(omni, engine, monkeypatch):
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf

    handed = []
    for name, key in (("get_audio_cu_seqlens", "cu_seqlens"), ("get_max_seqlen", "max_seqlen")):
        def spy(*args, _original=getattr(hf, name), _name=name, _key=key, **kwargs):
            handed.append((_name, _key in (kwargs.get("kwargs") or {})))
            return _original(*args, **kwargs)

        monkeypatch.setattr(hf, name, spy)
    frontend = make_adapter(omni, engine).frontend
    assert [o.shape[0] for o in frontend.encode([speech_like(2.0, 1), speech_like(0.7, 2)])] == [50, 17]
    assert {name for name, _ in handed} == {"get_audio_cu_seqlens", "get_max_seqlen"}
    assert all(given for _, given in handed)


def test_packed_attention_equals_window_by_window_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 23, 8) for _ in range(3))
    for cu in ([0, 10, 20], [0, 10, 13, 23]):
        cu = torch.tensor(cu, dtype=torch.int32)
        out, _ = packed_sdpa(None, q[..., :cu[-1], :], k[..., :cu[-1], :], v[..., :cu[-1], :], scaling=0.3,
                             cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        parts = [torch.nn.functional.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
                                                                  scale=0.3)
                 for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        torch.testing.assert_close(out, torch.cat(parts, 2).transpose(1, 2))


def test_free_running_session_equals_transformers_on_the_whole_prompt(omni, engine):
    """Header + first audio + instruction + assistant prefix, then two more audio blocks: the engine on
    the adapter's embeddings gives the logits of transformers' thinker on the processor's input (its
    own chat template, audio token expansion, features and TMRoPE positions), and the same greedy tokens."""
    _, thinker, tok = omni
    spy = Spy(engine.model.embed)
    adapter = make_adapter(omni, engine, spy, instruction=INSTRUCTION)
    adapter.open_session("s", "free_running", SYSTEM)
    sid = engine.open_session()
    audio = [speech_like(2.0, 10), speech_like(2.0, 11), speech_like(2.0, 12)]
    hidden = []
    for n, clip in enumerate(audio):
        last = n == len(audio) - 1
        prep, = adapter.prepare([TickAudio("s", pcm=clip, max_tokens=5 if last else 0)])
        assert prep.error is None and prep.token_ids is None and prep.embeds.shape[1] == 64
        out, = engine.step([StepInput(sid, embeds=prep.embeds, max_new_tokens=prep.max_new_tokens,
                                      return_hidden=not last)])
        assert out.ok, out.error
        hidden.append(out.hidden)
    assert len(out.token_ids) == 5

    # The reference: the chat template's prompt, <|AUDIO|> expanded as the processor does (50 per 2 s).
    m = adapter.markers
    first = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": [{"type": "audio"}, {"type": "text",
                                                                                      "text": INSTRUCTION}]}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
    at = first.index(m.pad)
    ids = first[:at] + [m.pad] * 50 + first[at + 1:]
    ticks = [ids] + [[m.start] + [m.pad] * 50 + [m.end]] * 2
    assert spy.calls == ticks
    feats, mask = processor_features(adapter.frontend.features, audio)

    def logits(seq):
        with torch.no_grad():
            return thinker(input_ids=torch.tensor([seq]), attention_mask=torch.ones(1, len(seq), dtype=torch.long),
                           input_features=feats, feature_attention_mask=mask, use_cache=False).logits[0]

    whole = [t for tick in ticks for t in tick]
    ref = logits(whole)
    ends = np.cumsum([len(t) for t in ticks]) - 1
    for h, end in zip(hidden[:2], ends[:2]):
        torch.testing.assert_close(engine.model.compute_logits(h[None])[0], ref[end], rtol=1e-4, atol=1e-4)
    greedy = []
    for _ in range(5):
        greedy.append(int(logits(whole + greedy)[-1].argmax()))
    assert out.token_ids == greedy
    engine.close_session(sid)


def test_turn_mode_layout(omni, engine):
    _, _, tok = omni
    spy = Spy(engine.model.embed)
    adapter = make_adapter(omni, engine, spy, instruction=INSTRUCTION)
    chat, m = adapter.chat, adapter.markers
    adapter.open_session("t", "turn", "")
    header = chat.header(adapter.system_prompt)

    # 2.5 s, no commit: one block opens the user turn; 0.5 s waits; nothing decodes.
    prep, = adapter.prepare([TickAudio("t", pcm=speech_like(2.5), max_tokens=4)])
    assert prep.max_new_tokens == 0 and spy.calls[-1] == header + chat.user_prefix + [m.start] + [m.pad] * 50 + [m.end]
    assert adapter.session_state("t")["pending_samples"] == 8000
    # Commit with 0.3 s more: the 0.8 s partial block is heard (80 frames: 20 embeddings), the turn closes.
    prep, = adapter.prepare([TickAudio("t", pcm=speech_like(0.3), new_turn=True, max_tokens=4)])
    assert spy.calls[-1] == [m.start] + [m.pad] * 20 + [m.end] + adapter.instruction + chat.user_suffix \
        + chat.generation_prompt
    assert prep.max_new_tokens == 4 and prep.stop_token_ids == adapter.stop_token_ids
    assert adapter.session_state("t")["responding"]
    # Audio while answering is held, not heard; the answer ends with its stop token.
    prep, = adapter.prepare([TickAudio("t", pcm=speech_like(2.0), max_tokens=4)])
    assert prep.num_tokens == 0 and prep.max_new_tokens == 4 and adapter.session_state("t")["pending_samples"] == BLOCK
    stop = chat.assistant_suffix[0]
    adapter.on_output("t", [tok.encode("hi", add_special_tokens=False)[0], stop], finished=True)
    # Next tick: the assistant turn is closed, then the held block opens the next user turn (no instruction).
    calls = len(spy.calls)
    prep, = adapter.prepare([TickAudio("t", max_tokens=4)])
    assert prep.max_new_tokens == 0 and len(spy.calls) == calls + 1
    assert spy.calls[-1] == chat.assistant_suffix[1:] + chat.user_prefix + [m.start] + [m.pad] * 50 + [m.end]
    # A commit with nothing pending closes the turn without the instruction; typed text barges in.
    prep, = adapter.prepare([TickAudio("t", new_turn=True, max_tokens=4)])
    assert prep.token_ids == chat.user_suffix + chat.generation_prompt and prep.max_new_tokens == 4
    prep, = adapter.prepare([TickAudio("t", text="Stop.", max_tokens=4)])
    assert prep.token_ids == chat.assistant_suffix + chat.user_turn("Stop.") and prep.max_new_tokens == 4


def test_state_is_bounded_and_bad_input_leaves_the_session_usable(omni, engine):
    adapter = make_adapter(omni, engine, max_pending_s=3.0, max_input_tokens=256)
    adapter.open_session("a", "turn", "")
    adapter.open_session("b", "free_running", "")
    with pytest.raises(ValueError, match="already open"):
        adapter.open_session("a", "turn", "")
    with pytest.raises(ValueError, match="karaoke"):
        adapter.open_session("c", "karaoke", "")
    before = adapter.session_state("a")
    out = adapter.prepare([
        TickAudio("ghost", pcm=speech_like(1.0)),
        TickAudio("a", pcm=np.full(1000, np.nan, np.float32)),
        TickAudio("a", pcm=np.zeros((2, 100), np.float32)),
        TickAudio("b", text="word " * 400),
        TickAudio("b", pcm=speech_like(2.0), max_tokens=3),
    ])
    assert "not open" in out[0].error
    assert "NaN" in out[1].error and "mono" in out[2].error
    assert "at most 256" in out[3].error
    assert out[4].error is None and out[4].embeds is not None and out[4].max_new_tokens == 3
    assert adapter.session_state("a") == before
    # The refused session still works; a long backlog is heard a bounded amount per tick and never grows past
    # max_pending_s (the oldest audio is dropped).
    header, = adapter.prepare([TickAudio("a")])
    assert header.token_ids == adapter.chat.header(adapter.system_prompt) and header.max_new_tokens == 0
    ok, = adapter.prepare([TickAudio("a", pcm=speech_like(30.0))])
    assert ok.error is None and 0 < ok.num_tokens <= adapter.input_tokens_per_tick(30000)
    assert adapter.session_state("a")["pending_samples"] <= 3 * 16000
    adapter.close_session("a")
    adapter.close_session("a")
    assert adapter.sessions == 1

    # Free running: nothing decodes until a whole 2-s block has been heard; the partial block waits.
    adapter.open_session("c", "", "")
    first, = adapter.prepare([TickAudio("c", pcm=speech_like(1.2), max_tokens=3)])
    assert first.token_ids == adapter.chat.header(adapter.system_prompt) and first.max_new_tokens == 0
    state = adapter.session_state("c")
    assert (state["mode"], state["pending_samples"], state["started"]) == ("free_running", 19200, False)
    second, = adapter.prepare([TickAudio("c", pcm=speech_like(1.0), max_tokens=3)])
    assert second.embeds.shape[0] > 52 and second.max_new_tokens == 3
    assert adapter.session_state("c")["pending_samples"] == 3200 and adapter.session_state("c")["started"]


def test_feature_extractor_settings(omni, tmp_path):
    from transformers import WhisperFeatureExtractor

    path, _, _ = omni
    default = feature_extractor_for(path, 128)
    assert (default.feature_size, default.sampling_rate, default.hop_length, default.n_fft) == (128, 16000, 160, 400)
    WhisperFeatureExtractor(feature_size=80, hop_length=320).save_pretrained(tmp_path)
    assert feature_extractor_for(tmp_path, 80).hop_length == 320
    with pytest.raises(ModelLoadError, match="80 mel bins"):
        feature_extractor_for(tmp_path, 128)


def test_build_adapter_needs_a_checkpoint(omni, engine):
    context = AdapterContext(tokenizer=engine.tokenizer, checkpoint=None, embed=engine.model.embed,
                             device=torch.device("cpu"), dtype=torch.float32, max_input_tokens=512, budget_ms=2000.0)
    with pytest.raises(ConfigError, match="checkpoint"):
        build_adapter(context)


def test_an_fp8_context_gets_an_fp8_audio_tower(omni, engine):
    path, _, _ = omni

    def built(quantization):
        return build_adapter(AdapterContext(tokenizer=engine.tokenizer, checkpoint=path, embed=engine.model.embed,
                                            device=torch.device("cpu"), dtype=torch.float32, max_input_tokens=512,
                                            budget_ms=2000.0, quantization=quantization)).frontend

    plain, fp8 = built(None), built("fp8")
    assert not any(isinstance(m, Fp8Linear) for m in plain.encoder.modules())
    assert isinstance(fp8.encoder.layers[1].self_attn.q_proj, Fp8Linear) and isinstance(fp8.encoder.layers[0].fc2,
                                                                                         Fp8Linear)
    assert type(fp8.encoder.proj) is torch.nn.Linear
    clips = [speech_like(2.0, 1), speech_like(0.7, 2)]
    assert 0 < relative_error(torch.cat(fp8.encode(clips)), torch.cat(plain.encode(clips))) < TOWER_BOUND


async def test_worker_serves_audio_end_to_end(omni, engine):
    path, _, _ = omni
    config = WorkerConfig(EngineConfig(model=str(path), policy=KVPolicy(sinks=8, window=256, block_size=16),
                                       num_blocks=120, max_chunk_tokens=128, max_batch_tokens=512),
                          adapter="qwen2_5_omni", max_input_tokens=512, budget_ms=2000.0, port=0)
    audio = [speech_like(2.0, tick) for tick in range(3)]
    handle = await serve_worker(config)
    try:
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for sid in ("a", "b"):
                assert (await stub.OpenSession(pb.OpenSessionRequest(sid=sid, mode="free_running"))).ok
            tokens = {"a": [], "b": []}
            for tick, clip in enumerate(audio):
                response = await stub.Step(pb.StepRequest(tick=tick, tokens_per_tick=4, sessions=[
                    pb.SessionInput(sid=sid, audio_pcm16=encode_pcm16(clip), sample_rate=16000) for sid in "ab"]))
                for out in response.outputs:
                    assert not out.error
                    tokens[out.sid] += out.tokens
                assert response.frontend_ms > 0 and response.prefill_ms > 0 and response.decode_ms > 0
            assert len(tokens["a"]) == 12 and tokens["a"] == tokens["b"]
    finally:
        await handle.stop(0)

    # The same stream through the adapter and an engine in-process (PCM16-rounded audio, as the worker decodes it).
    adapter = make_adapter(omni, engine)
    adapter.open_session("a", "free_running", "")
    sid, expected = engine.open_session(), []
    for clip in audio:
        heard = np.round(clip * 32768.0).clip(-32768, 32767).astype(np.float32) / 32768.0
        prep, = adapter.prepare([TickAudio("a", pcm=heard, max_tokens=4)])
        out, = engine.step([StepInput(sid, embeds=prep.embeds, max_new_tokens=prep.max_new_tokens)])
        expected += out.token_ids
    engine.close_session(sid)
    assert tokens["a"] == expected
