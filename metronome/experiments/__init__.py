"""The paper's experiments and the ones past it, run by ``metronome bench <experiment>`` (see ``cli/bench.py``).

Modules: ``presets`` (cpu / gpu settings of cliff and fill-model), ``server`` (one fresh worker + gateway process
per data point), ``loadgen`` (WebSocket clients and the KV sampler), ``speech`` (espeak-ng speech and the
public-domain text), ``cliff`` (the wall rule), ``report`` (JSON, PNG plots, markdown), ``sweep`` (runs the data
points of cliff and fill-model), ``points`` (labelled points for recycling and ablation), ``admission`` /
``admission_report``, ``recycling``, ``ablation``, ``quality`` / ``quality_report``, ``shapes`` and
``random_weights`` (real model shapes with random weights, for the GPU presets). Analyses are pure functions of
``raw.json``, so ``--from raw.json`` re-runs them.
"""
