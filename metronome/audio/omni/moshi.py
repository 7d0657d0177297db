"""The Moshi adapter: full duplex, one 80 ms frame per tick; Mimi in, text + Mimi out.

Per tick and session (B = 80 ms, ``sample_rate`` 24 kHz in and out):

1. ``prepare``: the session's 1920 new samples are Mimi-encoded (streaming, ``moshi_mimi.MimiCodec``)
   into the user's 8 codes u_s; the frame's input embedding is the sum of the text embedding of the text
   token chosen last tick (the engine's own table, ``AdapterContext.embed``) and the 16 audio embeddings
   of the delayed codebook column (``moshi_heads.AudioEmbeddings``); the engine gets it as
   ``PreparedInput(embeds=[1, hidden], return_hidden=True)``: one position of the temporal transformer,
   whose KV lives in the engine under SinkWindow. The embedding is a sum of table rows, finite by
   construction (``embeds_finite``), so the engine plans its step while Mimi's encoder still runs.
2. ``on_hidden`` (all sessions together): the text head picks text token s+1 and the depth transformer
   (``moshi_heads.DepthTransformer``, batched) Moshi's 8 codes of column s+1; Moshi's audio frame s is
   then complete and is Mimi-decoded (streaming) to 1920 samples of PCM16 for ``take_audio``.
3. ``on_output`` returns the text delta of the new text token (Kyutai's padding ids 0 and 3 and the
   tokenizer's special tokens skipped).

The delayed layout (transformers' ``build_delay_pattern_mask``, Kyutai's acoustic delay of one frame):
column s holds codebook 0 of audio frame s and codebooks 1..7 of audio frame s-1, for Moshi's stream
and the user's alike. Column 0 is the stream's opening: the initial text token (``vocab_size``),
Moshi's initial audio tokens (``audio_vocab_size``) and the user's codebook 0 of frame 0 with initial
tokens for the delayed codebooks. Audio frame 0 of Moshi is the initial frame, so column 1's delayed
codebooks are initial tokens whatever the depth transformer picked (as transformers' generate does),
and Moshi's first audible frame is frame 1, complete after tick 1. This is exactly transformers'
``MoshiForConditionalGeneration.generate`` with a one-frame prompt (the initial text/Moshi tokens and
the user's first frame) followed by the user's later frames (the tests check text and audio codes).

Per session the state is bounded: Mimi's streaming state (sliding-window KV + convolution tails), the
< 1 frame of unconsumed audio (plus at most ``max_backlog_frames`` of backlog, oldest dropped: Moshi
consumes exactly one frame per tick), the current column's tokens, the user's previous codes, the
detokeniser's window. ``close_session`` frees it.

Moshi has no text prompt: ``instructions`` are accepted and ignored. A tick without a whole frame of
audio leaves the session idle (nothing fed, nothing spoken). Sampling is greedy unless the adapter is
built with ``text_sampling`` / ``audio_sampling`` (Kyutai's defaults: temperature 0.7/0.8, top-k 25/250).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from metronome.audio.adapter import AdapterContext, InteractionAdapter, PreparedInput, TickAudio
from metronome.audio.detokenize import IncrementalDetokenizer
from metronome.audio.omni.moshi_heads import AudioEmbeddings, DepthTransformer, MoshiHeads, Sampling, load_heads
from metronome.audio.omni.moshi_mimi import MimiCodec, MimiStreamState
from metronome.device_copy import to_device
from metronome.errors import ConfigError, ModelLoadError

log = logging.getLogger(__name__)

SAMPLE_RATE = 24000
FRAME_MS = 80.0
# Kyutai's text stream: 3 pads between words, 0 ends a run of padding (its server prints neither).
KYUTAI_TEXT_PADDING = (0, 3)


@dataclass
class _Session:
    mimi: MimiStreamState
    detok: IncrementalDetokenizer
    text: int                      # text token of the next column
    moshi: torch.Tensor            # Moshi's K codes of the next column (delayed layout), long [K]
    user_prev: torch.Tensor        # the user's codes of the previous audio frame, long [K]
    step: int = 0                  # columns fed to the temporal transformer
    fed: bool = False              # a column went to the engine this tick (its hidden state is due)
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    text_out: str = ""
    audio_out: bytearray = field(default_factory=bytearray)


class MoshiAdapter(InteractionAdapter):
    name = "moshi"
    sample_rate = SAMPLE_RATE
    output_sample_rate = SAMPLE_RATE
    modes = ("free_running",)
    default_mode = "free_running"

    def __init__(self, heads: MoshiHeads, tokenizer, embed, device: torch.device, dtype: torch.dtype, *,
                 text_sampling: Sampling = Sampling(), audio_sampling: Sampling = Sampling(),
                 max_backlog_frames: int = 2, seed: int = 0, cuda_graphs: bool = True,
                 text_padding_ids: tuple[int, ...] = KYUTAI_TEXT_PADDING,
                 text_logits=None) -> None:
        """``text_logits``: hidden [n, hidden] → text logits (the engine decoder's ``compute_logits``);
        ``None`` uses ``heads.lm_head``."""
        self.heads = heads
        if text_logits is None and heads.lm_head is None:
            raise ConfigError("MoshiHeads without a text head need text_logits (the engine's compute_logits)")
        self.text_logits = text_logits or heads.lm_head
        self.tokenizer = tokenizer
        self.embed = embed
        self.device, self.dtype = torch.device(device), dtype
        self.num_codebooks = heads.num_codebooks
        self.vocab_size, self.audio_vocab_size = heads.vocab_size, heads.audio_vocab_size
        self.codec = MimiCodec(heads.audio_encoder, self.num_codebooks, cuda_graphs=cuda_graphs)
        if self.codec.sample_rate != SAMPLE_RATE:
            raise ModelLoadError(f"Mimi samples at {self.codec.sample_rate} Hz; the Moshi adapter expects {SAMPLE_RATE}")
        self.frame_size = self.codec.frame_size
        codebook_size = heads.audio_encoder.config.codebook_size
        if codebook_size > self.audio_vocab_size:   # the user's codes index the audio embedding tables
            raise ModelLoadError(f"Mimi's codebooks hold {codebook_size} codes; Moshi's audio embeddings "
                                 f"{self.audio_vocab_size}")
        self.depth = DepthTransformer(heads.depth_decoder, cuda_graphs=cuda_graphs)
        self.audio_embeds = AudioEmbeddings(heads.embed_tokens)
        self.text_sampling, self.audio_sampling = text_sampling, audio_sampling
        self.max_backlog = (1 + max_backlog_frames) * self.frame_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.text_padding_ids = frozenset(text_padding_ids)
        self.sessions: dict[str, _Session] = {}

    # ------------------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, mode: str, instructions: str) -> None:
        self.resolve_mode(mode)
        initial = torch.full((self.num_codebooks,), self.audio_vocab_size, dtype=torch.long, device=self.device)
        self.sessions[session_id] = _Session(mimi=self.codec.open(), detok=IncrementalDetokenizer(self.tokenizer),
                                             text=self.vocab_size, moshi=initial.clone(), user_prev=initial.clone())

    def close_session(self, session_id: str) -> None:
        sess = self.sessions.pop(session_id, None)
        if sess is not None:
            self.codec.close(sess.mimi)

    def input_tokens_per_tick(self, budget_ms: float) -> int:
        return 1  # one position per 80 ms frame

    # ------------------------------------------------------------------------------ input
    def prepare(self, batch: list[TickAudio]) -> list[PreparedInput]:
        out = [PreparedInput() for _ in batch]
        ready: list[tuple[int, _Session, np.ndarray]] = []
        for i, tick in enumerate(batch):
            sess = self.sessions.get(tick.session_id)
            if sess is None:
                out[i].error = f"unknown session {tick.session_id!r}"
                continue
            pcm = np.asarray(tick.pcm)
            if pcm.ndim != 1 or not np.isfinite(pcm).all():
                out[i].error = "audio must be finite mono samples"
                continue
            sess.fed = False
            pending = np.concatenate([sess.pending, pcm.astype(np.float32, copy=False)])
            if len(pending) > self.max_backlog:  # Moshi consumes one frame per tick: drop the oldest
                log.debug("session %s: %d samples of backlog dropped", tick.session_id, len(pending) - self.max_backlog)
                pending = pending[-self.max_backlog:]
            if len(pending) < self.frame_size:
                sess.pending = pending
                continue
            sess.pending = pending[self.frame_size:].copy()
            ready.append((i, sess, pending[:self.frame_size]))
        if ready:  # one Mimi encode for every session's frame
            frames = torch.from_numpy(np.stack([frame for _, _, frame in ready]))
            user = self.codec.encode([sess.mimi for _, sess, _ in ready], frames)[:, :, 0]
            embeds = self.column_embeds([sess for _, sess, _ in ready], user)
            for (i, _, _), row in zip(ready, embeds):
                out[i] = PreparedInput(embeds=row[None], return_hidden=True, embeds_finite=True)
        return out

    def column_embeds(self, sessions: list[_Session], user: torch.Tensor) -> torch.Tensor:
        """Feed each session's next column with the user's new codes ``user`` [N, K]; → embeds [N, hidden].

        Public so that tests can drive the adapter with given user codes (bypassing Mimi's encoder)."""
        user = user.to(self.device)
        moshi = torch.stack([sess.moshi for sess in sessions])
        previous = torch.stack([sess.user_prev for sess in sessions])
        columns = torch.cat([moshi, user[:, :1], previous[:, 1:]], 1)   # Moshi's K, then the user's K (delayed)
        for sess, u in zip(sessions, user.unbind(0)):
            sess.user_prev = u
            sess.fed = True
        with torch.no_grad():
            text = self.embed(to_device([sess.text for sess in sessions], self.device, torch.long))
            return text.to(self.dtype) + self.audio_embeds(columns).to(self.dtype)

    # ------------------------------------------------------------------------------ output
    def on_hidden(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        # Only sessions whose column went to the engine this tick (a stale hidden state must not advance one).
        fed = [(sid, h) for sid, h in batch if sid in self.sessions and self.sessions[sid].fed]
        if not fed:
            return
        sessions = [(sid, self.sessions[sid]) for sid, _ in fed]
        hidden = torch.stack([h for _, h in fed]).to(self.device, self.dtype)
        with torch.no_grad():
            text = self.text_sampling.pick(self.text_logits(hidden), self.generator)
            codes = self.depth.generate(hidden, text, self.audio_sampling, self.generator)
        # Moshi's audio frame s = codebook 0 of column s + codebooks 1.. of the new column s+1 (s >= 1;
        # frame 0 is the initial frame): one Mimi decode for every session that has one.
        speaking = [i for i, (_, sess) in enumerate(sessions) if sess.step > 0]
        if speaking:
            cb0 = torch.stack([sessions[i][1].moshi[0] for i in speaking])   # column s, not yet replaced
            frames = torch.cat([cb0[:, None], codes[speaking, 1:]], 1)[:, :, None]
            pcm = self.codec.decode([sessions[i][1].mimi for i in speaking], frames)
            pcm16 = (pcm.clamp(-1, 1) * 32767).round().to(torch.int16).cpu().numpy().astype("<i2")
            for row, i in enumerate(speaking):
                sessions[i][1].audio_out += pcm16[row].tobytes()
        columns = codes.clone()
        opening = [i for i, (_, sess) in enumerate(sessions) if sess.step == 0]
        if opening:  # column 1's delayed codebooks belong to audio frame 0, the initial frame
            columns[opening, 1:] = self.audio_vocab_size
        for (_, sess), t, column in zip(sessions, text.tolist(), columns.unbind(0)):
            self.advance(sess, int(t), column)

    def advance(self, sess: _Session, text: int, column: torch.Tensor) -> None:
        """The session's next column is (``text``, Moshi's codes ``column`` [K], delays applied)."""
        sess.text, sess.moshi = text, column
        sess.step += 1
        sess.fed = False
        if text not in self.text_padding_ids:   # Moshi's text stream is mostly padding between words
            sess.text_out += sess.detok.push([text])

    def on_output(self, session_id: str, token_ids: list[int], finished: bool) -> str:
        sess = self.sessions.get(session_id)
        if sess is None:
            return ""
        text, sess.text_out = sess.text_out, ""
        return text

    def take_audio(self, session_id: str) -> bytes:
        sess = self.sessions.get(session_id)
        if sess is None or not sess.audio_out:
            return b""
        audio = bytes(sess.audio_out)
        sess.audio_out.clear()
        return audio


def build_adapter(context: AdapterContext) -> MoshiAdapter:
    """The adapter over the engine's Moshi checkpoint (its heads and Mimi are read from ``context.checkpoint``)."""
    from metronome.models.weights import read_config
    from metronome.models.omni.moshi import hf_config

    if context.checkpoint is None:
        raise ConfigError("the moshi adapter needs a Moshi checkpoint directory")
    if abs(context.budget_ms - FRAME_MS) > 1e-6:
        raise ConfigError(f"the moshi adapter runs one {FRAME_MS:g} ms frame per tick; budget_ms must be "
                          f"{FRAME_MS:g}, got {context.budget_ms:g}")
    config = hf_config(read_config(Path(context.checkpoint)))
    shared = context.compute_logits is not None
    heads = load_heads(Path(context.checkpoint), config, context.dtype, context.device, text_head=not shared)
    return MoshiAdapter(heads, context.tokenizer, context.embed, context.device, context.dtype,
                        text_logits=context.compute_logits)
