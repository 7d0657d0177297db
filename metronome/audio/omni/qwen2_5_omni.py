"""The Qwen2.5-Omni adapter: 2-s audio blocks → the thinker's audio encoder → embeddings spliced into its prompt.

The audio path is the model's own: a Whisper log-mel front end (16 kHz, 128 mel bins, 10 ms hop; the
checkpoint's ``preprocessor_config.json`` when it has one) and transformers' ``Qwen2_5OmniAudioEncoder``
(reused as is, its weights read from the checkpoint's ``thinker.audio_tower.*``). The encoder attends
within windows of ``2 * n_window`` mel frames (200 = 2 s), so a session's audio is cut into 2-s blocks
and each block is encoded on its own: what the encoder does with the same features inside a long
recording (its windows never see each other), with no encoder state carried between ticks (per
session only the < 2 s of audio not yet forming a block is kept). The features themselves differ from
a whole-recording pass only at block edges (the STFT window sees zeros past the block, as the
processor pads a clip) and in Whisper's log-mel floor, taken per tick's clip instead of per recording.
A block gives 50 embeddings (25 per second, one per TMRoPE time step of 40 ms). Every tick, the blocks
of ALL sessions go through the feature extractor and the encoder in one call each.

Prompt layout (the Qwen2.5-Omni chat template; B = 2 s, so one block per tick)::

    header (first tick; what the sinks pin):  <|im_start|>system\\n{system prompt}<|im_end|>\\n
    free running, first tick:   <|im_start|>user\\n <|audio_bos|> 50 × <|AUDIO|> <|audio_eos|> {instruction}
                                <|im_end|>\\n<|im_start|>assistant\\n                       decode max_tokens
    free running, later ticks:  <|audio_bos|> 50 × <|AUDIO|> <|audio_eos|>                 decode max_tokens

``<|AUDIO|>`` rows are replaced by the encoder's outputs (as transformers' ``masked_scatter`` does);
the rest is embedded with the decoder's own table (``AdapterContext.embed``). The prepared input is
``embeds`` whenever audio is in it, else plain ``token_ids``.

Positions: for audio and text, TMRoPE's three components are equal and consecutive (transformers'
``get_rope_index`` gives every token, audio or text, the next integer), so the engine's 1-D positions
are exact (see ``metronome/models/omni/qwen2_5_omni.py`` and its tests).

Modes, as in the cascade adapter:

* ``"free_running"`` (default; the paper's full-duplex sessions): the session decodes ``max_tokens``
  every tick once its first audio has been heard, and keeps hearing: each tick's blocks are appended
  after whatever the model said. Typed ``text`` closes the model's turn and enters as a user turn.
* ``"turn"``: audio opens a user turn and is appended to it block by block; ``new_turn`` (commit) encodes
  the partial block too, closes the user turn (with the instruction on the session's first turn) and
  starts the answer, decoded ``max_tokens`` per tick until the stop token or ``max_response_tokens``;
  the next tick closes the assistant turn. Audio heard while answering is kept (at most
  ``max_pending_s``, the oldest dropped) and heard once the answer ends; ``new_turn``, ``text`` or
  ``cancel`` during an answer end it (barge-in).

Input the adapter refuses (non-finite or non-mono audio, typed text beyond ``max_input_tokens``) gets
``PreparedInput.error`` and leaves the session exactly as it was.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from metronome.audio.adapter import AdapterContext, InteractionAdapter, PreparedInput, TickAudio
from metronome.audio.chat import ChatTemplate
from metronome.audio.detokenize import IncrementalDetokenizer
from metronome.audio.turns import answer_close, default_stop_tokens, session_header
from metronome.errors import ConfigError, ModelLoadError

log = logging.getLogger(__name__)

MODES = ("free_running", "turn")
SAMPLE_RATE = 16000
# The system prompt Qwen2.5-Omni was tuned with (its model card asks for it verbatim).
SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
                 "auditory and visual inputs, as well as generating text and speech.")
# The name under which the packed encoder attention is registered with transformers (see PackedAttention).
PACKED_ATTENTION = "metronome_flash_packed_sdpa"


# ---------------------------------------------------------------------------------------------- encoder
def packed_sdpa(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                cu_seq_lens_k=None, max_length_q=None, max_length_k=None, is_causal=False, **kwargs):
    """Attention within each window of a packed sequence, ONE SDPA call for all windows.

    transformers' audio encoder hands flash-style implementations the packed sequence with its window
    boundaries (``cu_seq_lens``); its sdpa/eager path instead loops over the windows (32 layers × every
    session's block, each a tiny kernel). Here the windows are gathered into a padded batch
    [windows, heads, longest, dim] (a key-padding mask only when lengths differ), attended once and
    scattered back. query/key/value: [1, heads, T, dim]; returns ([1, T, heads, dim], None).
    """
    del attention_mask, max_length_q, max_length_k, is_causal, kwargs
    cu = cu_seq_lens_q.to(query.device, torch.long)
    lengths = cu[1:] - cu[:-1]
    longest = int(lengths.max())
    steps = torch.arange(longest, device=query.device)
    valid = steps[None, :] < lengths[:, None]                           # [windows, longest]
    index = (cu[:-1, None] + steps[None, :]).clamp_(max=query.shape[2] - 1)

    def windows(x: torch.Tensor) -> torch.Tensor:                       # [1, H, T, D] -> [W, H, L, D]
        return x[0][:, index].transpose(0, 1)

    mask = None if bool(valid.all()) else valid[:, None, None, :]
    out = F.scaled_dot_product_attention(windows(query), windows(key), windows(value), attn_mask=mask,
                                         dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2)[valid].unsqueeze(0), None               # [1, T, H, D]


def register_packed_attention() -> None:
    """Make ``PACKED_ATTENTION`` known to transformers (idempotent; its registry is process-wide)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)


