"""The quality experiment: with the packaged SmolLM2 (``smollm2-135m``, the engine's default model).

(a) **Perplexity** over a long public-domain text (the Nettle manual, ``speech.manual_paragraphs``),
fed through the engine in ``chunk_tokens`` pieces with ``prompt_logprobs``, for: dense (Unbounded),
window only (S = 0) and sinks S ∈ {1, 4, 16}, each bounded policy in both position modes (absolute:
true RoPE positions; rebased: window keys re-rotated so positions stay bounded). The dense engine number
is checked against transformers' own model on the same tokens (``hf_reference``).

(b) **Spoken-question probe** (the paper's): one long free-running session per arm hears read-aloud text
(espeak-ng, ``speech.py``) with questions of known answer inserted at increasing session ages; the reply
is the text decoded in the tick the question's transcript enters the context and the next
``answer_ticks - 1`` ticks (cut at the next utterance). A probe is correct if the reply contains the
expected word. Arms: sinks (S = ``probe_sinks``) vs none (S = 0) with the same W, and dense where the
session stays inside the model's position limit. The path is the worker's: the cascade adapter
(Silero VAD + Whisper tiny.en → SmolLM2 chat turns) and the engine, driven tick by tick in simulated
time (B seconds of audio per tick, ticks back to back — quality does not depend on wall-clock time, and
a contended machine cannot change the answer). All arms share one adapter, so their transcripts are
identical: only the KV policy differs.

    metronome bench quality --preset cpu
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from metronome.experiments.report import write_outputs
from metronome.experiments.speech import QUESTIONS, answered


@dataclass(frozen=True)
class QualityPreset:
    name: str
    model: str
    device: str
    dtype: str
    # (a) perplexity
    text_tokens: int
    chunk_tokens: int
    window: int
    sinks: tuple[int, ...]            # besides S = 0 (window only)
    hf_reference: bool                # dense perplexity from transformers too (a check of the engine)
    # (b) probe
    probe_budget_ms: float
    probe_tokens_per_tick: int
    probe_window: int
    probe_sinks: int
    probe_session_s: float
    probe_first_s: float
    probe_every_s: float
    probe_arms: tuple[str, ...]       # of "sinks", "none", "dense"
    answer_ticks: int = 3
    block_size: int = 16

    def to_dict(self) -> dict:
        return asdict(self)


# Sized for 2 shared CPU cores (~25-100 tokens/s for SmolLM2 here): 1024 tokens at W = 64, so the window
# slides ~15 times. Probe: B = 2 s, 8 tokens decoded per tick, W = 64 (a question of ~25 tokens with its
# framing plus a 24-token reply fit), a question every 12 s for 150 s (12 per arm; the first, at 6 s,
# before the window has filled).
CPU = QualityPreset(name="cpu", model="smollm2-135m", device="cpu", dtype="float32", text_tokens=1024,
                    chunk_tokens=64, window=64, sinks=(1, 4, 16), hf_reference=True, probe_budget_ms=2000.0,
                    probe_tokens_per_tick=8, probe_window=64, probe_sinks=4, probe_session_s=150.0,
                    probe_first_s=6.0, probe_every_s=12.0, probe_arms=("sinks", "none", "dense"))

# The paper's scale on one H200 (defined, not run here): ~8000 tokens (below SmolLM2's 8192 positions, so
# the absolute mode and dense stay valid) at W = 1024; a 30-minute probe session with τ = 25 (~27k tokens:
# past the position limit, so only the rebased bounded arms can run it), a question every minute.
GPU = QualityPreset(name="gpu", model="smollm2-135m", device="cuda", dtype="bfloat16", text_tokens=8000,
                    chunk_tokens=256, window=1024, sinks=(1, 4, 16), hf_reference=True, probe_budget_ms=2000.0,
                    probe_tokens_per_tick=25, probe_window=1024, probe_sinks=16, probe_session_s=1800.0,
                    probe_first_s=10.0, probe_every_s=60.0, probe_arms=("sinks", "none"))

PRESETS = {"cpu": CPU, "gpu": GPU}


# ------------------------------------------------------------------------------------ (a) perplexity
def ppl_configs(window: int, sinks) -> list[dict]:
    """Dense, then window-only and each S in both position modes."""
    out = [{"name": "dense", "sinks": 0, "window": None, "positions": "absolute"}]
    for s in (0, *sinks):
        for pos in ("absolute", "rebased"):
            out.append({"name": f"S={s} {pos}", "sinks": s, "window": window, "positions": pos})
    return out


def perplexity(logprobs) -> float:
    """exp of the mean negative log-likelihood, skipping ``None`` (the first token has no prediction).

    >>> round(perplexity([None, math.log(0.5), math.log(0.5)]), 6)
    2.0
    """
    lp = [x for x in logprobs if x is not None]
    return float(math.exp(-sum(lp) / len(lp))) if lp else float("nan")


def engine_logprobs(net, tokens: list[int], cfg: dict, preset: QualityPreset) -> list[float | None]:
    """Feed ``tokens`` through an Engine with the policy of ``cfg`` in ``chunk_tokens`` pieces."""
    from metronome import Engine, EngineConfig, KVPolicy, StepInput

    policy = KVPolicy(sinks=cfg["sinks"], window=cfg["window"], block_size=preset.block_size,
                      positions=cfg["positions"])
    blocks = math.ceil(len(tokens) / preset.block_size) + 8 if cfg["window"] is None else None
    if blocks is None:
        from metronome.engine.blocks import blocks_per_session

        blocks = blocks_per_session(policy, preset.chunk_tokens, net.spec.max_position_embeddings) + 2
    engine = Engine(EngineConfig(model=preset.model, policy=policy, device=preset.device, dtype=preset.dtype,
                                 num_blocks=blocks, max_chunk_tokens=preset.chunk_tokens), model=net)
    sid = engine.open_session()
    out: list[float | None] = []
    for k in range(0, len(tokens), preset.chunk_tokens):
        res, = engine.step([StepInput(sid, token_ids=tokens[k:k + preset.chunk_tokens], prompt_logprobs=True)])
        if res.error:
            raise RuntimeError(f"{cfg['name']}: {res.error}")
        out += list(res.prompt_logprobs)
    engine.close_session(sid)
    return out


def hf_logprobs(checkpoint, tokens: list[int], device: str) -> list[float | None]:
    """log p(token_i | tokens before i) from transformers' own model (dense, one forward)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        ids = torch.tensor([tokens], device=device)
        logits = model(ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    return [None] + lp.cpu().tolist()


def text_tokens(tokenizer, n: int) -> tuple[list[int], int]:
    """The first ``n`` tokens of the manual and the number of characters they cover."""
    from metronome.experiments.speech import long_text

    text = long_text(min_chars=8 * n)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"the text has only {len(ids)} tokens, fewer than the {n} asked for")
    return ids[:n], len(tokenizer.decode(ids[:n]))


