# Moved from the session scratch folder into bench/ so the numbers in docs/benchmarks/cpu.md can be rerun.
"""Staggered load: every session asks a question every 10 s (each question 2 s of speech), sessions offset
by whole ticks so ~N/4 utterances end per 2 s tick at most; 30 s per N. Reports max/mean tick and misses of B = 2 s."""
import sys, time, numpy as np, torch
sys.path.insert(0, ".")
from tests.audio.speech import synth, trim, silence
from metronome import Engine, EngineConfig, KVPolicy, SamplingParams, StepInput
from metronome.audio.adapter import TickAudio
from metronome.audio.cascade import CascadeAdapter

B, TOK, RATE, CYCLE, DUR = 2.0, 8, 16000, 10.0, 30.0
eng = Engine(EngineConfig(model="smollm2-135m", policy=KVPolicy(sinks=16, window=1024), num_blocks=2400))
ad = CascadeAdapter(eng.tokenizer)
qs = ["What is the capital of France?", "What is the capital of Germany?", "What is the capital of Japan?"]
speech = [trim(synth(q, words_per_minute=135)) for q in qs]
step = int(B * RATE)
print("N  ticks  utt/tick(max)  VAD ms(mean)  ASR ms(max)  LLM ms(max)  tick ms(max)  tick ms(mean)  misses  answers")
for n in [int(a) for a in sys.argv[1:]]:
    sids = [f"t{n}_{i}" for i in range(n)]
    eids = {s: eng.open_session() for s in sids}
    for s in sids: ad.open_session(s, "turn", "")
    audio = {}
    for i, s in enumerate(sids):
        cyc = np.zeros(int(CYCLE * RATE), np.float32)
        q = speech[i % 3]; off = int((i % 4) * B * RATE) + RATE // 4
        cyc[off:off + len(q)] = q
        audio[s] = np.tile(cyc, int(DUR / CYCLE))
    said = {s: "" for s in sids}
    rows = []
    for k in range(0, len(audio[sids[0]]), step):
        t0 = time.perf_counter()
        prep = ad.prepare([TickAudio(s, audio[s][k:k + step], max_tokens=TOK) for s in sids])
        t1 = time.perf_counter()
        outs = eng.step([StepInput(eids[s], token_ids=p.token_ids, max_new_tokens=p.max_new_tokens,
                                   sampling=SamplingParams(stop_token_ids=p.stop_token_ids)) for s, p in zip(sids, prep)])
        for s, o in zip(sids, outs):
            said[s] += ad.on_output(s, list(o.token_ids), o.finished)
        t2 = time.perf_counter()
        rows.append((ad.last_timing.utterances, ad.last_timing.vad_ms, ad.last_timing.asr_ms, (t2 - t1) * 1e3, (t2 - t0) * 1e3))
    r = np.array(rows)
    ok = sum(said[s].count(["Paris", "Berlin", "Tokyo"][i % 3]) for i, s in enumerate(sids))
    print(f"{n:2d} {len(rows):6d} {int(r[:,0].max()):14d} {r[:,1].mean():13.1f} {r[:,2].max():12.0f} {r[:,3].max():12.0f} "
          f"{r[:,4].max():13.0f} {r[:,4].mean():14.0f} {int((r[:,4] > B*1e3).sum()):7d}  {ok}/{3*n}", flush=True)
    for s in sids:
        ad.close_session(s); eng.close_session(eids[s])
