"""What the Qwen2.5-Omni and Qwen3-Omni adapters share: a Qwen "thinker" hearing audio inside ChatML turns.

Both models put a clip of audio in the prompt as ``start`` + one ``pad`` per encoder output + ``end``
(their ``AudioMarkers``); the ``pad`` rows are replaced by the audio encoder's outputs (``splice``: what
transformers' thinkers do with ``masked_scatter``) and every other token is embedded with the decoder's
own table. Their audio encoders are transformers' own modules, built empty and filled from the
checkpoint (``build_audio_encoder``), with the window attention batched into one SDPA call per layer
(``window_sdpa``), and their features come from a Whisper feature extractor (``whisper_extractor``).

Prompt layout (``ThinkerAdapter``; the models' chat template, one clip per tick)::

    header (first tick; what the sinks pin):  <|im_start|>system\\n{instructions}<|im_end|>\\n
    free running, first clip:  <|im_start|>user\\n start pad... end {instruction}<|im_end|>\\n<|im_start|>assistant\\n
    free running, later ticks: start pad... end                                                decode max_tokens
    turn mode:                 <|im_start|>user\\n start pad... end [start pad... end ...] {instruction on the
                               first turn}<|im_end|>\\n<|im_start|>assistant\\n  decode until a stop token

A session keeps only the audio not yet heard (``pending``): what does not yet make a whole block of the
model's encoder (``frontend.block_samples``) and, in turn mode, what arrives during an answer (heard
once it ends), bounded by ``max_pending_s`` (the oldest dropped). A commit (``new_turn``) also hears the
partial block when it makes at least one embedding. The modes and the refusal of bad input are
``chat_session.ChatSessionAdapter``'s.

What differs between the two models is each one's own: the encoder class and its weight names, the
feature computation and the output-length formula (their ``AudioFrontEnd``), the marker ids, the
default system prompt and the bound on held audio.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from metronome.audio.adapter import TickAudio
from metronome.audio.chat import ChatTemplate
from metronome.audio.detokenize import IncrementalDetokenizer
from metronome.audio.omni.chat_session import ChatSession, ChatSessionAdapter
from metronome.audio.omni.tower_fp8 import quantize_tower_
from metronome.audio.omni.whisper_log_mel import WhisperLogMel
from metronome.audio.turns import answer_close, default_stop_tokens, session_header
from metronome.device_copy import to_device
from metronome.errors import ConfigError, ModelLoadError

log = logging.getLogger(__name__)

MODES = ("free_running", "turn")
SAMPLE_RATE = 16000
# transformers routes an encoder's attention through a registered function whose name contains "flash"
# when it wants the packed (cu_seqlens) call; this one batches the windows through SDPA.
WINDOW_ATTENTION = "metronome_flash_windows"


# ---------------------------------------------------------------------------------------------- encoder
def window_sdpa(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                **kwargs):
    """Attention within each window of a packed sequence ([1, heads, T, dim]) in one SDPA call.

    transformers' audio encoders hand flash-style implementations the packed sequence with its window
    boundaries (``cu_seq_lens``); their sdpa/eager path instead loops over the windows (every layer ×
    every session's clip, each a tiny kernel). Windows of equal length (every full window) are a
    reshape; ragged ones are gathered into a padded batch with a key mask. Returns
    ([1, T, heads, dim], None) as flash-style implementations do.
    """
    del module, attention_mask, kwargs
    heads, total, dim = query.shape[1:]
    bounds = cu_seq_lens_q.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if len(set(lengths)) == 1:
        n, length = len(lengths), lengths[0]

        def split(x):                                   # [1, H, T, D] -> [W, H, L, D]
            return x[0].view(heads, n, length, dim).transpose(0, 1)

        out = F.scaled_dot_product_attention(split(query), split(key), split(value), dropout_p=dropout, scale=scaling)
        return out.permute(0, 2, 1, 3).reshape(1, total, heads, dim), None
    longest = max(lengths)
    starts = torch.tensor(bounds[:-1], device=query.device)
    steps = torch.arange(longest, device=query.device)
    valid = steps[None, :] < torch.tensor(lengths, device=query.device)[:, None]      # [W, L]
    index = (starts[:, None] + steps[None, :]).clamp_(max=total - 1)

    def gather(x):
        return x[0][:, index].transpose(0, 1)          # [W, H, L, D]

    out = F.scaled_dot_product_attention(gather(query), gather(key), gather(value), attn_mask=valid[:, None, None, :],
                                         dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2)[valid].unsqueeze(0), None


def audio_encoder_config(config_class, thinker: dict):
    """``config_class`` (the model's audio encoder config) from the thinker's ``audio_config``."""
    raw = thinker.get("audio_config")
    if not isinstance(raw, dict):
        raise ModelLoadError("the thinker config has no audio_config")
    return config_class(**{k: v for k, v in raw.items() if k != "model_type"})


def build_audio_encoder(encoder_class, config, device: torch.device | str, dtype: torch.dtype,
                        windowed: bool = True) -> nn.Module:
    """transformers' ``encoder_class`` of ``config``, uninitialised (fill it from a checkpoint).

    ``windowed`` runs its window attention through ``window_sdpa`` (one SDPA per layer for the whole batch).
    """
    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        encoder = encoder_class._from_config(config)
    encoder = encoder.to_empty(device=device).to(dtype)
    table = encoder.positional_embedding  # a computed buffer: to_empty left it uninitialised
    with torch.no_grad():
        table.positional_embedding.copy_(table.compute_default_singular_positional_embedding())
    if windowed:
        from transformers import AttentionInterface

        AttentionInterface.register(WINDOW_ATTENTION, window_sdpa)   # idempotent, process-wide registry
        encoder.config._attn_implementation = WINDOW_ATTENTION
    return encoder.eval().requires_grad_(False)


def whisper_extractor(checkpoint: Path | None, num_mel_bins: int):
    """The checkpoint's WhisperFeatureExtractor (``preprocessor_config.json``), else the Qwen-Omni settings
    (16 kHz, 10 ms hop, 25 ms FFT, ``num_mel_bins``); it must make the mel bins the encoder takes."""
    from transformers import WhisperFeatureExtractor

    if checkpoint is not None and (Path(checkpoint) / "preprocessor_config.json").is_file():
        extractor = WhisperFeatureExtractor.from_pretrained(checkpoint)
    else:
        extractor = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=SAMPLE_RATE, hop_length=160,
                                            chunk_length=30, n_fft=400)
    if extractor.feature_size != num_mel_bins:
        raise ModelLoadError(f"the feature extractor makes {extractor.feature_size} mel bins; the audio encoder "
                             f"takes {num_mel_bins}")
    return extractor


class TowerFrontEnd:
    """Whisper features + a thinker's audio tower: what the models' ``AudioFrontEnd`` classes share.

    A model's subclass computes the features its processor would (``extract``), says how many embeddings
    its encoder makes of a clip (``tokens_for_frames``, ``tokens``) and how much of a partial block a
    commit can hear (``flush_samples``); ``run_tower`` is the one encoder call over every clip of a tick.
    ``quantization="fp8"`` swaps the encoder's block linear layers for FP8 ones, in place (``tower_fp8``).
    """

    def __init__(self, encoder: nn.Module, feature_extractor, device: torch.device | str, dtype: torch.dtype,
                 quantization: str | None = None) -> None:
        self.encoder = quantize_tower_(encoder, quantization)
        self.features = feature_extractor
        self.device = torch.device(device)
        self.dtype = dtype
        self.sample_rate = int(feature_extractor.sampling_rate)
        self.hop = int(feature_extractor.hop_length)
        self.log_mel = WhisperLogMel(feature_extractor, self.device)   # features kept on the tower's device

    def tokens_for_frames(self, frames: int) -> int:
        """Embeddings the encoder makes of ``frames`` mel frames (transformers' output-length formula)."""
        raise NotImplementedError

    @torch.inference_mode()
    def run_tower(self, features: torch.Tensor, lengths: torch.Tensor, window_bounds: np.ndarray,
                  **layout: torch.Tensor) -> list[torch.Tensor]:
        """The audio tower over packed features ([mel, frames], frames per clip): one call, split per clip.

        It is handed its attention windows' cumulative ``window_bounds`` on the host, where ``window_sdpa`` reads
        them (computed on the device, they were read back in every layer, a host sync each), and whatever more of
        its layout a model's encoder takes as keyword arguments (``layout``).
        """
        hidden = self.encoder(input_features=features.to(self.device, self.dtype), feature_lens=lengths.to(self.device),
                              cu_seqlens=torch.from_numpy(window_bounds),
                              max_seqlen=int(np.diff(window_bounds).max()), **layout).last_hidden_state
        return list(hidden.split([self.tokens_for_frames(int(n)) for n in lengths], dim=0))


def splice(embed, tokens: list[int], pad: int, audio: list[torch.Tensor], device) -> torch.Tensor:
    """Embed ``tokens`` with the decoder's table and put the encoder rows at the ``pad`` places, in order:
    what transformers' thinkers do with ``masked_scatter``."""
    return splice_all(embed, [tokens], pad, [audio], device)[0]


def splice_all(embed, tokens: list[list[int]], pad: int, audio: list[list[torch.Tensor]], device
               ) -> list[torch.Tensor]:
    """``splice`` for many prompts at once: one copy of the ids and the places, one lookup and one write of
    the rows, where a prompt at a time waits on the device twice a prompt (its copies are pageable). The prompts'
    rows are views of one tensor."""
    if len(audio) != len(tokens):
        raise ValueError(f"{len(tokens)} prompts and {len(audio)} lists of encoder rows: one list a prompt")
    sizes = [len(t) for t in tokens]
    ids = np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64, count=sum(sizes))
    places = np.flatnonzero(ids == pad)   # found on the host: no device sync
    counts = np.bincount(np.repeat(np.arange(len(sizes)), sizes)[places], minlength=len(sizes))
    for i, (count, rows) in enumerate(zip(counts, audio)):
        given = sum(int(r.shape[0]) for r in rows)
        if count != given:
            raise RuntimeError(f"{count} audio placeholders for {given} encoder outputs (prompt {i})")
    on_device = to_device(np.concatenate([ids, places]), device)
    embeds = embed(on_device[:ids.size])
    rows = [r for prompt in audio for r in prompt]
    if rows:
        embeds[on_device[ids.size:]] = torch.cat(rows, dim=0).to(embeds.dtype)
    return list(embeds.split(sizes))


# ---------------------------------------------------------------------------------------------- adapter
@dataclass(frozen=True)
class AudioMarkers:
    """The thinker's audio token ids: ``start``/``end`` frame a clip, ``pad`` rows become encoder outputs."""

    start: int
    pad: int
    end: int


class FrontEnd(Protocol):
    """What ``ThinkerAdapter`` needs of a model's ``AudioFrontEnd`` (features + audio tower)."""

    device: torch.device
    sample_rate: int
    block_samples: int       # the audio a tick hears in whole units of (the encoder's block)
    tokens_per_block: int

    def tokens(self, samples: int) -> int: ...                   # embeddings of a clip of ``samples``
    def flush_samples(self, samples: int) -> int: ...            # of ``samples`` pending, what a commit can hear
    def encode(self, clips: list[np.ndarray]) -> list[torch.Tensor]: ...


@dataclass
class ThinkerSession(ChatSession):
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # audio not yet heard


@dataclass
class _Plan:
    """One session's input this tick before encoding: token ids with a ``pad`` run for ``clip``, if any."""

    tokens: list[int]
    clip: np.ndarray | None = None


class ThinkerAdapter(ChatSessionAdapter):
    """A Qwen-Omni thinker's audio front end and prompt layout on the engine (module docstring).

    ``instruction``: text placed after the first audio of a session's first user turn ("" for none).
    ``system_prompt``: the header's content when a session gives no instructions ("": the chat
    template's own default). ``max_pending_s`` bounds the audio a session holds.
    """

    modes = MODES

    def __init__(self, tokenizer, frontend: FrontEnd, markers: AudioMarkers, embed, *, max_input_tokens: int,
                 instruction: str, system_prompt: str, max_response_tokens: int, max_pending_s: float,
                 default_mode: str, stop_token_ids: tuple[int, ...] | None) -> None:
        self._init_sessions(tokenizer, default_mode, max_input_tokens)
        if max_response_tokens < 1:
            raise ConfigError("max_response_tokens must be >= 1")
        self.frontend = frontend
        self.markers = markers
        self.embed = embed
        self.sample_rate = frontend.sample_rate
        self.chat = ChatTemplate(tokenizer)
        self.instruction = list(tokenizer.encode(instruction, add_special_tokens=False)) if instruction else []
        self.system_prompt = system_prompt
        self.max_response_tokens = max_response_tokens
        self.max_pending = max(frontend.block_samples, int(max_pending_s * frontend.sample_rate))
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids is not None else \
            default_stop_tokens(tokenizer, self.chat)
        # Whole blocks one tick may hear (the rest waits): what fits max_input_tokens beside the framing.
        framing = self._framing_tokens() + len(self.instruction) + 2
        self.max_blocks_per_tick = max(1, (max_input_tokens // 2 - framing) // max(1, frontend.tokens_per_block))

    def _framing_tokens(self) -> int:
        chat = self.chat
        return (len(chat.user_prefix) + len(chat.user_suffix) + len(chat.generation_prompt)
                + len(chat.assistant_suffix))

    def input_tokens_per_tick(self, budget_ms: float) -> int:
        # A tick's audio plus what was pending can complete one block more than the tick's length.
        block_ms = 1000.0 * self.frontend.block_samples / self.frontend.sample_rate
        blocks = min(self.max_blocks_per_tick, math.ceil(budget_ms / block_ms) + 1)
        return blocks * self.frontend.tokens_per_block + 2 + self._framing_tokens()

    # ------------------------------------------------------------------ ChatSessionAdapter
    def _new_session(self, mode: str, instructions: str) -> ThinkerSession:
        header = session_header(self.chat, instructions or self.system_prompt, self.max_input_tokens)
        return ThinkerSession(mode, header, IncrementalDetokenizer(self.tokenizer))

    def _live(self, s: ThinkerSession) -> bool:
        return s.started   # free running decodes once the first audio (or text) has been heard

    def _close_after(self, token_ids: list[int]) -> list[int]:
        return answer_close(self.chat, token_ids)

    def _plan_tokens(self, plan: _Plan) -> int:
        return len(plan.tokens)

    def _realise(self, planned: list[tuple[ThinkerSession, _Plan]]
                 ) -> list[tuple[list[int] | None, torch.Tensor | None]]:
        # One feature extraction and one encoder call for every clip of every session this tick.
        encoded = self.frontend.encode([plan.clip for _, plan in planned if plan.clip is not None])
        heard = [plan.tokens for _, plan in planned if plan.clip is not None]
        spliced = iter(splice_all(self.embed, heard, self.markers.pad, [[rows] for rows in encoded],
                                  self.frontend.device) if heard else [])
        return [(None, next(spliced)) if plan.clip is not None else (plan.tokens or None, None)
                for _, plan in planned]

    # ------------------------------------------------------------------ audio
    def _take(self, s: ThinkerSession, pcm: np.ndarray, flush: bool) -> np.ndarray | None:
        """Whole blocks of the session's audio (at most ``max_blocks_per_tick``); with ``flush`` also the
        partial block when it makes at least one embedding. What remains stays pending, bounded."""
        block = self.frontend.block_samples
        samples = np.concatenate([s.pending, pcm]) if s.pending.size else pcm
        blocks = min(samples.size // block, self.max_blocks_per_tick)
        take = blocks * block
        if flush and blocks < self.max_blocks_per_tick:
            heard = self.frontend.flush_samples(samples.size)
            if heard > take and self.frontend.tokens(heard - take) > 0:
                take = heard
        s.pending = samples[take:]
        self._bound(s)
        return samples[:take] if take else None

    def _bound(self, s: ThinkerSession) -> None:
        if s.pending.size > self.max_pending:
            log.info("%d samples of pending audio dropped (max_pending_s)", s.pending.size - self.max_pending)
            s.pending = s.pending[-self.max_pending:]

    def _clip_tokens(self, clip: np.ndarray) -> list[int]:
        m = self.markers
        return [m.start] + [m.pad] * self.frontend.tokens(clip.size) + [m.end]

    # ------------------------------------------------------------------ the state machine
    def _plan(self, s: ThinkerSession, tick: TickAudio) -> _Plan:
        chat = self.chat
        tokens = s.take_prefix()
        pcm = np.asarray(tick.pcm, np.float32).reshape(-1)

        if s.mode == "free_running":
            clip = self._take(s, pcm, flush=tick.new_turn)
            if clip is not None and not s.started:
                tokens += (chat.user_prefix + self._clip_tokens(clip) + self.instruction + chat.user_suffix
                           + chat.generation_prompt)
                s.started = True
            elif clip is not None:
                tokens += self._clip_tokens(clip)
            if tick.text:
                if s.last_decoded:   # close what the model was saying before the user's turn
                    tokens += answer_close(chat, s.last_decoded)
                    s.last_decoded = []
                tokens += chat.user_turn(tick.text, respond=True)
                s.started = True
            return _Plan(tokens, clip)

        starting = bool(tick.text) or tick.new_turn
        if s.responding and (tick.cancel or starting):
            tokens += chat.assistant_suffix   # the answer stops here (barge-in or cancel)
            s.cut_answer(self.tokenizer)
        if s.responding:                      # hear it after the answer
            s.pending = np.concatenate([s.pending, pcm]) if s.pending.size else pcm
            self._bound(s)
            return _Plan(tokens)
        clip = self._take(s, pcm, flush=tick.new_turn)
        if clip is not None:
            if not s.user_open:
                tokens += chat.user_prefix
                s.user_open = True
            tokens += self._clip_tokens(clip)
        if tick.text or (tick.new_turn and s.user_open):
            if s.user_open:
                tokens += ([] if s.started else self.instruction) + chat.user_suffix
                s.user_open = False
            tokens += chat.user_turn(tick.text, respond=True) if tick.text else chat.generation_prompt
            s.started = s.responding = True
            s.response_tokens = 0
        return _Plan(tokens, clip)

    # ------------------------------------------------------------------ introspection (tests, metrics)
    def session_state(self, session_id: str) -> dict:
        s = self._sessions[session_id]
        return {**super().session_state(session_id), "pending_samples": int(s.pending.size),
                "response_tokens": s.response_tokens}
