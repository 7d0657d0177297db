"""Experiments that reproduce the Metronome paper's results and go past them (issue 6).

Run from a source checkout (this folder is not part of the installed ``metronome`` package)::

    metronome bench cliff --preset cpu          # or: .venv/bin/python -m bench.experiments cliff --preset cpu
    metronome bench fill-model --preset cpu
    metronome bench admission --preset cpu
    metronome bench recycling --preset cpu      # 4: application-level recycling vs SinkWindow
    metronome bench ablation --preset cpu       # 5: W × S, latency and KV memory
    metronome bench quality --preset cpu        # 6: SmolLM2 perplexity per policy, spoken-question probe
    metronome bench cliff --from results/experiments/cliff-cpu-<stamp>/raw.json   # re-analyse, no run

Modules: ``presets`` (cpu / gpu settings of 1-2), ``server`` (one fresh worker + gateway process per data
point), ``loadgen`` (WebSocket clients and the KV sampler), ``speech`` (espeak-ng speech and the
public-domain text), ``cliff`` (wall rule), ``fill_model`` (ρ(t) fit, plateau), ``report`` (JSON, PNG
plots, markdown), ``sweep`` (runs the data points of 1-2), ``points`` (runs labelled points for 4-5),
``admission`` / ``admission_report`` (3), ``recycling`` (4), ``ablation`` (5), ``quality`` (6); each of
3-6 holds its own presets, analysis and report. The pure analysis functions import only numpy.
"""
