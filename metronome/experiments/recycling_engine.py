"""The application-level baseline of the recycling experiment: an ``Engine`` look-alike over the unmodified
engine that ends each session's context every ``period_s`` and re-prefills its last ``tail_tokens`` tokens
(what an application without a bounded KV policy does to keep a long session alive)."""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, replace
from time import perf_counter

from metronome.engine.engine import StepTiming


# ------------------------------------------------------------------------------------ the baseline
@dataclass
class _Context:
    engine_id: int
    opened: float                   # clock() when this context started
    tail: deque                     # the last tail_tokens tokens the session consumed
    recycles: int = 0


class RecyclingEngine:
    """An ``Engine`` look-alike that recycles each session's context every ``period_s`` of wall time.

    Session ids it hands out are its own (stable across recycles); everything else (``config``,
    ``tokenizer``, ``model``, ``stats`` ...) is the wrapped engine's. ``events`` lists every recycle:
    when (``clock()``), which session, the context length ended, the tail re-prefilled and the time the
    re-prefill took; with ``events_path`` each is also appended to that file as a JSON line (the
    experiment runs the worker in another process).
    """

    def __init__(self, engine, period_s: float, tail_tokens: int, events_path: str | None = None,
                 clock=time.monotonic) -> None:
        if period_s <= 0 or tail_tokens < 0:
            raise ValueError("period_s must be > 0 and tail_tokens >= 0")
        self._engine = engine
        self.period_s, self.tail_tokens = float(period_s), int(tail_tokens)
        self.clock = clock
        self.events: list[dict] = []
        self._events_path = events_path
        self._contexts: dict[int, _Context] = {}
        self._next_id = 0
        self._last_timing = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    @property
    def last_timing(self):
        return self._last_timing if self._last_timing is not None else self._engine.last_timing

    def open_session(self, positions: str | None = None) -> int:
        eid = self._engine.open_session(positions)
        sid, self._next_id = self._next_id, self._next_id + 1
        self._contexts[sid] = _Context(eid, self.clock(), deque(maxlen=self.tail_tokens or 1))
        return sid

    def close_session(self, session_id: int) -> None:
        ctx = self._contexts.pop(session_id)
        self._engine.close_session(ctx.engine_id)

    def session_stats(self, session_id: int):
        return self._engine.session_stats(self._contexts[session_id].engine_id)

    def _recycle(self, due: list[tuple[int, _Context]]) -> float:
        """End the due contexts, open fresh ones and prefill their tails (batched); returns ms spent."""
        t0 = perf_counter()
        chunk = self._engine.config.max_chunk_tokens
        ended = {}
        for sid, ctx in due:
            ended[sid] = self._engine.session_stats(ctx.engine_id).num_tokens
            self._engine.close_session(ctx.engine_id)
            ctx.engine_id = self._engine.open_session()
        from metronome import StepInput

        tails = {sid: list(ctx.tail) if self.tail_tokens else [] for sid, ctx in due}
        for k in range(0, max((len(t) for t in tails.values()), default=0), chunk):
            batch = [StepInput(ctx.engine_id, token_ids=tails[sid][k:k + chunk]) for sid, ctx in due
                     if tails[sid][k:k + chunk]]
            if batch:
                for out in self._engine.step(batch):
                    if out.error:
                        raise RuntimeError(f"re-prefill failed: {out.error}")
        self._engine.synchronize()   # the re-prefill's time includes its device work
        ms = (perf_counter() - t0) * 1e3
        now = self.clock()
        for sid, ctx in due:
            ctx.opened, ctx.recycles = now, ctx.recycles + 1
            event = {"t": now, "session": sid, "ended_tokens": ended[sid], "tail_tokens": len(tails[sid]),
                     "batch": len(due), "ms": round(ms, 3)}
            self.events.append(event)
            if self._events_path:
                with open(self._events_path, "a") as f:
                    f.write(json.dumps(event) + "\n")
        return ms

    def step(self, inputs):
        now = self.clock()
        due = [(inp.session_id, self._contexts[inp.session_id]) for inp in inputs
               if inp.session_id in self._contexts and now - self._contexts[inp.session_id].opened >= self.period_s]
        recycle_ms = self._recycle(due) if due else 0.0
        mapped = [replace(inp, session_id=self._contexts[inp.session_id].engine_id)
                  if inp.session_id in self._contexts else replace(inp, session_id=-1 - inp.session_id)
                  for inp in inputs]
        outputs = self._engine.step(mapped)
        for inp, out in zip(inputs, outputs):
            out.session_id = inp.session_id
            ctx = self._contexts.get(inp.session_id)
            if ctx is not None and not out.error and self.tail_tokens:
                ctx.tail.extend(int(t) for t in (inp.token_ids or ()))
                ctx.tail.extend(int(t) for t in out.token_ids)
        t = self._engine.last_timing
        self._last_timing = (StepTiming(t.forwards, t.decode_rounds, prefill_ms=t.prefill_ms + recycle_ms,
                                        decode_ms=t.decode_ms) if recycle_ms else t)
        return outputs


# ------------------------------------------------------------------------------------ presets
