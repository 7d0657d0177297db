"""Engine: the public facade. Synchronous and single-threaded by design.

>>> from metronome import Engine, EngineConfig, KVPolicy, StepInput      # doctest: +SKIP
>>> engine = Engine(EngineConfig(policy=KVPolicy(sinks=16, window=1024)))  # doctest: +SKIP
>>> sid = engine.open_session()                                           # doctest: +SKIP
>>> ids = engine.tokenizer.apply_chat_template(
...     [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
>>> out, = engine.step([StepInput(sid, token_ids=ids, max_new_tokens=8)])  # doctest: +SKIP
>>> engine.tokenizer.decode(out.token_ids)                                # doctest: +SKIP
'The capital of France is Paris.'
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from time import perf_counter
from typing import Sequence

import torch

from metronome.config import EngineConfig
from metronome.engine.blocks import BlockPool
from metronome.engine.request import SamplingParams, StepInput, StepOutput
from metronome.engine.runner import DTYPES, ModelRunner, available_memory_bytes
from metronome.engine.sampling import sample
from metronome.engine.scheduler import ForwardSegment, InvariantError, Scheduler
from metronome.engine.session import Session, SessionStatus
from metronome.errors import ConfigError, MetronomeError
from metronome.models.llama import LlamaFamilyForCausalLM
from metronome.models.loader import load_model, load_tokenizer

log = logging.getLogger(__name__)


class SessionNotFound(MetronomeError, KeyError):
    """No open session has this id."""


@dataclass(frozen=True)
class EngineStats:
    kv_blocks_used: int
    kv_blocks_total: int       # usable blocks (the null block excluded)
    kv_blocks_reserved: int
    sessions: int
    capacity: int              # sessions the pool holds at their worst case
    blocks_per_session: int
    kv_bytes_per_block: int


@dataclass(frozen=True)
class SessionStats:
    num_tokens: int        # tokens the session has consumed (its age)
    kv_blocks: int         # blocks it holds now
    kv_bytes: int
    reservation: int       # blocks reserved at admission (0 for the Unbounded baseline)
    position_base: int     # rebased mode: how far the window's positions have been moved back
    positions: str
    status: str            # "active", "preempted" or "failed"
    error: str | None


@dataclass(frozen=True)
class StepTiming:
    prefill_ms: float
    decode_ms: float
    forwards: int
    decode_rounds: int


@dataclass
class _Work:
    """One session's progress through the current step."""

    output: StepOutput
    session: Session
    inp: StepInput
    remaining: int
    last_token: int | None = None        # sampled and not yet fed
    first_hidden: torch.Tensor | None = None  # hidden state whose logits give the first new token


@dataclass
class _Sampled:
    """One pipelined round's sampled ids (on the device) for ``works``, in order. With stop tokens to watch, a
    copy to pinned host memory starts at once, so reading it a round later waits for that copy only, not
    for the round launched since (``tolist`` on a CUDA tensor would wait for the whole stream)."""

    works: list[_Work]
    ids: torch.Tensor
    host: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    _tokens: list[int] | None = None   # read once: by the stop check a round later, then at the step's end

    @classmethod
    def of(cls, works: list[_Work], ids: torch.Tensor, watch: bool) -> _Sampled:
        if not watch or ids.device.type != "cuda":
            return cls(works, ids)
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(works, ids, host, event)

    def tokens(self) -> list[int]:
        if self._tokens is None:
            if self.copied is not None:
                self.copied.synchronize()
            self._tokens = (self.host if self.copied is not None else self.ids).tolist()
        return self._tokens

    def read(self) -> list[tuple[_Work, int]]:
        return list(zip(self.works, self.tokens()))

    def token_of(self, work: _Work) -> int:
        return self.tokens()[next(i for i, w in enumerate(self.works) if w is work)]


