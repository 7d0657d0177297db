# Moved from the session scratch folder into bench/ so the numbers in docs/benchmarks/cpu.md can be rerun.
"""Per-tick cost of VAD + ASR + LLM for N concurrent cascade sessions on this CPU (B = 2 s, 8 tokens/tick).

Worst case on purpose: every session asks its question at the same moment, so all utterances end in
the same tick and Whisper transcribes N of them in one batch, then the engine prefills N user turns."""
import sys, time, numpy as np, torch
sys.path.insert(0, ".")
from tests.audio.speech import synth, trim, silence
from metronome import Engine, EngineConfig, KVPolicy, SamplingParams, StepInput
from metronome.audio.adapter import TickAudio
from metronome.audio.cascade import CascadeAdapter

B, TOK, RATE = 2.0, 8, 16000
eng = Engine(EngineConfig(model="smollm2-135m", policy=KVPolicy(sinks=16, window=1024), num_blocks=1200))
ad = CascadeAdapter(eng.tokenizer)
qs = ["What is the capital of France?", "What is the capital of Germany?", "What is the capital of Japan?"]
speech = [np.concatenate([silence(0.3), trim(synth(q, words_per_minute=135)), silence(1.7)]) for q in qs]
print(f"torch threads {torch.get_num_threads()}, whisper threads {ad.asr._model.model.num_workers if False else 'min(4,cpus)'}")
print("N  ticks  VAD ms/tick  ASR ms (max tick)  LLM ms (max tick)  worst tick ms  mean tick ms  RTF/session  correct")
for n in [int(a) for a in sys.argv[1:]] or [1, 2, 4, 8]:
    sids = [f"s{n}_{i}" for i in range(n)]
    eids = {s: eng.open_session() for s in sids}
    for s in sids: ad.open_session(s, "turn", "")
    audio = {s: np.concatenate([speech[i % 3], silence(6.0)]) for i, s in enumerate(sids)}
    said = {s: "" for s in sids}
    rows = []
    step = int(B * RATE)
    for k in range(0, len(audio[sids[0]]), step):
        t0 = time.perf_counter()
        prep = ad.prepare([TickAudio(s, audio[s][k:k + step], max_tokens=TOK) for s in sids])
        t1 = time.perf_counter()
        outs = eng.step([StepInput(eids[s], token_ids=p.token_ids, max_new_tokens=p.max_new_tokens,
                                   sampling=SamplingParams(stop_token_ids=p.stop_token_ids)) for s, p in zip(sids, prep)])
        for s, o in zip(sids, outs):
            said[s] += ad.on_output(s, list(o.token_ids), o.finished)
        t2 = time.perf_counter()
        rows.append((ad.last_timing.vad_ms, ad.last_timing.asr_ms, (t2 - t1) * 1e3, (t2 - t0) * 1e3))
    r = np.array(rows)
    ok = sum(w in said[s] for i, s in enumerate(sids) for w in [["Paris", "Berlin", "Tokyo"][i % 3]])
    audio_s = len(audio[sids[0]]) / RATE
    print(f"{n:2d} {len(rows):6d} {r[:,0].mean():12.1f} {r[:,1].max():18.0f} {r[:,2].max():18.0f} {r[:,3].max():14.0f} "
          f"{r[:,3].mean():13.0f} {r[:,3].sum()/1e3/audio_s/n:12.3f}  {ok}/{n}", flush=True)
    for s in sids:
        ad.close_session(s); eng.close_session(eids[s])
