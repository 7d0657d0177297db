"""Experiments that reproduce the Metronome paper's cliff and fill-model results (issue 6).

Run from a source checkout (this folder is not part of the installed ``metronome`` package)::

    metronome bench cliff --preset cpu          # or: .venv/bin/python -m bench.experiments cliff --preset cpu
    metronome bench fill-model --preset cpu
    metronome bench cliff --from results/experiments/cliff-cpu-<stamp>/raw.json   # re-analyse, no run

Modules: ``presets`` (cpu / gpu settings), ``server`` (one fresh worker + gateway process per data
point), ``loadgen`` (WebSocket clients and the KV sampler), ``cliff`` (wall rule), ``fill_model``
(ρ(t) fit, plateau), ``report`` (JSON, PNG plots, markdown), ``sweep`` (runs the data points).
The pure analysis modules (``cliff``, ``fill_model``) import only numpy.
"""
