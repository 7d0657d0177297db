"""The Moshi adapter against transformers' Moshi and Mimi (tiny random configuration), and end to end over gRPC.

The serving stack is imported inside its tests, so the rest runs where grpc is absent or older (the GPU box).

Named ``test_moshi_adapter`` (not ``test_moshi``): test folders have no ``__init__``, so basenames must
be unique across the tree and ``tests/models/omni/test_moshi.py`` exists.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from metronome import Engine, EngineConfig, KVPolicy, StepInput
from metronome.audio.adapter import AdapterContext, TickAudio
from metronome.audio.omni.moshi import MoshiAdapter, build_adapter
from metronome.audio.omni.moshi_heads import DepthTransformer, load_heads
from metronome.audio.omni.moshi_mimi import MimiCodec
from metronome.audio.pcm import decode_pcm16, encode_pcm16
from metronome.errors import ConfigError, ModelLoadError
from metronome.models.loader import read_config
from metronome.models.omni.moshi import hf_config
from tests.models.omni.test_moshi import CODEBOOK, NUM_CODEBOOKS, VOCAB, make_moshi_checkpoint, tiny_moshi_config

FRAME = 1920  # 80 ms at 24 kHz
POLICY = KVPolicy(sinks=2, window=64, block_size=8)


@pytest.fixture(scope="module")
def moshi(tmp_path_factory):
    path = tmp_path_factory.mktemp("moshi-adapter")
    return str(path), make_moshi_checkpoint(path, seed=3, tokenizer=True)


def engine_config(path: str) -> EngineConfig:
    return EngineConfig(model=path, dtype="float32", policy=POLICY, num_blocks=64, max_chunk_tokens=8)


def make_adapter(path: str, engine: Engine) -> MoshiAdapter:
    return build_adapter(AdapterContext(tokenizer=engine.tokenizer, checkpoint=engine.checkpoint,
                                        embed=engine.model.embed, device=engine.device, dtype=torch.float32,
                                        max_input_tokens=64, budget_ms=80.0))


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


def speech(n_frames: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n_frames * FRAME) * 0.2).clip(-1, 1).astype(np.float32)


# ------------------------------------------------------------------------------------------------ Mimi
def full_sequence(mimi, audio: torch.Tensor):
    with torch.no_grad():
        codes = mimi.encode(audio[:, None], num_quantizers=NUM_CODEBOOKS).audio_codes
        return codes, mimi.decode(codes).audio_values[:, 0]


def test_streaming_mimi_equals_full_sequence(moshi):
    """Frame-by-frame encode gives transformers' full-sequence codes; streaming decode its audio, to float rounding.

    16 frames = 32 steps of Mimi's transformers, past their sliding window (20 here). The only
    difference is the order of float additions (overlap-add of transposed convolutions, attention over
    a carried window), hence the 1e-5 relative tolerance on the audio."""
    _, ref = moshi
    mimi = ref.audio_encoder
    codec = MimiCodec(mimi, NUM_CODEBOOKS)
    frames = 16
    audio = torch.from_numpy(speech(frames, seed=0))[None]
    want_codes, want_audio = full_sequence(mimi, audio)
    state = codec.open()
    codes = torch.cat([codec.encode([state], audio[:, i * FRAME:(i + 1) * FRAME]) for i in range(frames)], -1)
    assert torch.equal(codes, want_codes)
    assert len(codes.unique()) > 4  # the codebooks are random (the fixture sets them), not all-zero
    state = codec.open()
    got = torch.cat([codec.decode([state], want_codes[..., i:i + 1]) for i in range(frames)], -1)
    assert got.shape == want_audio.shape == (1, frames * FRAME)
    torch.testing.assert_close(got, want_audio, rtol=1e-5, atol=1e-5 * float(want_audio.abs().max()))


def full_strength(mimi):
    """A copy of Mimi with its transformers' layer scales at 1 (it initialises them at 0.01, which hides a key too
    many or too few, or another stream's keys)."""
    mimi = copy.deepcopy(mimi)
    with torch.no_grad():
        for name, param in mimi.named_parameters():
            if name.endswith("layer_scale.scale"):
                param.fill_(1.0)
    return mimi


