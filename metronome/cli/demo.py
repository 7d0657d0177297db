"""``metronome demo``: several users talk to the model at once, one tick per frame period.

Each tick every session's new input is prefilled and a few tokens are decoded for all of them in
shared rounds; answers stream out tick by tick. After answering, the sessions keep decoding
free-running (full duplex: the model hears itself), and the KV they hold stays flat once the
window is full: that is the bounded state Metronome is about.
"""

from __future__ import annotations

import argparse
import time

from metronome import Engine, EngineConfig, KVPolicy, SamplingParams, StepInput

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Germany?",
    "How many days are in a week?",
    "What is the capital of Japan?",
    "Name a primary color.",
    "What is the capital of the United Kingdom?",
]


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="concurrent sessions on the embedded default model (CPU)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="packaged model name or HF checkpoint directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions (default 4)")
    p.add_argument("--tokens-per-tick", type=int, default=8, help="decode tokens per session per tick")
    p.add_argument("--sinks", type=int, default=16)
    p.add_argument("--window", type=int, default=128, help="KV window in tokens (small, so the plateau shows)")
    p.add_argument("--free-run-ticks", type=int, default=30, help="ticks of free-running decode after the answers")
    p.set_defaults(run=run)


def _prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def run(args: argparse.Namespace) -> int:
    if args.sessions < 1 or args.tokens_per_tick < 1:
        raise SystemExit("--sessions and --tokens-per-tick must be >= 1")
    print(f"loading {args.model} on {args.device} (the first run converts the packaged model once)...", flush=True)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, device=args.device,
                                 policy=KVPolicy(sinks=args.sinks, window=args.window, block_size=16),
                                 num_blocks=None))
    tok = engine.tokenizer
    stats = engine.stats()
    print(f"ready in {time.perf_counter() - t0:.1f}s: {stats.kv_blocks_total} KV blocks, "
          f"{stats.blocks_per_session} reserved per session, capacity {stats.capacity} sessions\n")

    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.sessions)]
    sids = [engine.open_session() for _ in questions]
    pending = {sid: _prompt(tok, q) for sid, q in zip(sids, questions)}
    answers = {sid: [] for sid in sids}
    done: set[int] = set()
    stop = SamplingParams(stop_token_ids=(tok.eos_token_id,))
    tick = 0
    print("tick  latency  batch  KV blocks  streamed")
    while len(done) < len(sids):
        tick += 1
        live = [s for s in sids if s not in done]
        start = time.perf_counter()
        outs = engine.step([StepInput(s, token_ids=pending.pop(s, None), max_new_tokens=args.tokens_per_tick,
                                      sampling=stop) for s in live])
        latency = (time.perf_counter() - start) * 1e3
        for out in outs:
            if out.error:
                print(f"  session {out.session_id}: error: {out.error}")
                done.add(out.session_id)
                continue
            answers[out.session_id].extend(out.token_ids)
            if out.finished:
                done.add(out.session_id)
        first = outs[0]
        preview = tok.decode(first.token_ids, skip_special_tokens=True).replace("\n", " ")
        print(f"{tick:4d} {latency:7.0f}ms {len(live):5d} {engine.stats().kv_blocks_used:10d}  "
              f"[{first.session_id}] {preview!r}")
    print()
    for sid, q in zip(sids, questions):
        print(f"[{sid}] Q: {q}\n    A: {tok.decode(answers[sid], skip_special_tokens=True).strip()}")

    if args.free_run_ticks:
        print(f"\nfree-running {args.free_run_ticks} ticks (window {args.window} tokens): KV per session stays bounded")
        print("tick  latency  tokens/session  KV blocks used")
        for t in range(args.free_run_ticks):
            start = time.perf_counter()
            engine.step([StepInput(s, max_new_tokens=args.tokens_per_tick) for s in sids])
            latency = (time.perf_counter() - start) * 1e3
            if t % 5 == 4 or t == args.free_run_ticks - 1:
                length = engine.scheduler.sessions[sids[0]].num_tokens
                print(f"{t + 1:4d} {latency:7.0f}ms {length:15d} {engine.stats().kv_blocks_used:15d}")
    for sid in sids:
        engine.close_session(sid)
    return 0
