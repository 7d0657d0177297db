"""The Qwen3-Omni adapter: whole seconds of audio → the thinker's audio encoder → embeddings in its prompt.

Audio path, the model's own: Whisper log-mel features (16 kHz, 128 mel bins, 10 ms hop; the checkpoint's
``preprocessor_config.json`` when it has one, computed as Qwen3-Omni's processor does: ``padding=True``,
no truncation) and transformers' ``Qwen3OmniMoeAudioEncoder``, reused as is, its weights read from the
checkpoint's ``thinker.audio_tower.*``. The encoder convolves its input in chunks of ``2 * n_window``
mel frames (100 = 1 s, 13 embeddings each, the sinusoidal positions restarting per chunk) and attends
within windows of ``n_window_infer`` frames (800 = 8 s). A session's audio is therefore taken in whole
seconds: each tick's whole seconds (2 at B = 2 s: 26 embeddings) form one clip, encoded on its own
exactly as the encoder encodes a recording of that length; what is short of a second waits for the
next tick. No encoder state is carried between ticks (per session only < 1 s of audio, or at most
``max_pending_s`` while a turn-mode answer is being decoded). The cost of bounding the state: a clip
attends over itself (2 s), not over the 8-s windows an offline pass over a long recording would use.
Every tick, the clips of ALL sessions go through one feature extraction per clip length (one in the
steady state) and one encoder call; the encoder's window attention runs as one batched SDPA per layer
(``window_sdpa``) instead of transformers' per-window loop.

Prompt layout (Qwen3-Omni's chat template; ChatML turns)::

    header (first tick; what the sinks pin):  <|im_start|>system\\n{instructions}<|im_end|>\\n
    free running, first tick:   <|im_start|>user\\n<|audio_start|> 26 × <|audio_pad|> <|audio_end|>{instruction}
                                <|im_end|>\\n<|im_start|>assistant\\n                      decode max_tokens
    free running, later ticks:  <|audio_start|> 26 × <|audio_pad|> <|audio_end|>           decode max_tokens

``<|audio_pad|>`` rows are replaced by the encoder's outputs (transformers' ``masked_scatter``); the
other tokens are embedded with the decoder's table (``AdapterContext.embed``). The prepared input is
``embeds`` when audio is in it, else ``token_ids``.

Positions: with audio and text only, ``get_rope_index`` gives every token the next integer in all three
MRoPE components (audio tokens included), and interleaved MRoPE with three equal components is 1-D
RoPE: the engine's positions are exact (tests/models/omni/test_qwen3_omni.py checks it).

Modes, as the cascade adapter's:

* ``"free_running"`` (default; the paper's full-duplex sessions): once its first audio is heard the
  session decodes ``max_tokens`` every tick and keeps hearing: each tick's clip follows whatever the
  model said. Typed ``text`` closes the model's turn and enters as a user turn.
* ``"turn"``: audio opens a user turn and is appended clip by clip; ``new_turn`` (commit) also encodes
  the part-second left, closes the turn (with the instruction, on the first turn) and starts the
  answer, decoded ``max_tokens`` per tick until a stop token or ``max_response_tokens``; the next tick
  closes the assistant turn. Audio arriving during an answer waits (oldest dropped beyond
  ``max_pending_s``); ``new_turn``, ``text`` or ``cancel`` during an answer end it (barge-in).

Refused input (audio that is not 1-D or not finite, a tick's tokens beyond ``max_input_tokens``) gets
``PreparedInput.error``; the session is left exactly as it was.
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
# transformers routes the encoder's attention through a registered function whose name contains "flash"
# when it wants the packed (cu_seqlens) call; this one batches the windows through SDPA.
WINDOW_ATTENTION = "metronome_flash_windows_qwen3_omni"


# ---------------------------------------------------------------------------------------------- encoder
def window_sdpa(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                **kwargs):
    """Attention within each window of a packed sequence ([1, heads, T, dim]) in one SDPA call.

    Windows of equal length (every full clip) are a reshape; ragged ones are gathered into a padded
    batch with a key mask. Returns ([1, T, heads, dim], None) as flash-style implementations do.
    """
    del attention_mask, kwargs
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


def audio_tower_weight_name(stored: str) -> str | None:
    """A checkpoint tensor name → the audio encoder's parameter name, or None for every other part.

    >>> audio_tower_weight_name("thinker.audio_tower.layers.0.fc1.weight")
    'layers.0.fc1.weight'
    >>> audio_tower_weight_name("thinker.lm_head.weight") is None
    True
    """
    name = stored.removeprefix("thinker.")
    return name.removeprefix("audio_tower.") if name.startswith("audio_tower.") else None


def audio_config(config: dict):
    """The thinker's ``Qwen3OmniMoeAudioEncoderConfig`` from a full or thinker-only ``config.json``."""
    from transformers import Qwen3OmniMoeAudioEncoderConfig

    from metronome.models.omni.qwen3_omni import thinker_config

    raw = thinker_config(config).get("audio_config")
    if not isinstance(raw, dict):
        raise ModelLoadError("the thinker config has no audio_config")
    return Qwen3OmniMoeAudioEncoderConfig(**{k: v for k, v in raw.items() if k != "model_type"})