def test_streaming_mimi_transformers_attend_exactly_their_window(moshi):
    """The transformers' residual branches at full strength (Mimi initialises their layer scales at 0.01, which
    hides a key too many or too few): streaming encode gives the full-sequence latents (what the quantizer
    takes) and streaming decode the full-sequence audio, past the window and round the key ring more than once."""
    _, ref = moshi
    mimi = full_strength(ref.audio_encoder)
    latents = []
    quantize = mimi.quantizer.encode
    mimi.quantizer.encode = lambda x, *args, **kwargs: latents.append(x) or quantize(x, *args, **kwargs)
    codec = MimiCodec(mimi, NUM_CODEBOOKS)
    frames = 24
    audio = torch.from_numpy(speech(frames, seed=1))[None]
    want_codes, want_audio = full_sequence(mimi, audio)
    state = codec.open()
    for i in range(frames):
        codec.encode([state], audio[:, i * FRAME:(i + 1) * FRAME])
    want, got = latents[0], torch.cat(latents[1:], -1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    state = codec.open()
    got = torch.cat([codec.decode([state], want_codes[..., i:i + 1]) for i in range(frames)], -1)
    torch.testing.assert_close(got, want_audio, rtol=1e-5, atol=1e-5 * float(want_audio.abs().max()))


def test_streams_of_different_ages_share_a_batch(moshi):
    """Stream a starts 3 frames before stream b; from then on both run in one batch and each equals its own
    full-sequence encode/decode (the transformers at full strength, so a stream that saw the other's keys would
    show). State shapes never change (bounded, whatever the age)."""
    _, ref = moshi
    mimi = full_strength(ref.audio_encoder)
    codec = MimiCodec(mimi, NUM_CODEBOOKS)
    a_audio, b_audio = (torch.from_numpy(speech(14, seed=s))[None] for s in (1, 2))
    a, b = codec.open(), codec.open()
    shapes = {k: v.shape for k, v in codec.pool.items()}
    a_codes = [codec.encode([a], a_audio[:, i * FRAME:(i + 1) * FRAME]) for i in range(3)]
    a_pcm = [codec.decode([a], c) for c in a_codes]
    b_codes, b_pcm = [], []
    for i in range(11):
        pcm = torch.cat([a_audio[:, (i + 3) * FRAME:(i + 4) * FRAME], b_audio[:, i * FRAME:(i + 1) * FRAME]])
        codes = codec.encode([a, b], pcm)
        out = codec.decode([a, b], codes)
        a_codes.append(codes[:1]), b_codes.append(codes[1:])
        a_pcm.append(out[:1]), b_pcm.append(out[1:])
    for audio, codes, pcm, n in ((a_audio, a_codes, a_pcm, 14), (b_audio, b_codes, b_pcm, 11)):
        want_codes, want_audio = full_sequence(mimi, audio[:, :n * FRAME])
        assert torch.equal(torch.cat(codes, -1), want_codes)
        torch.testing.assert_close(torch.cat(pcm, -1), want_audio, rtol=1e-5, atol=1e-5 * float(want_audio.abs().max()))
    assert {k: v.shape for k, v in codec.pool.items()} == shapes   # nothing grew with the streams' age
    codec.close(a)
    assert codec.open().slot == a.slot   # rows are reused


# ------------------------------------------------------------------------------------------------ depth
def assert_depth_equals_transformers(depth: DepthTransformer, ref, hidden_size: int,
                                     dtype: torch.dtype = torch.float32) -> None:
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, hidden_size, generator=g).to(dtype)
    text = torch.randint(0, VOCAB, (3,), generator=g)
    with torch.no_grad():
        want = ref.generate(last_hidden_state=hidden[:, None], input_ids=text[:, None],
                            min_length=NUM_CODEBOOKS + 1, max_length=NUM_CODEBOOKS + 1,
                            do_sample=False, cache_implementation="static")[:, 1:]
        # and the logits of every step equal transformers' forward on the teacher-forced frame
        forced = ref(input_ids=torch.cat([text[:, None], want[:, :-1]], 1), last_hidden_state=hidden[:, None]).logits
    got = depth.generate(hidden, text)
    assert torch.equal(got, want)
    assert forced.argmax(-1).equal(want)