def run_perplexity(net, tokenizer, checkpoint, preset: QualityPreset, progress: bool = True) -> dict:
    from tqdm import tqdm

    tokens, chars = text_tokens(tokenizer, preset.text_tokens)
    results = []
    configs = ppl_configs(preset.window, preset.sinks)
    bar = tqdm(configs, desc="perplexity", unit="config", disable=not progress, dynamic_ncols=True)
    for cfg in bar:
        bar.set_description(f"perplexity {cfg['name']}")
        t0 = time.monotonic()
        lp = engine_logprobs(net, tokens, cfg, preset)
        results.append({**cfg, "ppl": perplexity(lp), "logprobs": lp, "seconds": round(time.monotonic() - t0, 2)})
        bar.set_postfix({"ppl": f"{results[-1]['ppl']:.2f}"}, refresh=True)
    ref = None
    if preset.hf_reference:
        lp = hf_logprobs(checkpoint, tokens, preset.device)
        ref = {"ppl": perplexity(lp), "logprobs": lp}
    return {"tokens": len(tokens), "chars": chars, "configs": results, "hf_reference": ref}


# ------------------------------------------------------------------------------------ (b) probe
def probe_times(session_s: float, first_s: float, every_s: float, tail_s: float = 8.0) -> list[float]:
    """When the questions start: ``first_s``, then every ``every_s``, leaving ``tail_s`` at the end.

    >>> probe_times(60.0, 5.0, 20.0)
    [5.0, 25.0, 45.0]
    """
    out, t = [], first_s
    while t + tail_s <= session_s:
        out.append(round(t, 6))
        t += every_s
    return out


