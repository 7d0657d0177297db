"""Decode rounds: sample each session's first token, then decode in shared rounds until budgets or stops.

Two paths. Greedy rounds of bounded sessions are pipelined: sampled ids stay on the device and feed
the next round, stop tokens are read a round late. Otherwise every round samples on the host
(``emit``). Every forward goes through the engine's ``_forward`` (scheduler plan, runner, update), so
nothing here changes a session; end-of-step facts are left on the ``Work`` for the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metronome.engine.request import StepInput, StepOutput
from metronome.engine.sampling import sample
from metronome.engine.scheduler import InvariantError
from metronome.engine.session import Session, SessionStatus


@dataclass
class Work:
    """One session's progress through the current step."""

    output: StepOutput
    session: Session
    inp: StepInput
    remaining: int
    last_token: int | None = None        # sampled and not yet fed
    first_hidden: torch.Tensor | None = None  # hidden state whose logits give the first new token
    stop_written: bool = False           # pipelined rounds fed the stop token already


@dataclass
class Sampled:
    """One pipelined round's sampled ids (on the device) for ``works``, in order. With stop tokens to watch, a
    copy to pinned host memory starts at once, so reading it a round later waits for that copy only, not
    for the round launched since (``tolist`` on a CUDA tensor would wait for the whole stream)."""

    works: list[Work]
    ids: torch.Tensor
    host: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    _tokens: list[int] | None = None   # read once: by the stop check a round later, then at the step's end

    @classmethod
    def of(cls, works: list[Work], ids: torch.Tensor, watch: bool) -> Sampled:
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

    def read(self) -> list[tuple[Work, int]]:
        return list(zip(self.works, self.tokens()))

    def token_of(self, work: Work) -> int:
        return self.tokens()[next(i for i, w in enumerate(self.works) if w is work)]


def pipelinable(engine, active: list[Work]) -> bool:
    """Greedy rounds of bounded sessions need no host sync per round (stop tokens are read a round late)."""
    graphs = engine.runner.graphs
    return (engine.config.policy.bounded and (graphs is None or len(active) <= graphs.buckets[-1])
            and all(w.inp.sampling.greedy for w in active))


def decode_pipelined(engine, active: list[Work]) -> int:
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
    ids = engine.runner.compute_logits(torch.stack([w.first_hidden for w in active])).argmax(-1)
    stops = any(w.inp.sampling.stop_token_ids for w in active)
    sampled: list[Sampled] = [Sampled.of(active, ids, stops)]
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
            if (w.inp.sampling.stop_token_ids and engine.scheduler.position_error(w.session, 1)
                    and sampled[-1].token_of(w) in w.inp.sampling.stop_token_ids):
                # At the position limit the unread token cannot be fed; read it now (rare): a stop ends
                # the decode as the per-round path would, anything else fails the session there.
                w.remaining = 0
                continue
            # The token stays on the device; [0] only holds its place (bounded: no history is kept).
            seg = engine._segment(w, [0])
            if seg is not None:
                live.append(w)
                keep.append(i)
                segments.append(seg)
        if not live:
            break
        if len(live) != len(current):
            ids = ids.index_select(0, engine.runner.to_device(torch.tensor(keep)))
        _, hidden = engine._forward(segments, {}, input_ids=ids)
        rounds += 1
        ids = engine.runner.compute_logits(hidden).argmax(-1)
        sampled.append(Sampled.of(live, ids, stops))
        for w in live:
            w.remaining -= 1
        current = live
    per_work: dict[int, list[int]] = {id(w): [] for w in active}
    for round_ in sampled:  # without stop tokens, the step's one device->host read of the tokens
        for w, token in round_.read():
            per_work[id(w)].append(token)
    for w in active:
        finish_pipelined(w, per_work[id(w)])
    return rounds


def finish_pipelined(w: Work, tokens: list[int]) -> None:
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
        w.stop_written = True    # the scheduler records it at the step's end
    else:
        w.last_token = tokens[stop_at]


def decode(engine, works: list[Work]) -> int:
    """Sample the first token from each session's last hidden state, then decode in shared rounds."""
    active = [w for w in works if w.remaining > 0 and w.first_hidden is not None
              and w.session.status is SessionStatus.ACTIVE]
    with engine.runner.decode_rounds():
        if active and pipelinable(engine, active):
            return decode_pipelined(engine, active)
        if active:
            logits = engine.runner.compute_logits(torch.stack([w.first_hidden for w in active]))
            emit(engine, active, logits)
        return host_rounds(engine, works)


def host_rounds(engine, works: list[Work]) -> int:
    """Rounds that sample on the host: each round's tokens are fed to the next."""
    rounds = 0
    while True:
        active = [w for w in works if w.remaining > 0 and w.session.status is SessionStatus.ACTIVE]
        if not active:
            return rounds
        segments, owners = [], {}
        for w in active:
            seg = engine._segment(w, [w.last_token])
            if seg is not None:
                w.last_token = None
                segments.append(seg)
                owners[id(seg)] = w
        if not segments:
            continue
        kept, hidden = engine._forward(segments, {w.session.session_id: w for w in active})
        rounds += 1
        if kept:
            emit(engine, [owners[id(seg)] for seg in kept], engine.runner.compute_logits(hidden))


def emit(engine, works: list[Work], logits: torch.Tensor) -> None:
    """Sample one token per work from ``logits``; a stop token ends that session's decode."""
    tokens = sample(logits, [w.inp.sampling for w in works], engine.generator)
    for w, token in zip(works, tokens):
        w.output.token_ids.append(token)
        w.last_token = token
        w.remaining -= 1
        if token in w.inp.sampling.stop_token_ids:
            w.output.finished = True
            w.remaining = 0