def test_depth_transformer_equals_transformers_greedy(moshi):
    path, ref = moshi
    heads = load_heads(Path(path), hf_config(read_config(Path(path))), torch.float32, "cpu")
    assert_depth_equals_transformers(DepthTransformer(heads.depth_decoder), ref.depth_decoder, ref.config.hidden_size)


def test_depth_transformer_in_bf16_equals_transformers_in_bf16(moshi):
    """The norms (one kernel each), the residual adds inside the output products and the attention in bf16 pick
    the codes transformers' bf16 depth decoder picks."""
    path, ref = moshi
    heads = load_heads(Path(path), hf_config(read_config(Path(path))), torch.bfloat16, "cpu")
    ref_depth = copy.deepcopy(ref.depth_decoder).to(torch.bfloat16)
    assert_depth_equals_transformers(DepthTransformer(heads.depth_decoder), ref_depth, ref.config.hidden_size,
                                     dtype=torch.bfloat16)


def test_depth_rms_norm_rounds_once_as_transformers():
    """In bf16 the norm is computed in float32 and rounded once (transformers' MoshiRMSNorm): against a float64
    oracle its error is no larger than MoshiRMSNorm's own (rounding twice would double it)."""
    from transformers.models.moshi.modeling_moshi import MoshiRMSNorm

    from metronome.audio.omni.moshi_heads import _rms_norm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2048, 512, generator=g) * 3).to(torch.bfloat16)
    norm = MoshiRMSNorm(512, eps=1e-8)
    with torch.no_grad():
        norm.weight.copy_((torch.rand(512, generator=g) + 0.5).to(torch.bfloat16))
        norm = norm.to(torch.bfloat16)
        x64, w64 = x.double(), norm.weight.double()
        exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-8) * w64
        theirs = (norm(x).double() - exact).abs().max()
        ours = (_rms_norm(x, norm.weight, 1e-8).double() - exact).abs().max()
    assert ours <= theirs * 1.01


def test_depth_transformer_with_grouped_kv_heads_equals_transformers():
    """Fewer key/value heads than query heads (the fused q/k/v product's split and the grouped attention)."""
    from transformers.models.moshi.modeling_moshi import MoshiDepthDecoder

    config = tiny_moshi_config()
    config.depth_decoder_config.num_attention_heads, config.depth_decoder_config.num_key_value_heads = 4, 2
    config.depth_decoder_config.head_dim = 8
    torch.manual_seed(6)
    ref = MoshiDepthDecoder._from_config(config.depth_decoder_config).eval()
    depth = DepthTransformer(copy.deepcopy(ref), cuda_graphs=False)
    assert depth.num_kv_heads < depth.num_heads
    assert_depth_equals_transformers(depth, ref, config.hidden_size)
    # the module's q/k/v weights are views of the fused one: one copy of the weights, and the same values
    attn = depth.depth.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.linear.weight.untyped_storage().data_ptr() == depth.qkv[0].untyped_storage().data_ptr()
    assert torch.equal(depth.qkv[0][:, :attn.q_proj.linear.weight.shape[1]], attn.q_proj.linear.weight)


# ------------------------------------------------------------------------------------------------ rollout
def rollout(adapter: MoshiAdapter, engine: Engine, user_frames: torch.Tensor):
    """Drive one session with given user codes [T, K]: engine + heads, as the worker does. → (text, columns)."""
    adapter.open_session("s", "", "")
    sid = engine.open_session()
    sess = adapter.sessions["s"]
    texts, columns = [], []
    for u in user_frames:
        embeds = adapter.column_embeds([sess], u[None])
        out = engine.step([StepInput(sid, embeds=embeds, return_hidden=True)])[0]
        adapter.on_hidden([("s", out.hidden)])
        texts.append(sess.text)
        columns.append(sess.moshi.clone())
    return texts, torch.stack(columns, 1)