def audio_tower_weight_name(stored: str) -> str | None:
    """A checkpoint tensor name → the audio encoder's parameter name, or None for every other part.

    >>> audio_tower_weight_name("thinker.audio_tower.layers.0.fc1.weight")
    'layers.0.fc1.weight'
    >>> audio_tower_weight_name("audio_tower.proj.bias")     # a thinker-only checkpoint
    'proj.bias'
    >>> audio_tower_weight_name("thinker.model.norm.weight") is None
    True
    """
    name = stored.removeprefix("thinker.").removeprefix("model.")
    return name.removeprefix("audio_tower.") if name.startswith("audio_tower.") else None


def audio_config(config: dict):
    """The thinker's ``Qwen2_5OmniAudioEncoderConfig`` from a full or thinker-only ``config.json``."""
    from transformers import Qwen2_5OmniAudioEncoderConfig

    from metronome.models.omni.qwen2_5_omni import thinker_config

    raw = thinker_config(config).get("audio_config")
    if not isinstance(raw, dict):
        raise ModelLoadError("the thinker config has no audio_config")
    return Qwen2_5OmniAudioEncoderConfig(**{k: v for k, v in raw.items() if k != "model_type"})


def build_audio_encoder(config, device: torch.device | str, dtype: torch.dtype, packed: bool = True) -> nn.Module:
    """transformers' ``Qwen2_5OmniAudioEncoder`` of ``config``, uninitialised (fill it from a checkpoint).

    ``packed`` runs its window attention through ``packed_sdpa`` (one call per layer for the whole batch).
    """
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        encoder = Qwen2_5OmniAudioEncoder._from_config(config)
    encoder = encoder.to_empty(device=device).to(dtype)
    table = encoder.positional_embedding  # a computed buffer: to_empty left it uninitialised
    with torch.no_grad():
        table.positional_embedding.copy_(table.compute_default_singular_positional_embedding())
    if packed:
        register_packed_attention()
        encoder.config._attn_implementation = PACKED_ATTENTION
    return encoder.eval().requires_grad_(False)


def load_audio_encoder(checkpoint: Path, config: dict, device: torch.device | str, dtype: torch.dtype,
                       packed: bool = True) -> nn.Module:
    """The checkpoint's audio tower on ``device`` in ``dtype``; every one of its weights must be found."""
    from metronome.models.loader import fill_weights

    encoder = build_audio_encoder(audio_config(config), device, dtype, packed)
    fill_weights(encoder, Path(checkpoint), audio_tower_weight_name)
    return encoder