def build_audio_encoder(config, device: torch.device | str, dtype: torch.dtype, batched: bool = True) -> nn.Module:
    """transformers' ``Qwen3OmniMoeAudioEncoder`` of ``config``, uninitialised (fill it from a checkpoint).

    ``batched`` runs its window attention through ``window_sdpa`` (one SDPA per layer for the whole batch).
    """
    from transformers import AttentionInterface
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        encoder = Qwen3OmniMoeAudioEncoder._from_config(config)
    encoder = encoder.to_empty(device=device).to(dtype)
    table = encoder.positional_embedding  # a computed buffer: to_empty left it uninitialised
    with torch.no_grad():
        table.positional_embedding.copy_(table.compute_default_singular_positional_embedding())
    if batched:
        AttentionInterface.register(WINDOW_ATTENTION, window_sdpa)   # idempotent, process-wide registry
        encoder.config._attn_implementation = WINDOW_ATTENTION
    return encoder.eval().requires_grad_(False)


def output_tokens(frames: int, n_window: int) -> int:
    """Embeddings the encoder makes of ``frames`` mel frames (transformers' output-length formula)."""
    chunk = 2 * n_window
    rest = frames % chunk
    tail = 0 if rest == 0 else ((((rest - 1) // 2 + 1) - 1) // 2 + 1 - 1) // 2 + 1
    return tail + (frames // chunk) * 13


class AudioFrontEnd:
    """Whisper features + the audio tower over a batch of clips: ``encode(clips)`` → one [n_i, hidden] each."""

    def __init__(self, encoder: nn.Module, feature_extractor, device: torch.device | str, dtype: torch.dtype) -> None:
        self.encoder = encoder
        self.features = feature_extractor
        self.device = torch.device(device)
        self.dtype = dtype
        self.sample_rate = int(feature_extractor.sampling_rate)
        self.hop = int(feature_extractor.hop_length)
        self.n_window = int(encoder.config.n_window)
        self.block_samples = 2 * self.n_window * self.hop         # one conv chunk: 1 s
        self.tokens_per_block = output_tokens(2 * self.n_window, self.n_window)

    @classmethod
    def from_checkpoint(cls, checkpoint: Path, config: dict, device, dtype, batched: bool = True) -> "AudioFrontEnd":
        from metronome.models.loader import fill_weights

        encoder = build_audio_encoder(audio_config(config), device, dtype, batched)
        fill_weights(encoder, Path(checkpoint), audio_tower_weight_name)
        return cls(encoder, feature_extractor_for(checkpoint, encoder.config.num_mel_bins), device, dtype)

    def tokens(self, samples: int) -> int:
        return output_tokens(samples // self.hop, self.n_window)

    def extract(self, clips: list[np.ndarray]) -> list[torch.Tensor]:
        """Each clip's log-mel features [mel, frames], as the processor computes them for that clip alone
        (one extractor call per distinct length, so padding never changes a clip's features)."""
        out: list[torch.Tensor | None] = [None] * len(clips)
        by_length: dict[int, list[int]] = {}
        for i, clip in enumerate(clips):
            by_length.setdefault(clip.size, []).append(i)
        device = "cuda" if self.device.type == "cuda" else "cpu"
        for indices in by_length.values():
            feats = self.features([np.asarray(clips[i], np.float32) for i in indices], sampling_rate=self.sample_rate,
                                  padding=True, truncation=False, return_attention_mask=True, return_tensors="pt",
                                  device=device)
            frames = int(feats["attention_mask"][0].sum())
            for row, i in enumerate(indices):
                out[i] = feats["input_features"][row, :, :frames]
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def encode_features(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """The audio tower over every clip's features in one call, split per clip."""
        lengths = torch.tensor([f.shape[1] for f in features], dtype=torch.long)
        packed = torch.cat(features, dim=1).to(self.device, self.dtype)
        hidden = self.encoder(input_features=packed, feature_lens=lengths.to(self.device)).last_hidden_state
        return list(hidden.split([output_tokens(int(n), self.n_window) for n in lengths], dim=0))

    def encode(self, clips: list[np.ndarray]) -> list[torch.Tensor]:
        return self.encode_features(self.extract(clips)) if clips else []


def feature_extractor_for(checkpoint: Path | None, num_mel_bins: int):
    """The checkpoint's WhisperFeatureExtractor (``preprocessor_config.json``), else Qwen3-Omni's settings."""
    from transformers import WhisperFeatureExtractor

    if checkpoint is not None and (Path(checkpoint) / "preprocessor_config.json").is_file():
        extractor = WhisperFeatureExtractor.from_pretrained(checkpoint)
    else:
        extractor = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=SAMPLE_RATE, hop_length=160,
                                            n_fft=400)
    if extractor.feature_size != num_mel_bins:
        raise ModelLoadError(f"the feature extractor makes {extractor.feature_size} mel bins; the audio encoder "
                             f"takes {num_mel_bins}")
    return extractor


# ---------------------------------------------------------------------------------------------- adapter
@dataclass(frozen=True)
class AudioMarkers:
    """The thinker's audio token ids: ``start``/``end`` frame a clip, ``pad`` rows become encoder outputs."""

    start: int
    pad: int
    end: int

    @classmethod
    def resolve(cls, config: dict, tokenizer) -> "AudioMarkers":
        """Start and pad from the thinker config (the ids its placeholder mask uses); the end marker, which
        the config does not name, from the tokenizer (``<|audio_end|>``)."""
        from metronome.models.omni.qwen3_omni import thinker_config

        thinker = thinker_config(config)
        start, pad = int(thinker.get("audio_start_token_id", 151669)), int(thinker.get("audio_token_id", 151675))
        end = tokenizer.convert_tokens_to_ids("<|audio_end|>")
        if end is None or end == tokenizer.unk_token_id:
            raise ConfigError("the tokenizer has no <|audio_end|> token; Qwen3-Omni frames audio with it")
        return cls(start, pad, int(end))


@dataclass
class _Session:
    mode: str
    header: list[int]                     # emitted on the first tick, then cleared
    detok: IncrementalDetokenizer
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # audio not yet heard
    started: bool = False                 # the instruction + assistant prefix were emitted
    user_open: bool = False               # turn mode: a user turn holding audio is open
    responding: bool = False              # turn mode: an answer is being decoded
    response_tokens: int = 0
    close_next: list[int] = field(default_factory=list)   # turn mode: closes the answer that ended
    last_decoded: list[int] = field(default_factory=list)  # free running: the model's last token


class Qwen3OmniAdapter(InteractionAdapter):
    """Qwen3-Omni's audio front end and prompt layout for the thinker on the engine.

    ``instruction``: text after the first clip inside the first user turn (empty by default: the
    session's ``instructions`` become the system turn). ``max_response_tokens`` caps a turn-mode answer.
    """

    name = "qwen3_omni"
    modes = MODES

    def __init__(self, tokenizer, frontend: AudioFrontEnd, markers: AudioMarkers, embed, *,
                 max_input_tokens: int = 1024, instruction: str = "", max_response_tokens: int = 256,
                 max_pending_s: float = 4.0, default_mode: str = "free_running",
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
        self.max_response_tokens = max_response_tokens
        self.max_pending = max(frontend.block_samples, int(max_pending_s * frontend.sample_rate))
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids is not None else \
            default_stop_tokens(tokenizer, self.chat)
        framing = self._framing() + len(self.instruction) + 2
        # Whole seconds one tick may hear beside its framing within half the input cap (the rest waits).
        self.max_blocks = max(1, (max_input_tokens // 2 - framing) // frontend.tokens_per_block)
        self._sessions: dict[str, _Session] = {}

    def _framing(self) -> int:
        c = self.chat
        return len(c.user_prefix) + len(c.user_suffix) + len(c.generation_prompt) + len(c.assistant_suffix)

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, mode: str, instructions: str) -> None:
        mode = self.resolve_mode(mode)
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already open")
        header = session_header(self.chat, instructions, self.max_input_tokens)
        self._sessions[session_id] = _Session(mode, header, IncrementalDetokenizer(self.tokenizer))

    def close_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def input_tokens_per_tick(self, budget_ms: float) -> int:
        # The tick's audio plus what was pending (< 1 s) can complete one second more than the tick's length.
        block_ms = 1000.0 * self.frontend.block_samples / self.frontend.sample_rate
        blocks = min(self.max_blocks, math.ceil(budget_ms / block_ms) + 1)
        return blocks * self.frontend.tokens_per_block + 2 + self._framing()

    # ------------------------------------------------------------------ ticks
    def prepare(self, batch: list[TickAudio]) -> list[PreparedInput]:
        out: list[PreparedInput | None] = [None] * len(batch)
        planned: list[tuple[int, _Session, list[int], np.ndarray | None]] = []
        for i, tick in enumerate(batch):
            state = self._sessions.get(tick.session_id)
            if state is None:
                out[i] = PreparedInput(error=f"session {tick.session_id!r} is not open in the {self.name} adapter")
                continue
            problem = _pcm_problem(tick.pcm)
            if problem:
                out[i] = PreparedInput(error=problem)
                continue
            new = copy.copy(state)   # a refused tick leaves the session exactly as it was
            tokens, clip = self._advance(new, tick)
            if len(tokens) > self.max_input_tokens:
                out[i] = PreparedInput(error=f"this tick's input is {len(tokens)} tokens; at most "
                                             f"{self.max_input_tokens} fit in one tick (send shorter text)")
                continue
            self._sessions[tick.session_id] = new
            planned.append((i, new, tokens, clip))

        # One extraction per clip length and one encoder call for every session's clip this tick.
        encoded = iter(self.frontend.encode([clip for *_, clip in planned if clip is not None]))
        for i, state, tokens, clip in planned:
            tick = batch[i]
            embeds = self._splice(tokens, next(encoded)) if clip is not None else None
            if state.mode == "free_running":
                max_new, stops, ends = (max(0, tick.max_tokens) if state.started else 0), (), False
            else:
                left = self.max_response_tokens - state.response_tokens
                max_new = min(max(0, tick.max_tokens), left) if state.responding else 0
                stops, ends = self.stop_token_ids, state.responding and 0 < max_new >= left
            out[i] = PreparedInput(token_ids=None if embeds is not None else (tokens or None), embeds=embeds,
                                   max_new_tokens=max_new, stop_token_ids=stops, ends_response=ends)
        return out  # type: ignore[return-value]

    def _take(self, s: _Session, pcm: np.ndarray, flush: bool) -> np.ndarray | None:
        """The whole seconds of the session's audio (at most ``max_blocks``); with ``flush`` also the
        part-second left when it makes at least one embedding. The rest stays pending."""
        block, hop = self.frontend.block_samples, self.frontend.hop
        samples = np.concatenate([s.pending, pcm]) if s.pending.size else pcm
        blocks = min(samples.size // block, self.max_blocks)
        take = blocks * block
        if flush and blocks < self.max_blocks:
            whole_hops = samples.size // hop * hop
            if whole_hops > take and self.frontend.tokens(whole_hops - take) > 0:
                take = whole_hops
        s.pending = samples[take:]
        self._bound(s)
        return samples[:take] if take else None

    def _bound(self, s: _Session) -> None:
        if s.pending.size > self.max_pending:
            log.info("%d samples of pending audio dropped (max_pending_s)", s.pending.size - self.max_pending)
            s.pending = s.pending[-self.max_pending:]

    def _clip_tokens(self, clip: np.ndarray) -> list[int]:
        m = self.markers
        return [m.start] + [m.pad] * self.frontend.tokens(clip.size) + [m.end]

    def _advance(self, s: _Session, tick: TickAudio) -> tuple[list[int], np.ndarray | None]:
        chat = self.chat
        tokens = s.header + s.close_next
        s.header, s.close_next = [], []
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
            return tokens, clip

        starting = bool(tick.text) or tick.new_turn
        if s.responding and (tick.cancel or starting):
            tokens += chat.assistant_suffix   # the answer stops here (barge-in or cancel)
            s.responding = False
            s.detok = IncrementalDetokenizer(self.tokenizer)
        if s.responding:                      # hear it after the answer
            s.pending = np.concatenate([s.pending, pcm]) if s.pending.size else pcm
            self._bound(s)
            return tokens, None
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
        return tokens, clip

    def _splice(self, tokens: list[int], audio: torch.Tensor) -> torch.Tensor:
        """Embed ``tokens`` with the decoder's table; the encoder rows replace the ``<|audio_pad|>`` rows."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.frontend.device)
        embeds = self.embed(ids).clone()
        places = (ids == self.markers.pad).nonzero().squeeze(1)
        if places.numel() != audio.shape[0]:
            raise RuntimeError(f"{places.numel()} audio placeholders for {audio.shape[0]} encoder outputs")
        embeds[places] = audio.to(embeds.dtype)
        return embeds

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
                "user_open": s.user_open, "responding": s.responding, "response_tokens": s.response_tokens}

    @property
    def sessions(self) -> int:
        return len(self._sessions)


def _pcm_problem(pcm) -> str | None:
    a = np.asarray(pcm)
    if a.ndim != 1:
        return f"audio must be mono samples (1-D), got shape {a.shape}"
    if a.size and not np.isfinite(a).all():
        return "audio contains NaN or infinite samples"
    return None


def build_adapter(context: AdapterContext) -> Qwen3OmniAdapter:
    """The adapter over the engine's checkpoint: its audio tower, feature extractor and audio token ids."""
    from metronome.models.loader import read_config

    if context.checkpoint is None:
        raise ConfigError("the qwen3_omni adapter loads its audio encoder from the checkpoint directory; "
                          "this engine was built from a model object")
    config = read_config(Path(context.checkpoint))
    frontend = AudioFrontEnd.from_checkpoint(Path(context.checkpoint), config, context.device, context.dtype)
    return Qwen3OmniAdapter(context.tokenizer, frontend, AudioMarkers.resolve(config, context.tokenizer),
                            context.embed, max_input_tokens=context.max_input_tokens)