def test_greedy_rollout_equals_transformers_generate(moshi):
    """Text tokens and Moshi's audio codes of a 6-frame greedy rollout equal MoshiForConditionalGeneration.generate
    with a one-frame prompt (initial tokens + the user's first frame) and the user's silence afterwards."""
    path, ref = moshi
    frames = 6
    g = torch.Generator().manual_seed(7)
    u0 = torch.randint(0, CODEBOOK, (1, NUM_CODEBOOKS, 1), generator=g)
    with torch.no_grad():
        blank = ref.audio_encoder.encode(torch.zeros(1, 1, FRAME), num_quantizers=NUM_CODEBOOKS).audio_codes
        want = ref.generate(input_ids=torch.tensor([[VOCAB]]), user_audio_codes=u0,
                            moshi_audio_codes=torch.full((1, NUM_CODEBOOKS, 1), CODEBOOK),
                            concat_unconditional_inputs=False, max_new_tokens=frames, do_sample=False,
                            depth_decoder_do_sample=False, return_audio_codes=True, return_audio_waveforms=True)
    user = torch.cat([u0[0].t(), blank[0].t().expand(frames - 1, -1)])
    engine = Engine(engine_config(path))
    adapter = make_adapter(path, engine)
    texts, columns = rollout(adapter, engine, user)
    assert texts == want.sequences[0, 1:].tolist()
    # audio frame f = codebook 0 of column f + codebooks 1.. of column f + 1 (f >= 1; frame 0 is the initial frame)
    cols = torch.cat([torch.full((NUM_CODEBOOKS, 1), CODEBOOK), columns], 1)
    got_frames = torch.stack([torch.cat([cols[:1, f], cols[1:, f + 1]]) for f in range(1, frames)], 1)
    assert torch.equal(got_frames, want.audio_codes[0])
    # and the audio the adapter spoke is transformers' decode of those codes (streaming: float rounding only)
    audio = np.frombuffer(adapter.take_audio("s"), "<i2").astype(np.float32) / 32767
    want_audio = want.audio_sequences[0, 0].clamp(-1, 1).numpy()
    assert audio.shape == want_audio.shape == ((frames - 1) * FRAME,)
    np.testing.assert_allclose(audio, want_audio, atol=2 / 32767)


def test_rollout_with_changing_user_audio_equals_transformers_forward(moshi):
    """Random user codes every frame (generate cannot take them after its prompt): transformers' forward with a
    cache, one frame at a time, its depth decoder's greedy generate, and its own delay pattern for the user's
    stream give the text tokens and Moshi's codes of our rollout."""
    path, ref = moshi
    frames = 6
    g = torch.Generator().manual_seed(8)
    user = torch.randint(0, CODEBOOK, (1, NUM_CODEBOOKS, frames), generator=g)
    delayed_user = ref.build_delay_pattern_mask(user, bos_token_id=CODEBOOK, pad_token_id=CODEBOOK,
                                                max_length=frames + 1)[0]
    text, moshi_col, cache = torch.tensor([[VOCAB]]), torch.full((1, NUM_CODEBOOKS, 1), CODEBOOK), None
    want_text, want_cols = [], []
    with torch.no_grad():
        for f in range(frames):
            out = ref(input_ids=text, user_audio_codes=delayed_user[..., f:f + 1], moshi_audio_codes=moshi_col,
                      past_key_values=cache, use_cache=True)   # (renamed `cache` after transformers 5.17)
            cache = out.cache if "cache" in out else out.past_key_values
            text = out.logits[:, -1].argmax(-1, keepdim=True)
            codes = ref.depth_decoder.generate(last_hidden_state=out.last_hidden_state[:, -1:], input_ids=text,
                                               min_length=NUM_CODEBOOKS + 1, max_length=NUM_CODEBOOKS + 1,
                                               do_sample=False)[:, 1:]
            if f == 0:   # column 1's delayed codebooks belong to the initial audio frame
                codes[:, 1:] = CODEBOOK
            moshi_col = codes[:, :, None]
            want_text.append(int(text))
            want_cols.append(codes[0])
    engine = Engine(engine_config(path))
    texts, columns = rollout(make_adapter(path, engine), engine, user[0].t())
    assert texts == want_text
    assert torch.equal(columns, torch.stack(want_cols, 1))
    engine = Engine(engine_config(path))   # and the user's codes matter: other codes, another rollout
    other = rollout(make_adapter(path, engine), engine, torch.randint(0, CODEBOOK, (frames, NUM_CODEBOOKS), generator=g))
    assert other[0] != texts or not torch.equal(other[1], columns)