def feature_extractor_for(checkpoint: Path | None, num_mel_bins: int):
    """The checkpoint's WhisperFeatureExtractor (``preprocessor_config.json``), else Qwen2.5-Omni's settings."""
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


class AudioFrontEnd:
    """Whisper features + the audio tower over a batch of clips: ``encode(clips)`` → one [n_i, hidden] each.

    Features are computed as Qwen2.5-Omni's processor computes them (zero padding after the clip, log-mel
    floor per clip), but only over the clip itself plus one FFT window instead of 30 s.
    """

    def __init__(self, encoder: nn.Module, feature_extractor, device: torch.device | str, dtype: torch.dtype) -> None:
        self.encoder = encoder
        self.features = feature_extractor
        self.device = torch.device(device)
        self.dtype = dtype
        self.sample_rate = int(feature_extractor.sampling_rate)
        self.hop = int(feature_extractor.hop_length)
        self.block_frames = 2 * int(encoder.config.n_window)   # the encoder's attention window
        self.block_samples = self.block_frames * self.hop

    @classmethod
    def from_checkpoint(cls, checkpoint: Path, config: dict, device, dtype, packed: bool = True) -> "AudioFrontEnd":
        encoder = load_audio_encoder(checkpoint, config, device, dtype, packed)
        return cls(encoder, feature_extractor_for(checkpoint, encoder.config.num_mel_bins), device, dtype)

    def frames(self, samples: int) -> int:
        """Mel frames of a clip of ``samples`` (the processor's attention-mask count)."""
        return -(-samples // self.hop)

    def tokens_for_frames(self, frames: int) -> int:
        """Embeddings the encoder makes of ``frames`` mel frames (transformers' output-length formula)."""
        after_conv = (frames - 1) // 2 + 1
        return max(0, (after_conv - 2) // 2 + 1)

    def tokens(self, samples: int) -> int:
        return self.tokens_for_frames(self.frames(samples))

    @property
    def tokens_per_block(self) -> int:
        return self.tokens_for_frames(self.block_frames)

    def extract(self, clips: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features of every clip, packed: ([mel, sum of frames], frames per clip)."""
        longest = max(c.size for c in clips) + self.features.n_fft
        longest = -(-longest // self.hop) * self.hop
        out = self.features([np.asarray(c, np.float32) for c in clips], sampling_rate=self.sample_rate,
                            padding="max_length", max_length=longest, truncation=False, return_attention_mask=True,
                            return_tensors="pt", device="cuda" if self.device.type == "cuda" else "cpu")
        lengths = torch.tensor([self.frames(c.size) for c in clips], dtype=torch.long)
        feats = torch.cat([f[:, :n] for f, n in zip(out["input_features"], lengths.tolist())], dim=1)
        return feats, lengths

    @torch.inference_mode()
    def encode_features(self, features: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """The audio tower over packed features ([mel, frames], frames per clip): one call, split per clip."""
        hidden = self.encoder(input_features=features.to(self.device, self.dtype),
                              feature_lens=lengths.to(self.device)).last_hidden_state
        counts = [self.tokens_for_frames(int(n)) for n in lengths]
        return list(hidden.split(counts, dim=0))

    def encode(self, clips: list[np.ndarray]) -> list[torch.Tensor]:
        if not clips:
            return []
        return self.encode_features(*self.extract(clips))


# ---------------------------------------------------------------------------------------------- adapter
@dataclass(frozen=True)
class AudioMarkers:
    """The thinker's audio token ids (from its config: the ids its embeddings and placeholder mask use)."""

    start: int   # <|audio_bos|>
    pad: int     # <|AUDIO|>, replaced by encoder outputs
    end: int     # <|audio_eos|>

    @classmethod
    def from_config(cls, config: dict) -> "AudioMarkers":
        from metronome.models.omni.qwen2_5_omni import thinker_config

        thinker = thinker_config(config)
        return cls(int(thinker.get("audio_start_token_id", 151647)),
                   int(thinker.get("audio_token_index", thinker.get("audio_token_id", 151646))),
                   int(thinker.get("audio_end_token_id", 151648)))


@dataclass
class _Session:
    mode: str
    header: list[int]                     # emitted on the first tick, then cleared
    detok: IncrementalDetokenizer
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # audio not yet heard
    started: bool = False                 # the first user turn (instruction + assistant prefix) was emitted
    user_open: bool = False               # turn mode: a user turn holding audio is open
    responding: bool = False              # turn mode: an answer is being decoded
    response_tokens: int = 0
    close_next: list[int] = field(default_factory=list)   # turn mode: closes the answer that ended
    last_decoded: list[int] = field(default_factory=list)  # free running: the model's last token


@dataclass
class _Plan:
    """One session's input this tick before encoding: token ids with a placeholder run per clip."""

    tokens: list[int]
    clips: list[np.ndarray]


class Qwen25OmniAdapter(InteractionAdapter):
    """Qwen2.5-Omni's audio front end and prompt layout for the thinker on the engine.

    ``frontend``: the feature extractor + audio tower (``AudioFrontEnd``). ``instruction``: text placed
    after the first audio of a session's first user turn ("" for none). ``system_prompt``: the header's
    content when a session gives no instructions. ``max_pending_s`` bounds the audio a session holds.
    """

    name = "qwen2_5_omni"
    modes = MODES

    def __init__(self, tokenizer, frontend: AudioFrontEnd, markers: AudioMarkers, embed, *,
                 max_input_tokens: int = 1024, instruction: str = "", system_prompt: str = SYSTEM_PROMPT,
                 max_response_tokens: int = 256, max_pending_s: float = 10.0, default_mode: str = "free_running",
                 stop_token_ids: tuple[int, ...] | None = None) -> None:
        if default_mode not in MODES:
            raise ConfigError(f"default_mode must be one of {MODES}, got {default_mode!r}")
        if max_response_tokens < 1:
            raise ConfigError("max_response_tokens must be >= 1")
        self.tokenizer = tokenizer
        self.frontend = frontend
        self.markers = markers
        self.embed = embed
        self.sample_rate = frontend.sample_rate
        self.chat = ChatTemplate(tokenizer)
        self.default_mode = default_mode
        self.max_input_tokens = max_input_tokens
        self.instruction = list(tokenizer.encode(instruction, add_special_tokens=False)) if instruction else []
        self.system_prompt = system_prompt
        self.max_response_tokens = max_response_tokens
        self.max_pending = max(frontend.block_samples, int(max_pending_s * frontend.sample_rate))
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids is not None else \
            default_stop_tokens(tokenizer, self.chat)
        # Whole blocks one tick may hear (the rest waits): what fits max_input_tokens beside the framing.
        framing = self._framing_tokens() + len(self.instruction) + 2
        self.max_blocks_per_tick = max(1, (max_input_tokens // 2 - framing) // max(1, frontend.tokens_per_block))
        self._sessions: dict[str, _Session] = {}

    def _framing_tokens(self) -> int:
        chat = self.chat
        return (len(chat.user_prefix) + len(chat.user_suffix) + len(chat.generation_prompt)
                + len(chat.assistant_suffix))

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, mode: str, instructions: str) -> None:
        mode = self.resolve_mode(mode)
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already open")
        header = session_header(self.chat, instructions or self.system_prompt, self.max_input_tokens)
        self._sessions[session_id] = _Session(mode, header, IncrementalDetokenizer(self.tokenizer))

    def close_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def input_tokens_per_tick(self, budget_ms: float) -> int:
        # A tick's audio plus what was pending can complete one block more than the tick's length.
        block_ms = 1000.0 * self.frontend.block_samples / self.frontend.sample_rate
        blocks = min(self.max_blocks_per_tick, math.ceil(budget_ms / block_ms) + 1)
        return blocks * self.frontend.tokens_per_block + 2 + self._framing_tokens()

    # ------------------------------------------------------------------ ticks
    def prepare(self, batch: list[TickAudio]) -> list[PreparedInput]:
        out: list[PreparedInput | None] = [None] * len(batch)
        plans: list[tuple[int, _Session, _Plan]] = []
        for i, tick in enumerate(batch):
            state = self._sessions.get(tick.session_id)
            if state is None:
                out[i] = PreparedInput(error=f"session {tick.session_id!r} is not open in the {self.name} adapter")
                continue
            error = _check_pcm(tick.pcm)
            if error:
                out[i] = PreparedInput(error=error)
                continue
            new = copy.copy(state)   # a refused tick leaves the session exactly as it was
            plan = self._advance(new, tick)
            if len(plan.tokens) > self.max_input_tokens:
                out[i] = PreparedInput(error=f"this tick's input is {len(plan.tokens)} tokens; at most "
                                             f"{self.max_input_tokens} fit in one tick (send shorter text)")
                continue
            self._sessions[tick.session_id] = new
            plans.append((i, new, plan))

        # One feature extraction and one encoder call for every clip of every session this tick.
        clips = [clip for _, _, plan in plans for clip in plan.clips]
        encoded = iter(self.frontend.encode(clips))
        for i, state, plan in plans:
            tick = batch[i]
            audio = [next(encoded) for _ in plan.clips]
            embeds = self._splice(plan.tokens, audio) if audio else None
            if state.mode == "free_running":
                max_new, stops, ends = (max(0, tick.max_tokens) if state.started else 0), (), False
            else:
                left = self.max_response_tokens - state.response_tokens
                max_new = min(max(0, tick.max_tokens), left) if state.responding else 0
                stops, ends = self.stop_token_ids, state.responding and 0 < max_new >= left
            out[i] = PreparedInput(token_ids=None if embeds is not None else (plan.tokens or None), embeds=embeds,
                                   max_new_tokens=max_new, stop_token_ids=stops, ends_response=ends)
        return out  # type: ignore[return-value]

    def _audio(self, s: _Session, pcm: np.ndarray, flush: bool) -> list[np.ndarray]:
        """Take whole blocks (at most ``max_blocks_per_tick``) of the session's audio; with ``flush`` the
        partial block too. What remains stays pending, bounded by ``max_pending`` (oldest dropped)."""
        block = self.frontend.block_samples
        samples = np.concatenate([s.pending, pcm]) if s.pending.size else pcm
        n = min(samples.size // block, self.max_blocks_per_tick)
        take = n * block
        if flush and n < self.max_blocks_per_tick and samples.size > take:
            take = samples.size if self.frontend.tokens(samples.size - take) > 0 else take
        s.pending = samples[take:]
        self._bound(s)
        return [samples[:take]] if take else []

    def _bound(self, s: _Session) -> None:
        if s.pending.size > self.max_pending:
            log.info("%d samples of pending audio dropped (max_pending_s)", s.pending.size - self.max_pending)
            s.pending = s.pending[-self.max_pending:]

    def _segment(self, clip: np.ndarray) -> list[int]:
        m = self.markers
        return [m.start] + [m.pad] * self.frontend.tokens(clip.size) + [m.end]

    def _advance(self, s: _Session, tick: TickAudio) -> _Plan:
        chat = self.chat
        tokens = s.header + s.close_next
        s.header, s.close_next = [], []
        pcm = np.asarray(tick.pcm, np.float32).reshape(-1)

        if s.mode == "free_running":
            clips = self._audio(s, pcm, flush=tick.new_turn)
            if clips and not s.started:
                tokens += chat.user_prefix + self._segment(clips[0]) + self.instruction + chat.user_suffix \
                    + chat.generation_prompt
                s.started = True
            elif clips:
                tokens += self._segment(clips[0])
            if tick.text:
                if s.last_decoded:   # close what the model was saying before the user's turn
                    tokens += answer_close(chat, s.last_decoded)
                    s.last_decoded = []
                tokens += chat.user_turn(tick.text, respond=True)
                s.started = True
            return _Plan(tokens, clips)

        starting = bool(tick.text) or tick.new_turn
        if s.responding and (tick.cancel or starting):
            tokens += chat.assistant_suffix   # the answer stops here (barge-in or cancel)
            s.responding = False
            s.detok = IncrementalDetokenizer(self.tokenizer)
        clips: list[np.ndarray] = []
        if s.responding:
            s.pending = np.concatenate([s.pending, pcm]) if s.pending.size else pcm
            self._bound(s)
            return _Plan(tokens, clips)
        clips = self._audio(s, pcm, flush=tick.new_turn)
        if clips:
            if not s.user_open:
                tokens += chat.user_prefix
                s.user_open = True
            tokens += self._segment(clips[0])
        if tick.text or (tick.new_turn and s.user_open):
            if s.user_open:
                tokens += ([] if s.started else self.instruction) + chat.user_suffix
                s.user_open = False
            tokens += chat.user_turn(tick.text, respond=True) if tick.text else chat.generation_prompt
            s.started = s.responding = True
            s.response_tokens = 0
        return _Plan(tokens, clips)

    def _splice(self, tokens: list[int], audio: list[torch.Tensor]) -> torch.Tensor:
        return splice(self.embed, tokens, self.markers.pad, audio, self.frontend.device)

    def on_output(self, session_id: str, token_ids: list[int], finished: bool) -> str:
        state = self._sessions.get(session_id)
        if state is None:
            return ""
        text = state.detok.push(token_ids)
        if state.mode == "free_running":
            if token_ids:
                state.last_decoded = [int(token_ids[-1])]
            return text
        state.response_tokens += len(token_ids)
        if finished:
            text += state.detok.flush()
            if state.responding:
                state.responding = False
                state.close_next = answer_close(self.chat, token_ids)
        return text

    # ------------------------------------------------------------------ introspection (tests, metrics)
    def session_state(self, session_id: str) -> dict:
        s = self._sessions[session_id]
        return {"mode": s.mode, "pending_samples": int(s.pending.size), "started": s.started,
                "user_open": s.user_open, "responding": s.responding, "response_tokens": s.response_tokens,
                "detok_held": s.detok.held}

    @property
    def sessions(self) -> int:
        return len(self._sessions)


def splice(embed, tokens: list[int], pad: int, audio: list[torch.Tensor], device) -> torch.Tensor:
    """Embed ``tokens`` with the decoder's table and put the encoder rows at the ``pad`` (``<|AUDIO|>``)
    places, in order: what transformers' thinker does with ``masked_scatter``."""
    ids = torch.tensor(tokens, dtype=torch.long)
    places = (ids == pad).nonzero().squeeze(1)     # found on the host: no device sync per session
    embeds = embed(ids.to(device))
    rows = torch.cat(audio, dim=0).to(embeds.dtype)
    if places.numel() != rows.shape[0]:
        raise RuntimeError(f"{places.numel()} audio placeholders for {rows.shape[0]} encoder outputs")
    embeds[places.to(device)] = rows
    return embeds


def _check_pcm(pcm) -> str | None:
    a = np.asarray(pcm)
    if a.ndim != 1:
        return f"audio must be mono samples (1-D), got shape {a.shape}"
    if a.size and not np.isfinite(a).all():
        return "audio contains NaN or infinite samples"
    return None


def build_adapter(context: AdapterContext) -> Qwen25OmniAdapter:
    """The adapter over the engine's checkpoint: its audio tower, feature extractor and audio token ids."""
    from metronome.models.loader import read_config

    if context.checkpoint is None:
        raise ConfigError("the qwen2_5_omni adapter loads its audio encoder from the checkpoint directory; "
                          "this engine was built from a model object")
    config = read_config(Path(context.checkpoint))
    frontend = AudioFrontEnd.from_checkpoint(Path(context.checkpoint), config, context.device, context.dtype)
    if frontend.sample_rate != SAMPLE_RATE:
        log.info("qwen2_5_omni feature extractor runs at %d Hz", frontend.sample_rate)
    return Qwen25OmniAdapter(context.tokenizer, frontend, AudioMarkers.from_config(config), context.embed,
                             max_input_tokens=context.max_input_tokens)
