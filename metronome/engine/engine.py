"""Engine: the public facade. Single-threaded by design; on CUDA a step returns once its device work is queued
(its outputs are used in stream order; ``synchronize`` waits for it).

>>> from metronome import Engine, EngineConfig, KVPolicy, StepInput      # doctest: +SKIP
>>> engine = Engine(EngineConfig(policy=KVPolicy(sinks=16, window=1024)))  # doctest: +SKIP
>>> sid = engine.open_session()                                           # doctest: +SKIP
>>> ids = engine.tokenizer.apply_chat_template(
...     [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
>>> out, = engine.step([StepInput(sid, token_ids=ids, max_new_tokens=8)])  # doctest: +SKIP
>>> engine.tokenizer.decode(out.token_ids)                                # doctest: +SKIP
'The capital of France is Paris.'
>>> engine.close()       # or ``with Engine(...) as engine:``; frees the KV pool, graphs and model  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from time import perf_counter
from typing import Sequence

import torch

from metronome.config import EngineConfig
from metronome.cpu import read_capability
from metronome.engine.blocks import BlockPool
from metronome.engine.decode import Work, decode
from metronome.engine.request import ForwardPlan, ForwardSegment, StepInput, StepOutput
from metronome.engine.runner import DTYPES, ModelRunner, available_memory_bytes, kv_dtype
from metronome.engine.scheduler import InvariantError, Scheduler
from metronome.engine.session import Session, SessionStatus
from metronome.errors import ConfigError, MetronomeError
from metronome.models.cpu_layer_ops import CpuLayerOps, use_layer_ops_
from metronome.models.cpu_linear import PackedLinear, kernel_linears_, pack_linears_, packable
from metronome.models.fp8 import check_fp8_device, quantize_decoder_, use_cpu_kernel_
from metronome.models.llama import LlamaFamilyForCausalLM
from metronome.models.loader import load_model, load_tokenizer
from metronome.native import NativeLibrary, optional_library

log = logging.getLogger(__name__)


class SessionNotFound(MetronomeError, KeyError):
    """No open session has this id."""


class EngineClosed(MetronomeError):
    """The engine was closed; its KV pool and model are gone."""


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


class StepTiming:
    """A step's prefill (its new input) and decode rounds in ms, and how many forwards and decode rounds it ran.

    On CUDA the times are spans of the device's stream between events, read when first asked for (which waits for
    the step's end): the step does not wait to take them, so a step without decode rounds returns with its work
    queued and what the caller launches next (an adapter's heads) queues behind it with no gap. Elsewhere they
    are wall times."""

    def __init__(self, forwards: int, decode_rounds: int, *, prefill_ms: float = 0.0, decode_ms: float = 0.0,
                 events: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event] | None = None) -> None:
        self.forwards, self.decode_rounds = forwards, decode_rounds
        self._ms = (prefill_ms, decode_ms)
        self._events = events   # (step start, prefill done, step end)

    def _read(self) -> tuple[float, float]:
        if self._events is not None:
            start, prefilled, end = self._events
            end.synchronize()
            self._ms = (start.elapsed_time(prefilled), prefilled.elapsed_time(end))
            self._events = None
        return self._ms

    @property
    def prefill_ms(self) -> float:
        return self._read()[0]

    @property
    def decode_ms(self) -> float:
        return self._read()[1]

    def __repr__(self) -> str:
        return (f"StepTiming(prefill_ms={self.prefill_ms:.3f}, decode_ms={self.decode_ms:.3f}, "
                f"forwards={self.forwards}, decode_rounds={self.decode_rounds})")


class Engine:
    def __init__(self, config: EngineConfig, model: LlamaFamilyForCausalLM | None = None,
                 checkpoint: Path | None = None) -> None:
        """``model``: an already built decoder on ``config.device`` (benchmarks with random weights);
        by default it is loaded from ``config.model``. ``checkpoint``: with ``model``, the directory its
        tokenizer and chat template come from (none by default)."""
        self.config = config
        self.device = torch.device(config.device)
        dtype = DTYPES[config.dtype]
        if config.quantization == "fp8" or config.kv_cache_dtype == "fp8":
            check_fp8_device(self.device)
        if model is None:
            self.model, self.checkpoint = load_model(config.model, dtype, self.device)
        else:
            self.model, self.checkpoint = model, checkpoint
        aligned = self.device.type == "cuda" and hasattr(self.model, "align_head_") and self.model.align_head_()
        if aligned:
            log.info("the logits' head padded to %d rows (aligned rows for cuBLAS)", self.model.aligned_head.shape[0])
        if config.quantization == "fp8":
            quantize_decoder_(self.model)
        if self.device.type == "cuda" and (aligned or config.quantization == "fp8"):
            torch.cuda.empty_cache()   # the replaced weights' memory goes back, so the KV pool can use it
        # Metronome's C kernels (one library) where the CPU path uses them; None elsewhere.
        self.cpu_kernels = cpu_kernels = self._cpu_kernels(config, dtype)
        if self.device.type == "cpu":
            self._pack_cpu_linears(config.cpu_linear, dtype, cpu_kernels)
            if config.quantization == "fp8":
                self._fp8_cpu_linears(config.cpu_linear, dtype, cpu_kernels)
        if cpu_kernels is not None and config.cpu_elementwise != "torch":
            count = use_layer_ops_(self.model, CpuLayerOps(cpu_kernels))
            log.info("%d norms, rotary embeddings and activations run as one C call each", count)
        self.spec = self.model.spec
        self.max_model_len = self.spec.max_position_embeddings
        policy = config.policy
        block_bytes = self.spec.kv_bytes_per_token(kv_dtype(config)) * policy.block_size  # 1 byte an element in FP8
        num_blocks = config.num_blocks or self._blocks_from_memory(block_bytes)
        self.kv_bytes_per_block = block_bytes
        self.scheduler = Scheduler(policy, BlockPool(num_blocks), config.max_chunk_tokens,
                                   self.max_model_len, config.max_batch_tokens,
                                   vocab_size=self.spec.vocab_size, hidden_size=self.spec.hidden_size)
        if policy.positions == "rebased":
            self.scheduler.check_rebased_fits()
        if policy.bounded and self.scheduler.capacity < 1:
            raise ConfigError(
                f"the KV pool ({num_blocks - 1} blocks) cannot hold one session "
                f"({self.scheduler.session_blocks} blocks); raise num_blocks or shrink the window")
        self.runner = ModelRunner(config, self.model, num_blocks, cpu_kernels)
        if config.cuda_graphs and self.device.type == "cuda" and config.attention == "triton":
            max_batch = min(1024, max(1, self.scheduler.capacity if policy.bounded else 256))
            self.runner.capture_decode_graphs(max_batch, self.scheduler.session_blocks)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.last_timing = StepTiming(0, 0)
        self.closed = False
        log.info("engine ready: %s in %s on %s, %d KV blocks of %d tokens, %d blocks per session, capacity %d "
                 "sessions", self.checkpoint, config.dtype, self._device_line(), num_blocks - 1, policy.block_size,
                 self.scheduler.session_blocks, self.scheduler.capacity)

    def _device_line(self) -> str:
        """The device as the log names it; on the CPU what it runs natively (the reason for ``dtype="auto"``)."""
        if self.device.type != "cpu":
            return str(self.device)
        return f"cpu ({read_capability().describe()}, {torch.get_num_threads()} torch threads)"

    def _cpu_kernels(self, config: EngineConfig, dtype: torch.dtype) -> NativeLibrary | None:
        """Metronome's C kernels, loaded once where the products, the decode rounds or the elementwise steps ask
        for them; None where none does or (``auto``) they cannot be built. A ``"kernel"`` setting raises ``KernelBuildError``."""
        fp8_products = config.quantization == "fp8" and config.cpu_linear != "aten"
        products = (config.cpu_linear == "kernel" or fp8_products
                    or (config.cpu_linear == "auto" and dtype == torch.float32))
        wanted = [c for c, asks in ((config.cpu_linear, products),
                                    (config.cpu_attention, config.cpu_attention != "sdpa"),
                                    (config.cpu_elementwise, config.cpu_elementwise != "torch")) if asks]
        if self.device.type != "cpu" or not wanted:
            return None
        return optional_library("kernel" if "kernel" in wanted else "auto",
                                "products, decode rounds and elementwise steps use torch's")

    def _pack_cpu_linears(self, choice: str, dtype: torch.dtype, cpu_kernels: NativeLibrary | None) -> None:
        """The decoder's products on the CPU (``EngineConfig.cpu_linear``): bf16 weights packed for oneDNN,
        float32 products of few rows through the C kernels (``cpu_kernels``), or aten's ``F.linear``."""
        if hasattr(self.model, "packed_head"):   # a model handed in again: no head packed by an earlier engine
            self.model.packed_head = None
        if choice == "aten":
            return
        if choice == "kernel" or (choice == "auto" and dtype == torch.float32):
            self._kernel_cpu_linears(cpu_kernels)
            return
        if choice == "auto" and dtype != torch.bfloat16:
            return
        if not packable(dtype):
            if choice == "packed":
                raise ConfigError(f"cpu_linear='packed': oneDNN on this CPU cannot pack {dtype} weights "
                                  f"({read_capability().describe()})")
            return
        count = pack_linears_(self.model.model.layers)   # none but MoE routers where the layers are FP8
        packed = [f"{count} linear weights"] if count else []
        if hasattr(self.model, "packed_head"):   # a copy: the embedding lookup and the exact top-k read the plain one
            weight = self.model.head_weight()
            self.model.packed_head = PackedLinear(weight)
            packed.append(f"a copy of the logits' head ({weight.numel() * weight.element_size() / 2**20:.0f} MiB)")
        if packed:
            log.info("packed %s (%s) for oneDNN", " and ".join(packed), dtype)

    def _kernel_cpu_linears(self, library: NativeLibrary | None) -> None:
        if library is None:    # auto, and the kernels could not be built (logged): aten
            return
        count = kernel_linears_(self.model.model.layers, library)
        logits = hasattr(self.model, "cpu_kernels")
        if logits:
            self.model.cpu_kernels = library
        log.info("%d linear layers%s multiply few rows through the C kernel (%s)", count,
                 " and the logits" if logits else "", library.path.name)

    def _fp8_cpu_linears(self, choice: str, dtype: torch.dtype, library: NativeLibrary | None) -> None:
        """FP8 layers on the CPU multiply through the C kernel (``models/cpu_linear.E4m3Product``) unless
        ``cpu_linear="aten"`` or the kernels could not be built (logged): then each product dequantises its weight."""
        library = None if choice == "aten" else library   # (a model handed in again may have had the kernel)
        count = use_cpu_kernel_(self.model.model.layers, library, dtype)
        if library is not None:
            log.info("%d FP8 linear layers multiply through the C kernel (%s)", count, library.path.name)

    def _blocks_from_memory(self, block_bytes: int) -> int:
        budget = int(available_memory_bytes(self.device) * self.config.kv_memory_fraction)
        return max(2, budget // block_bytes + 1)

    @cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer (with its chat template), loaded on first use."""
        self._check_open()
        if self.checkpoint is None:
            raise MetronomeError("this engine was built from a model object and has no tokenizer")
        return load_tokenizer(self.checkpoint)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Free the KV pool, the CUDA graphs and the model. Closing twice is harmless; any later use
        raises ``EngineClosed``."""
        if self.closed:
            return
        self.closed = True
        self.runner.close()
        self.model = None
        self.scheduler.sessions.clear()
        self.__dict__.pop("tokenizer", None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        log.info("engine closed")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosed("this engine is closed (its KV pool and model were freed)")

    # ------------------------------------------------------------------ sessions
    def open_session(self, positions: str | None = None) -> int:
        """Admit a session, reserving its worst-case KV; raises ``AdmissionError`` if it does not fit.

        ``positions`` overrides the policy's position mode for this session ("absolute" or "rebased").
        """
        self._check_open()
        return self.scheduler.admit(positions).session_id

    def close_session(self, session_id: int) -> None:
        """End a session and return every block it held (its reservation too)."""
        self.scheduler.close(self._session(session_id))

    def _session(self, session_id: int) -> Session:
        self._check_open()
        try:
            return self.scheduler.sessions[session_id]
        except KeyError:
            raise SessionNotFound(f"unknown session {session_id}") from None

    def stats(self) -> EngineStats:
        self._check_open()
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

    # ------------------------------------------------------------------ forwards
    def _forward(self, segments: list[ForwardSegment], works: dict[int, Work],
                 input_ids: torch.Tensor | None = None) -> tuple[tuple[ForwardSegment, ...], torch.Tensor]:
        """Plan, run, apply: the scheduler plans the forward, the runner executes it, the scheduler applies
        the result. Segments of preempted sessions are dropped from the plan (and reported)."""
        plan: ForwardPlan = self.scheduler.schedule_forward(segments)
        for session_id in plan.preempted:
            work = works.get(session_id)
            if work is not None:
                work.output.preempted = True
                work.remaining = 0
        if plan.empty:
            if plan.rebase is not None:
                self.runner.execute(plan)
            return plan.segments, torch.empty(0)
        if input_ids is not None and len(plan.segments) != len(segments):
            raise InvariantError("a pipelined decode round lost a segment")
        result = self.runner.execute(plan, input_ids)
        self.scheduler.update_from_output(plan, result)
        self._forwards += 1
        return plan.segments, result.hidden

    def _segment(self, work: Work, token_ids: list[int], embeds: torch.Tensor | None = None) -> ForwardSegment | None:
        """The next segment of a session, or None if it would pass the position limit (the session then ends)."""
        seg, error = self.scheduler.segment(work.session, token_ids, embeds)
        if error:
            work.output.error = error
            work.remaining = 0
            work.last_token = None
        return seg

    def _restore(self, work: Work, new_tokens: int) -> bool:
        """Unbounded baseline: recompute a preempted session's history if the pool has room now."""
        segments = self.scheduler.restore(work.session, new_tokens + work.remaining)
        if segments is None:
            return False
        for seg in segments:
            self._forward([seg], {})
        log.info("restored session %d (%d tokens recomputed)", work.session.session_id, work.session.num_tokens)
        return True

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def step(self, inputs: Sequence[StepInput]) -> list[StepOutput]:
        """Prefill every session's new input, then decode up to ``max_new_tokens`` in shared rounds.

        Returns one output per input, in order. A session's error is reported on its output only. On CUDA a step
        without decode rounds returns with its work queued: its hidden states are valid in stream order.
        """
        self._check_open()
        t0 = perf_counter()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3)) if stream else None
        if events:
            events[0].record(stream)
        self._forwards = 0
        outputs = [StepOutput(session_id=inp.session_id) for inp in inputs]
        plan = self.scheduler.schedule_step(inputs)
        for index, error in plan.errors:
            outputs[index].error = error
        works = {item.session.session_id: Work(outputs[item.index], item.session, item.input, item.input.max_new_tokens)
                 for item in plan.admitted}

        prefill: list[tuple[Work, ForwardSegment]] = []
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
                self.scheduler.consume_pending(session)
                continue
            self.scheduler.clear_stop_written(session)
            if not token_ids and inp.embeds is None:
                work.first_hidden = session.last_hidden
                continue
            seg = self._segment(work, token_ids, inp.embeds)
            self.scheduler.consume_pending(session)
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
        if events:
            events[1].record(stream)
        t1 = perf_counter()

        rounds = decode(self, list(works.values()))
        for work in works.values():
            self.scheduler.finish_step(work.session, work.last_token, work.stop_written)
        self.scheduler.check_invariants()
        if events:
            events[2].record(stream)
            self.last_timing = StepTiming(self._forwards, rounds, events=events)
        else:
            self.last_timing = StepTiming(self._forwards, rounds, prefill_ms=(t1 - t0) * 1e3,
                                          decode_ms=(perf_counter() - t1) * 1e3)
        return outputs

    def synchronize(self) -> None:
        """Wait until the device has run every step queued so far (nothing to wait for on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ prompt logprobs
    def _logprob_context(self, work: Work, pending: list[int]) -> list[float | None]:
        """Start the prompt logprobs: the first input token is predicted by what came before it."""
        token_ids = list(work.inp.token_ids)
        if not token_ids:
            return []
        if pending or work.session.last_hidden is None:
            return [None] * len(token_ids)  # filled from this step's rows (pending) or truly unknown
        logits = self.runner.compute_logits(work.session.last_hidden[None])
        first = torch.log_softmax(logits, -1)[0, token_ids[0]].item()
        return [first] + [None] * (len(token_ids) - 1)

    def _fill_prompt_logprobs(self, work: Work, rows: torch.Tensor) -> None:
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