def test_user_audio_changes_the_rollout_and_sessions_batch(moshi):
    """Two sessions with different audio in the same ticks match each one run alone (batched heads and depth)."""
    path, _ = moshi
    engine = Engine(engine_config(path))
    adapter = make_adapter(path, engine)
    audio = {"a": speech(4, seed=1), "b": speech(4, seed=2)}
    ids = {sid: engine.open_session() for sid in audio}
    for sid in audio:
        adapter.open_session(sid, "free_running", "")
    texts = {sid: [] for sid in audio}
    for t in range(4):
        prepared = adapter.prepare([TickAudio(sid, pcm=a[t * FRAME:(t + 1) * FRAME]) for sid, a in audio.items()])
        outs = engine.step([StepInput(ids[sid], embeds=p.embeds, return_hidden=True) for sid, p in zip(audio, prepared)])
        adapter.on_hidden([(sid, o.hidden) for sid, o in zip(audio, outs)])
        for sid in audio:
            texts[sid].append(adapter.sessions[sid].text)
    spoken = {sid: adapter.take_audio(sid) for sid in audio}
    assert all(len(spoken[sid]) == 3 * FRAME * 2 for sid in audio)
    for sid, a in audio.items():  # alone
        eng = Engine(engine_config(path))
        alone = make_adapter(path, eng)
        alone.open_session(sid, "", "")
        e = eng.open_session()
        mine = []
        for t in range(4):
            p = alone.prepare([TickAudio(sid, pcm=a[t * FRAME:(t + 1) * FRAME])])[0]
            alone.on_hidden([(sid, eng.step([StepInput(e, embeds=p.embeds, return_hidden=True)])[0].hidden)])
            mine.append(alone.sessions[sid].text)
        assert mine == texts[sid]
        # batched convolutions round differently in the last float bits: at most one PCM16 step apart
        np.testing.assert_allclose(pcm16(alone.take_audio(sid)), pcm16(spoken[sid]), atol=1)
    assert spoken["a"] != spoken["b"]


def test_partial_frames_wait_and_bad_input_is_refused(moshi):
    path, _ = moshi
    engine = Engine(engine_config(path))
    adapter = make_adapter(path, engine)
    adapter.open_session("s", "", "ignored: Moshi has no text prompt")
    a = speech(2, seed=4)
    first = adapter.prepare([TickAudio("s", pcm=a[:1000])])[0]
    assert first.embeds is None and not first.return_hidden and first.error is None
    second = adapter.prepare([TickAudio("s", pcm=a[1000:FRAME + 500])])[0]
    assert second.embeds.shape == (1, engine.spec.hidden_size) and second.return_hidden
    assert second.embeds_finite and torch.isfinite(second.embeds).all()   # the engine takes the adapter's word
    bad = adapter.prepare([TickAudio("s", pcm=np.array([np.nan] * FRAME, np.float32)),
                           TickAudio("ghost", pcm=a[:FRAME])])
    assert bad[0].error and bad[1].error and "ghost" in bad[1].error
    assert len(adapter.sessions["s"].pending) == 500           # the refused tick left the session as it was
    assert adapter.prepare([TickAudio("s", pcm=a[FRAME + 500:])])[0].embeds is not None
    with pytest.raises(ValueError):
        adapter.open_session("t", "turn", "")
    adapter.close_session("s")
    assert "s" not in adapter.sessions
    with pytest.raises(ConfigError, match="80"):
        build_adapter(AdapterContext(tokenizer=engine.tokenizer, checkpoint=engine.checkpoint, embed=engine.model.embed,
                                     device=engine.device, dtype=torch.float32, max_input_tokens=64, budget_ms=2000.0))


def test_mimi_codes_past_the_audio_embeddings_are_refused_at_load(moshi):
    """The user's codes index Moshi's audio embedding tables (stacked into one): a Mimi with more codes than the
    tables have rows is refused when the adapter is built, not read out of the next table."""
    path, _ = moshi
    engine = Engine(engine_config(path))
    heads = load_heads(Path(path), hf_config(read_config(Path(path))), torch.float32, "cpu")
    heads.audio_encoder.config.codebook_size = heads.audio_vocab_size + 1
    with pytest.raises(ModelLoadError, match="codebooks"):
        MoshiAdapter(heads, engine.tokenizer, engine.model.embed, engine.device, torch.float32)