def build_probe_audio(times: list[float], session_s: float, budget_s: float, seed: int = 0,
                      rate: int = 16000) -> tuple[np.ndarray, list[dict]]:
    """Read-aloud filler with a question starting at each of ``times`` (float32 at ``rate``).

    Before each question: at least 1.2 s of silence (the VAD needs 0.5 s to end the filler's last
    utterance); after it: ``2·budget_s`` of silence for the answer. Filler sentences come from the manual.
    """
    import re

    from metronome.experiments.speech import espeak, manual_paragraphs, silence

    rng = np.random.default_rng(seed)
    sentences = [s for p in manual_paragraphs() for s in re.split(r"(?<=[.!?])\s+", p) if 4 <= len(s.split()) <= 30]
    parts, cursor, probes = [], 0.0, []
    for i, t in enumerate(times):
        while True:
            sent = sentences[int(rng.integers(len(sentences)))]
            a = espeak(sent, rate) * 0.8
            if cursor + a.size / rate + 0.6 + 1.2 > t:
                break
            parts += [a, silence(0.6, rate)]
            cursor += a.size / rate + 0.6
        parts.append(silence(t - cursor, rate))
        q = QUESTIONS[i % len(QUESTIONS)]
        a = espeak(q.text, rate) * 0.8
        probes.append({"index": i, "question": q.text, "answers": list(q.answers), "start_s": t,
                       "end_s": t + a.size / rate})
        parts += [a, silence(2 * budget_s, rate)]
        cursor = t + a.size / rate + 2 * budget_s
    while cursor < session_s:
        sent = sentences[int(rng.integers(len(sentences)))]
        a = espeak(sent, rate) * 0.8
        parts += [a, silence(0.6, rate)]
        cursor += a.size / rate + 0.6
    audio = np.concatenate(parts)[:int(session_s * rate)]
    return audio.astype(np.float32), probes


def heard_ok(transcript: str, question: str) -> bool:
    """Whether ASR caught the question's key word (its last word of more than 3 letters).

    >>> heard_ok("What is the capital of France?", "What is the capital of France?"), heard_ok("Hello", "Which planet?")
    (True, False)
    """
    import re

    words = [w for w in re.findall(r"[a-z]+", question.lower()) if len(w) > 3]
    return bool(words) and words[-1] in re.findall(r"[a-z]+", (transcript or "").lower())


def score_probes(ticks: list[dict], probes: list[dict], answer_ticks: int) -> list[dict]:
    """Per probe: the tick its transcript arrived in (the first non-empty transcript ending at or after the
    question's end), what was heard, the reply (text of that tick and the next ones, up to ``answer_ticks``
    and before the next transcript) and whether it contains an expected word.

    ``ticks``: per tick ``{"t_s": end of tick, "transcript", "text", "tokens"}`` in order.
    """
    from metronome.experiments.speech import Question

    out = []
    for p in probes:
        k = next((i for i, tk in enumerate(ticks) if tk["t_s"] >= p["end_s"] and tk["transcript"]), None)
        if k is None:
            out.append({**p, "tick": None, "heard": None, "reply": "", "correct": False, "context_tokens": None})
            continue
        reply = [ticks[k]["text"]]
        for j in range(k + 1, min(len(ticks), k + answer_ticks)):
            if ticks[j]["transcript"]:
                break
            reply.append(ticks[j]["text"])
        reply = "".join(reply)
        q = Question(p["question"], tuple(p["answers"]))
        out.append({**p, "tick": k, "heard": ticks[k]["transcript"], "reply": reply, "correct": answered(reply, q),
                    "heard_ok": heard_ok(ticks[k]["transcript"], p["question"]),
                    "context_tokens": ticks[k].get("tokens"), "error": ticks[k].get("error")})
    return out


PROBE_ARMS = {"sinks": lambda p: (p.probe_sinks, p.probe_window), "none": lambda p: (0, p.probe_window),
              "dense": lambda p: (0, None)}