class Engine:
    def __init__(self, config: EngineConfig, model: LlamaFamilyForCausalLM | None = None,
                 checkpoint: Path | None = None) -> None:
        """``model``: an already built decoder on ``config.device`` (benchmarks with random weights);
        by default it is loaded from ``config.model``. ``checkpoint``: with ``model``, the directory its
        tokenizer and chat template come from (none by default)."""
        self.config = config
        self.device = torch.device(config.device)
        dtype = DTYPES[config.dtype]
        if model is None:
            self.model, self.checkpoint = load_model(config.model, dtype, self.device)
        else:
            self.model, self.checkpoint = model, checkpoint
        self.spec = self.model.spec
        self.max_model_len = self.spec.max_position_embeddings
        policy = config.policy
        block_bytes = self.spec.kv_bytes_per_token(dtype) * policy.block_size
        num_blocks = config.num_blocks or self._blocks_from_memory(block_bytes)
        self.kv_bytes_per_block = block_bytes
        self.scheduler = Scheduler(policy, BlockPool(num_blocks), config.max_chunk_tokens,
                                   self.max_model_len, config.max_batch_tokens)
        if policy.positions == "rebased":
            self.scheduler.check_rebased_fits()
        if policy.bounded and self.scheduler.capacity < 1:
            raise ConfigError(
                f"the KV pool ({num_blocks - 1} blocks) cannot hold one session "
                f"({self.scheduler.session_blocks} blocks); raise num_blocks or shrink the window")
        self.runner = ModelRunner(config, self.model, num_blocks)
        if config.cuda_graphs and self.device.type == "cuda" and config.attention == "triton":
            max_batch = min(1024, max(1, self.scheduler.capacity if policy.bounded else 256))
            self.runner.capture_decode_graphs(max_batch, self.scheduler.session_blocks)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.last_timing = StepTiming(0.0, 0.0, 0, 0)
        log.info("engine ready: %s, %d KV blocks of %d tokens, %d blocks per session, capacity %d sessions",
                 self.checkpoint, num_blocks - 1, policy.block_size, self.scheduler.session_blocks,
                 self.scheduler.capacity)

    def _blocks_from_memory(self, block_bytes: int) -> int:
        budget = int(available_memory_bytes(self.device) * self.config.kv_memory_fraction)
        return max(2, budget // block_bytes + 1)

    @cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer (with its chat template), loaded on first use."""
        if self.checkpoint is None:
            raise MetronomeError("this engine was built from a model object and has no tokenizer")
        return load_tokenizer(self.checkpoint)

    # ------------------------------------------------------------------ sessions
    def open_session(self, positions: str | None = None) -> int:
        """Admit a session, reserving its worst-case KV; raises ``AdmissionError`` if it does not fit.

        ``positions`` overrides the policy's position mode for this session ("absolute" or "rebased").
        """
        return self.scheduler.admit(positions).session_id

    def close_session(self, session_id: int) -> None:
        """End a session and return every block it held (its reservation too)."""
        self.scheduler.close(self._session(session_id))

    def _session(self, session_id: int) -> Session:
        try:
            return self.scheduler.sessions[session_id]
        except KeyError:
            raise SessionNotFound(f"unknown session {session_id}") from None

    def stats(self) -> EngineStats:
        pool = self.scheduler.pool
        return EngineStats(
            kv_blocks_used=pool.used, kv_blocks_total=pool.usable, kv_blocks_reserved=pool.reserved,
            sessions=len(self.scheduler.sessions), capacity=self.scheduler.capacity,
            blocks_per_session=self.scheduler.session_blocks, kv_bytes_per_block=self.kv_bytes_per_block)

    def session_stats(self, session_id: int) -> SessionStats:
        s = self._session(session_id)
        return SessionStats(num_tokens=s.num_tokens, kv_blocks=s.live_blocks,
                            kv_bytes=s.live_blocks * self.kv_bytes_per_block, reservation=s.reservation,
                            position_base=s.position_base, positions=s.positions, status=s.status.value,
                            error=s.error)

    # ------------------------------------------------------------------ validation
    def _validate(self, inp: StepInput, seen) -> str | None:
        session = self.scheduler.sessions.get(inp.session_id)
        if session is None:
            return f"unknown session {inp.session_id}"
        if inp.session_id in seen:
            return f"session {inp.session_id} appears more than once in one step"
        if session.status is SessionStatus.FAILED:
            return f"session {inp.session_id} has ended: {session.error}"
        if not isinstance(inp.sampling, SamplingParams):
            return "sampling must be a SamplingParams"
        if not isinstance(inp.max_new_tokens, numbers.Integral) or inp.max_new_tokens < 0:
            return f"max_new_tokens must be an integer >= 0, got {inp.max_new_tokens!r}"
        if inp.token_ids is not None and inp.embeds is not None:
            return "give token_ids or embeds, not both"
        if inp.return_hidden and inp.max_new_tokens:
            return "return_hidden needs max_new_tokens=0 (the hidden state of the last input position)"
        n = 0
        if inp.token_ids is not None:
            ids = inp.token_ids
            n = len(ids)
            vocab = self.spec.vocab_size
            for t in ids:
                if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab:
                    return f"token id {t!r} is not an integer in [0, {vocab})"
        if inp.embeds is not None:
            e = inp.embeds
            if not isinstance(e, torch.Tensor) or e.dim() != 2 or e.shape[1] != self.spec.hidden_size:
                shape = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
                return f"embeds must be a tensor of shape [n, {self.spec.hidden_size}], got {shape}"
            if e.shape[0] == 0:
                return "embeds must have at least one row (send embeds=None for no new input)"
            if not torch.isfinite(e).all():
                return "embeds contain NaN or infinite values"
            n = int(e.shape[0])
        if n > self.config.max_chunk_tokens:
            return f"chunk of {n} tokens exceeds max_chunk_tokens={self.config.max_chunk_tokens}"
        if inp.return_hidden and n == 0 and session.pending_token is None and not session.stop_written:
            return "return_hidden needs new input this step (its hidden state is the last input position's)"
        if (inp.max_new_tokens > 0 and n == 0 and session.pending_token is None
                and session.last_hidden is None and not session.history):
            return "nothing to decode from: the session has no context yet; send input first"
        return None

    # ------------------------------------------------------------------ forwards
    def _forward(self, segments: list[ForwardSegment], works: dict[int, _Work],
                 input_ids: torch.Tensor | None = None) -> tuple[list[ForwardSegment], torch.Tensor]:
        """Rebase, allocate, run, commit. Segments of preempted sessions are dropped (and reported)."""
        moves = [(seg.session, delta) for seg in segments if (delta := self.scheduler.rebase_delta(seg.session))]
        if moves:
            self.runner.rebase(moves)
        kept, preempted = self.scheduler.allocate(segments)
        for session in preempted:
            work = works.get(session.session_id)
            if work is not None:
                work.output.preempted = True
                work.remaining = 0
        if not kept:
            return kept, torch.empty(0)
        if input_ids is not None and len(kept) != len(segments):
            raise InvariantError("a pipelined decode round lost a segment")
        hidden = self.runner.forward(kept, input_ids)
        self.scheduler.commit(kept)
        # One op for the whole batch (per-row indexing costs microseconds each, every round).
        if len(hidden) == len(kept):
            rows = hidden.unbind(0)
        else:
            ends = torch.tensor([len(seg) for seg in kept]).cumsum(0).sub_(1).to(hidden.device, non_blocking=True)
            rows = hidden.index_select(0, ends).unbind(0)
        for seg, row in zip(kept, rows):
            seg.session.last_hidden = row
        self._forwards += 1
        return kept, hidden

    def _segment(self, work: _Work, token_ids: list[int], embeds: torch.Tensor | None = None) -> ForwardSegment | None:
        """The next segment of a session, or None if it would pass the position limit (the session then ends)."""
        seg = ForwardSegment(work.session, token_ids, embeds)
        error = self.scheduler.position_error(work.session, len(seg))
        if error:
            self._fail(work, error)
            return None
        self.scheduler.record_history(work.session, seg)
        return seg

    def _fail(self, work: _Work, reason: str) -> None:
        self.scheduler.fail(work.session, reason)
        work.output.error = reason
        work.remaining = 0
        work.last_token = None

    def _restore(self, work: _Work, new_tokens: int) -> bool:
        """Unbounded baseline: recompute a preempted session's history if the pool has room now."""
        session = work.session
        need = self.scheduler.restore_blocks_needed(session, new_tokens + work.remaining)
        if self.scheduler.pool.free_count < need:
            return False
        session.status = SessionStatus.ACTIVE
        limit = self.config.max_batch_tokens
        for piece in list(session.history):
            for start in range(0, len(piece), limit):
                ids = piece.token_ids[start:start + limit] if piece.token_ids is not None else []
                emb = piece.embeds[start:start + limit] if piece.embeds is not None else None
                self._forward([ForwardSegment(session, ids, emb)], {})
        log.info("restored session %d (%d tokens recomputed)", session.session_id, session.num_tokens)
        return True

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def step(self, inputs: Sequence[StepInput]) -> list[StepOutput]:
        """Prefill every session's new input, then decode up to ``max_new_tokens`` in shared rounds.

        Returns one output per input, in order. A session's error is reported on its output only.
        """
        t0 = perf_counter()
        self._forwards = 0
        outputs = [StepOutput(session_id=inp.session_id) for inp in inputs]
        works: dict[int, _Work] = {}
        for out, inp in zip(outputs, inputs):
            error = self._validate(inp, works)
            if error:
                out.error = error
                log.warning("step input for session %s refused: %s", inp.session_id, error)
                continue
            works[inp.session_id] = _Work(out, self._session(inp.session_id), inp, inp.max_new_tokens)

        prefill: list[tuple[_Work, ForwardSegment]] = []
        for work in works.values():
            session, inp = work.session, work.inp
            pending = [session.pending_token] if session.pending_token is not None else []
            if inp.prompt_logprobs and inp.token_ids is not None:
                work.output.prompt_logprobs = self._logprob_context(work, pending)
            token_ids = pending + list(inp.token_ids or [])
            if session.status is SessionStatus.PREEMPTED and not self._restore(work, len(token_ids)):
                work.output.preempted = True
                work.remaining = 0
                self._segment(work, token_ids, inp.embeds)  # kept in history: nothing is lost
                session.pending_token = None
                continue
            session.stop_written = False      # consumed: this step's first hidden state follows the stop token
            if not token_ids and inp.embeds is None:
                work.first_hidden = session.last_hidden
                continue
            seg = self._segment(work, token_ids, inp.embeds)
            session.pending_token = None
            if seg is not None:
                prefill.append((work, seg))

        by_segment = {id(seg): work for work, seg in prefill}
        for batch in self.scheduler.pack([seg for _, seg in prefill]):
            kept, hidden = self._forward(batch, works)
            start = 0
            for seg in kept:
                work = by_segment[id(seg)]
                rows = hidden[start:start + len(seg)]
                start += len(seg)
                work.first_hidden = rows[-1]
                if work.output.prompt_logprobs is not None:
                    self._fill_prompt_logprobs(work, rows)
        for work in works.values():
            if work.inp.return_hidden and work.first_hidden is not None:
                work.output.hidden = work.first_hidden.clone()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t1 = perf_counter()

        rounds = self._decode(list(works.values()))
        for work in works.values():
            if work.last_token is not None:
                work.session.pending_token = work.last_token
        self.scheduler.check_invariants()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_timing = StepTiming((t1 - t0) * 1e3, (perf_counter() - t1) * 1e3, self._forwards, rounds)
        return outputs

    def _pipelinable(self, active: list[_Work]) -> bool:
        """Greedy rounds of bounded sessions need no host sync per round (stop tokens are read a round late)."""
        graphs = self.runner.graphs
        return (self.config.policy.bounded and (graphs is None or len(active) <= graphs.buckets[-1])
                and all(w.inp.sampling.greedy for w in active))

    def _decode_pipelined(self, active: list[_Work]) -> int:
        """Decode rounds whose sampled ids stay on the device and feed the next round directly.

        The host does all bookkeeping (positions, blocks, rebasing) each round, since none of it depends
        on token values. Stop tokens are read one round late, from a round that has already finished
        (through a pinned host copy, so the host never waits for the round in flight): a session that
        sampled a stop token in round r has been fed it in round r + 1 before the host knows, and leaves
        from round r + 2. That write is the one its next step would make first (the stop token joins the
        context either way), so the session ends the step with the stop token in its cache and nothing
        pending, where the per-round path leaves it pending; the context is the same. Tokens sampled after
        a stop are dropped.
        """
        ids = self.runner.compute_logits(torch.stack([w.first_hidden for w in active])).argmax(-1)
        stops = any(w.inp.sampling.stop_token_ids for w in active)
        sampled: list[_Sampled] = [_Sampled.of(active, ids, stops)]
        current, rounds = active, 0
        for w in active:
            w.remaining -= 1
        while True:
            if stops and len(sampled) >= 2:   # the tokens fed in the round just launched: computed already
                for w, token in sampled[-2].read():
                    if token in w.inp.sampling.stop_token_ids:
                        w.remaining = 0
            live, keep, segments = [], [], []
            for i, w in enumerate(current):
                if w.remaining <= 0 or w.session.status is not SessionStatus.ACTIVE:
                    continue
                if (w.inp.sampling.stop_token_ids and self.scheduler.position_error(w.session, 1)
                        and sampled[-1].token_of(w) in w.inp.sampling.stop_token_ids):
                    # At the position limit the unread token cannot be fed; read it now (rare): a stop ends
                    # the decode as the per-round path would, anything else fails the session there.
                    w.remaining = 0
                    continue
                # The token stays on the device; [0] only holds its place (bounded: no history is kept).
                seg = self._segment(w, [0])
                if seg is not None:
                    live.append(w)
                    keep.append(i)
                    segments.append(seg)
            if not live:
                break
            if len(live) != len(current):
                ids = ids.index_select(0, torch.tensor(keep).to(ids.device, non_blocking=True))
            _, hidden = self._forward(segments, {}, input_ids=ids)
            rounds += 1
            ids = self.runner.compute_logits(hidden).argmax(-1)
            sampled.append(_Sampled.of(live, ids, stops))
            for w in live:
                w.remaining -= 1
            current = live
        per_work: dict[int, list[int]] = {id(w): [] for w in active}
        for round_ in sampled:  # without stop tokens, the step's one device->host read of the tokens
            for w, token in round_.read():
                per_work[id(w)].append(token)
        for w in active:
            self._finish_pipelined(w, per_work[id(w)])
        return rounds

    @staticmethod
    def _finish_pipelined(w: _Work, tokens: list[int]) -> None:
        """A session's sampled tokens, in order: every one but the last was fed to the next round."""
        stop_at = next((i for i, t in enumerate(tokens) if t in w.inp.sampling.stop_token_ids), None)
        if stop_at is None:
            w.output.token_ids.extend(tokens)
            w.last_token = tokens[-1] if tokens else None
            return
        w.output.token_ids.extend(tokens[:stop_at + 1])
        w.output.finished = True
        w.remaining = 0
        if stop_at < len(tokens) - 1:
            if stop_at != len(tokens) - 2:
                raise InvariantError("a session decoded more than one round past its stop token")
            w.last_token = None      # the stop token was fed: it is in the cache already
            w.session.stop_written = True
        else:
            w.last_token = tokens[stop_at]

    def _decode(self, works: list[_Work]) -> int:
        """Sample the first token from each session's last hidden state, then decode in shared rounds."""
        active = [w for w in works if w.remaining > 0 and w.first_hidden is not None
                  and w.session.status is SessionStatus.ACTIVE]
        if active and self._pipelinable(active):
            return self._decode_pipelined(active)
        if active:
            logits = self.runner.compute_logits(torch.stack([w.first_hidden for w in active]))
            self._emit(active, logits)
        rounds = 0
        while True:
            active = [w for w in works if w.remaining > 0 and w.session.status is SessionStatus.ACTIVE]
            if not active:
                return rounds
            segments, owners = [], {}
            for w in active:
                seg = self._segment(w, [w.last_token])
                if seg is not None:
                    w.last_token = None
                    segments.append(seg)
                    owners[id(seg)] = w
            if not segments:
                continue
            kept, hidden = self._forward(segments, {w.session.session_id: w for w in active})
            rounds += 1
            if kept:
                self._emit([owners[id(seg)] for seg in kept], self.runner.compute_logits(hidden))

    def _emit(self, works: list[_Work], logits: torch.Tensor) -> None:
        tokens = sample(logits, [w.inp.sampling for w in works], self.generator)
        for w, token in zip(works, tokens):
            w.output.token_ids.append(token)
            w.last_token = token
            w.remaining -= 1
            if token in w.inp.sampling.stop_token_ids:
                w.output.finished = True
                w.remaining = 0

    # ------------------------------------------------------------------ prompt logprobs
    def _logprob_context(self, work: _Work, pending: list[int]) -> list[float | None]:
        """Start the prompt logprobs: the first input token is predicted by what came before it."""
        token_ids = list(work.inp.token_ids)
        if not token_ids:
            return []
        if pending or work.session.last_hidden is None:
            return [None] * len(token_ids)  # filled from this step's rows (pending) or truly unknown
        logits = self.runner.compute_logits(work.session.last_hidden[None])
        first = torch.log_softmax(logits, -1)[0, token_ids[0]].item()
        return [first] + [None] * (len(token_ids) - 1)

    def _fill_prompt_logprobs(self, work: _Work, rows: torch.Tensor) -> None:
        """``rows`` are the hidden states of [pending?] + input tokens; row i predicts token i + 1."""
        token_ids = list(work.inp.token_ids)
        lead = len(rows) - len(token_ids)  # 1 when a pending token led the segment
        first = 1 - lead                   # the first input token predicted from this step's rows
        if first >= len(token_ids):
            return
        predictors = rows[first - 1 + lead:len(rows) - 1]
        logprobs = torch.log_softmax(self.runner.compute_logits(predictors), -1)
        targets = torch.tensor(token_ids[first:], device=logprobs.device)
        values = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
        work.output.prompt_logprobs[first:] = values