# ------------------------------------------------------------------------------------------------ worker
async def test_worker_pcm_in_text_and_audio_out(moshi):
    """PCM16 at 24 kHz over gRPC Step → text and audio_pcm16 equal an in-process adapter + engine on the same audio."""
    import grpc

    from metronome.serving.proto import worker_pb2 as pb
    from metronome.serving.proto import worker_pb2_grpc
    from metronome.serving.worker import WorkerConfig, serve_worker

    path, _ = moshi
    worker = await serve_worker(WorkerConfig(engine_config(path), adapter="moshi", budget_ms=80.0, port=0,
                                             max_input_tokens=64))
    audio = speech(4, seed=9)
    chunks = [encode_pcm16(audio[t * FRAME:(t + 1) * FRAME]) for t in range(4)]
    # the oracle: the same PCM16 (as the worker decodes it) through a separate engine + adapter
    engine = Engine(engine_config(path))
    adapter = make_adapter(path, engine)
    adapter.open_session("u", "", "")
    eid = engine.open_session()
    want_text, want_audio = [], []
    for chunk in chunks:
        p = adapter.prepare([TickAudio("u", pcm=decode_pcm16(chunk))])[0]
        adapter.on_hidden([("u", engine.step([StepInput(eid, embeds=p.embeds, return_hidden=True)])[0].hidden)])
        want_text.append(adapter.on_output("u", [], False))
        want_audio.append(adapter.take_audio("u"))
    try:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            assert (await stub.OpenSession(pb.OpenSessionRequest(sid="u", mode="free_running"))).ok
            got_text, got_audio = [], []
            for tick, chunk in enumerate(chunks):
                reply = await stub.Step(pb.StepRequest(tick=tick, sessions=[
                    pb.SessionInput(sid="u", audio_pcm16=chunk, sample_rate=24000)]))
                out = reply.outputs[0]
                assert not out.error, out.error
                got_text.append(out.text)
                got_audio.append(out.audio_pcm16)
                if out.audio_pcm16:
                    assert out.audio_sample_rate == 24000
            assert (await stub.CloseSession(pb.CloseSessionRequest(sid="u"))).closed
    finally:
        await worker.stop(0)
    assert got_audio == want_audio
    assert got_text == want_text
    assert got_audio[0] == b"" and all(len(a) == 2 * FRAME for a in got_audio[1:])


# ------------------------------------------------------------------------------------------------ CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_graphs_equal_eager(moshi):
    """Mimi and the depth transformer replayed as CUDA graphs (batch buckets with padding rows, streams of
    different ages joining) give what the same code gives eagerly."""
    path, _ = moshi
    heads = load_heads(Path(path), hf_config(read_config(Path(path))), torch.float32, "cuda")
    eager, graphed = (MimiCodec(heads.audio_encoder, NUM_CODEBOOKS, cuda_graphs=g) for g in (False, True))
    # Batch sizes 1, 1, 2, 3 .. 3, 4 ..: buckets 1, 2, 4 (one padding row), 4. 13 frames are 26 steps of Mimi's
    # transformers, round their 21-slot key rings; the fourth stream grows the state pool (the graphs are
    # captured again) and joins at another age.
    starts = (0, 2, 3, 9)
    se, sg = {}, {}
    g = torch.Generator().manual_seed(11)
    for t in range(13):
        for i, s in enumerate(starts):
            if s == t:
                se[i], sg[i] = eager.open(), graphed.open()
        live = [i for i, s in enumerate(starts) if t >= s]
        pcm = (torch.randn(len(live), FRAME, generator=g) * 0.2).cuda()
        ce = eager.encode([se[i] for i in live], pcm)
        cg = graphed.encode([sg[i] for i in live], pcm)
        assert torch.equal(ce, cg)
        torch.testing.assert_close(graphed.decode([sg[i] for i in live], cg),
                                   eager.decode([se[i] for i in live], ce), rtol=1e-4, atol=1e-5)
    depth_e, depth_g = DepthTransformer(heads.depth_decoder, cuda_graphs=False), DepthTransformer(heads.depth_decoder)
    for n in (3, 5, 3):
        hidden = torch.randn(n, heads.lm_head.in_features, generator=g).cuda()
        text = torch.randint(0, VOCAB, (n,), generator=g).cuda()
        assert torch.equal(depth_g.generate(hidden, text), depth_e.generate(hidden, text))