def run_probe(net, tokenizer, preset: QualityPreset, progress: bool = True, session_s: float | None = None,
              adapter=None) -> dict:
    """One long free-running session per arm, all fed the same audio tick by tick through one cascade adapter."""
    from tqdm import tqdm

    from metronome import Engine, EngineConfig, KVPolicy, StepInput
    from metronome.audio.adapter import TickAudio

    session_s = session_s or preset.probe_session_s
    budget_s = preset.probe_budget_ms / 1000.0
    times = probe_times(session_s, preset.probe_first_s, preset.probe_every_s)
    audio, probes = build_probe_audio(times, session_s, budget_s)
    settle = None
    if adapter is None:
        from metronome.audio.cascade import CascadeAdapter

        adapter = CascadeAdapter(tokenizer, max_input_tokens=1024)
        # Ticks run faster than real time here: each waits for the front end (VAD, Whisper beside the tick) to
        # finish the audio before it, so a transcript always joins the tick after its utterance ends.
        settle = adapter.frontend.wait_idle
    chunk = 256
    max_tokens_total = int(session_s / budget_s * (preset.probe_tokens_per_tick + 64)) + 1024
    arms = {}
    for arm in preset.probe_arms:
        sinks, window = PROBE_ARMS[arm](preset)
        policy = KVPolicy(sinks=sinks, window=window, block_size=preset.block_size)
        blocks = (math.ceil(min(max_tokens_total, net.spec.max_position_embeddings) / preset.block_size) + 8
                  if window is None else None)
        engine = Engine(EngineConfig(model=preset.model, policy=policy, device=preset.device, dtype=preset.dtype,
                                     num_blocks=blocks or 4 * (sinks + window + chunk) // preset.block_size + 16,
                                     max_chunk_tokens=chunk), model=net)
        sid = f"probe-{arm}"
        adapter.open_session(sid, "free_running", "")
        arms[arm] = {"engine": engine, "eid": engine.open_session(), "sid": sid, "ticks": [], "ended": None,
                     "policy": {"sinks": sinks, "window": window, "positions": policy.positions}}
    spt = int(round(budget_s * 16000))
    n_ticks = math.ceil(audio.size / spt)
    bar = tqdm(range(n_ticks), desc="probe", unit="tick", disable=not progress, dynamic_ncols=True)
    live = [a for a in arms]
    for k in bar:
        pcm = audio[k * spt:(k + 1) * spt]
        live = [a for a in live if arms[a]["ended"] is None]
        if not live:
            break
        if settle is not None:
            settle()
        prepared = adapter.prepare([TickAudio(arms[a]["sid"], pcm=pcm, max_tokens=preset.probe_tokens_per_tick)
                                    for a in live])
        for a, prep in zip(live, prepared):
            st = arms[a]
            engine, eid = st["engine"], st["eid"]
            ids = list(prep.token_ids or [])
            pieces = [ids[i:i + chunk] for i in range(0, len(ids), chunk)] or [None]
            res = None
            for j, piece in enumerate(pieces):
                last = j == len(pieces) - 1
                res, = engine.step([StepInput(eid, token_ids=piece, max_new_tokens=prep.max_new_tokens if last else 0)])
                if res.error:
                    break
            row = {"tick": k, "t_s": round((k + 1) * budget_s, 4), "transcript": prep.transcript, "text": "",
                   "tokens": None, "error": res.error}
            if res.error:
                st["ended"] = res.error        # e.g. dense/absolute reaching the position limit
            else:
                row["text"] = adapter.on_output(st["sid"], list(res.token_ids), res.finished)
                row["tokens"] = engine.session_stats(eid).num_tokens
            st["ticks"].append(row)
        done = {a: sum(1 for p in score_probes(arms[a]["ticks"], probes, preset.answer_ticks) if p["correct"])
                for a in arms}
        bar.set_postfix({"age": f"{(k + 1) * budget_s:.0f}s", **{a: done[a] for a in arms},
                         "ctx": arms[live[0]]["ticks"][-1]["tokens"]}, refresh=False)
    out = {"session_s": session_s, "probes": probes, "arms": {}}
    for a, st in arms.items():
        adapter.close_session(st["sid"])
        out["arms"][a] = {"policy": st["policy"], "ended": st["ended"], "ticks": st["ticks"],
                          "scored": score_probes(st["ticks"], probes, preset.answer_ticks)}
    return out


# ------------------------------------------------------------------------------------ run, analysis, report
def run_quality(preset: QualityPreset, out: Path, *, parts=("perplexity", "probe"), progress=True,
                text_tokens_override: int | None = None, session_s: float | None = None) -> dict:
    from dataclasses import replace

    from metronome.engine.runner import DTYPES
    from metronome.models.loader import load_model, load_tokenizer

    from metronome.experiments.sweep import machine

    if text_tokens_override:
        preset = replace(preset, text_tokens=text_tokens_override)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    net, checkpoint = load_model(preset.model, DTYPES[preset.dtype], preset.device)
    tokenizer = load_tokenizer(checkpoint)
    raw = {"experiment": "quality", "preset": preset.to_dict(), "machine": machine(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
           "text_source": "Nettle manual (public domain), prose paragraphs of /usr/share/doc/nettle-dev/nettle.html, "
                          "vendored as metronome/experiments/data/nettle_manual.txt", "checkpoint": str(checkpoint)}
    if "perplexity" in parts:
        raw["perplexity"] = run_perplexity(net, tokenizer, checkpoint, preset, progress)
        (out / "raw.json").write_text(json.dumps(raw))
    if "probe" in parts:
        raw["probe"] = run_probe(net, tokenizer, preset, progress, session_s=session_s)
    raw["elapsed_s"] = round(time.monotonic() - t0, 1)
    raw["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    (out / "raw.json").write_text(json.dumps(raw))
    return raw