@cuda
def test_cuda_rollout_follows_the_cpu_rollout(moshi, monkeypatch):
    """The whole adapter + engine on CUDA (graphs, Triton attention) against the CPU path on the same audio:
    text tokens equal, audio within a few PCM16 steps."""
    path, _ = moshi
    audio = speech(5, seed=12)

    def run(device: str):
        engine = Engine(EngineConfig(model=path, device=device, dtype="float32", num_blocks=64, max_chunk_tokens=8,
                                     policy=POLICY))
        adapter = build_adapter(AdapterContext(tokenizer=engine.tokenizer, checkpoint=engine.checkpoint,
                                               embed=engine.model.embed, device=engine.device, dtype=torch.float32,
                                               max_input_tokens=64, budget_ms=80.0))
        adapter.open_session("s", "", "")
        eid = engine.open_session()
        texts = []
        for t in range(5):
            p = adapter.prepare([TickAudio("s", pcm=audio[t * FRAME:(t + 1) * FRAME])])[0]
            adapter.on_hidden([("s", engine.step([StepInput(eid, embeds=p.embeds, return_hidden=True)])[0].hidden)])
            texts.append(adapter.sessions["s"].text)
        return texts, pcm16(adapter.take_audio("s"))

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)   # Mimi's convolutions in true float32
    cpu_text, cpu_audio = run("cpu")
    gpu_text, gpu_audio = run("cuda")
    assert gpu_text == cpu_text
    np.testing.assert_allclose(gpu_audio, cpu_audio, atol=8)


def test_text_padding_is_not_spoken(moshi):
    """Kyutai's text stream pads between words (ids 3 and 0): no text for those, the word for the others."""
    path, _ = moshi
    engine = Engine(engine_config(path))
    adapter = make_adapter(path, engine)
    adapter.open_session("s", "", "")
    sess = adapter.sessions["s"]
    codes = torch.zeros(NUM_CODEBOOKS, dtype=torch.long)
    for token in (3, 0, 3):
        adapter.advance(sess, token, codes)
    assert adapter.on_output("s", [], False) == ""
    adapter.advance(sess, 10, codes)
    assert adapter.on_output("s", [], False).strip() == engine.tokenizer.decode([10])


async def test_gateway_streams_moshi_audio_deltas(moshi):
    """A WebSocket client's 16 kHz PCM16 → gateway (80 ms ticks) → worker (resampled to 24 kHz, Moshi) →
    ``response.output_audio.delta`` events of one 80 ms frame each at 24 kHz."""
    import aiohttp

    from metronome.config import GatewayConfig
    from metronome.serving.gateway import serve_gateway
    from metronome.serving.worker import WorkerConfig, serve_worker
    from tests.serving.test_gateway import chunks, of_type, recv_until, tone

    path, _ = moshi
    worker = await serve_worker(WorkerConfig(engine_config(path), adapter="moshi", budget_ms=80.0, port=0,
                                             max_input_tokens=64))
    gateway = await serve_gateway(GatewayConfig(workers=(worker.address,), port=0, budget_ms=80.0, tokens_per_tick=1))
    try:
        async with aiohttp.ClientSession() as http, http.ws_connect(f"ws://{gateway.address}/v1/realtime") as ws:
            await recv_until(ws, of_type("session.created"))
            for chunk in chunks(tone(0.6)):
                await ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
            deltas = []
            while len(deltas) < 2:
                events = await recv_until(ws, of_type("response.output_audio.delta"), timeout=20.0)
                deltas.append(events[-1])
    finally:
        await gateway.stop()
        await worker.stop(0)
    for delta in deltas:
        assert delta["sample_rate"] == 24000
        assert len(base64.b64decode(delta["delta"])) == 2 * FRAME
