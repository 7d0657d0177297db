"""Run the data points of a preset: for each arm × N × run, a fresh server process and the load generator."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from metronome.experiments.loadgen import LoadRun
from metronome.experiments.presets import Preset

CHAT_VOCAB = 49152


def make_tiny_checkpoint(path: str, max_position_embeddings: int, seed: int = 0) -> str:
    """A random 2-layer Llama (hidden 64, vocab 49152) + the packaged SmolLM2 tokenizer, like tests' chat_checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from metronome.models.embedded import embedded_checkpoint

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=CHAT_VOCAB, max_position_embeddings=max_position_embeddings,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(embedded_checkpoint("smollm2-135m")).save_pretrained(path)
    return path


def prepare_model(model: str, directory: str, max_position_embeddings: int) -> dict:
    """A preset's model → the server spec's ``model`` (and ``random_weights``): ``"tiny-random"`` becomes a
    tiny random checkpoint, ``"random:<shape>"`` a shape directory whose decoder the server draws at
    random (``shapes.py``); anything else (a packaged name, a checkpoint directory) passes through."""
    from metronome.experiments.shapes import RANDOM_PREFIX, is_random, make_shape_checkpoint

    if model == "tiny-random":
        return {"model": make_tiny_checkpoint(str(Path(directory) / "tiny"), max_position_embeddings)}
    if is_random(model):
        shape = model[len(RANDOM_PREFIX):]
        return {"model": make_shape_checkpoint(Path(directory) / shape, shape), "random_weights": True}
    return {"model": model}


ARMS = {"unbounded": lambda p: (0, None), "sink_window": lambda p: (p.sinks, p.window)}


def server_spec(preset: Preset, model: str, arm: str, n: int, seed: int) -> dict:
    sinks, window = ARMS[arm](preset)
    return dict(model=model, device=preset.device, dtype=preset.dtype, sinks=sinks, window=window,
                block_size=preset.block_size, num_blocks=preset.num_blocks, max_chunk_tokens=preset.max_chunk_tokens,
                budget_ms=preset.budget_ms, tokens_per_tick=preset.tokens_per_tick, sessions=n, seed=seed)


class Server:
    """``python -m metronome.experiments.server`` in a fresh process; stopped by closing its stdin."""

    def __init__(self, spec: dict, log_path: Path) -> None:
        self.log = open(log_path, "w")
        # A process group of its own: the gateway and its worker child go together if they must be killed.
        self.proc = subprocess.Popen([sys.executable, "-m", "metronome.experiments.server", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)
        line = self.proc.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError(f"server failed to start; see {log_path}")
        self.addresses = json.loads(line)

    def stop(self) -> None:
        """Close stdin (the gateway stops, then its worker, each given 20 s) and wait; past 45 s kill both."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def machine() -> dict:
    import torch

    return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "load_avg": os.getloadavg(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def run_sweep(preset: Preset, out_dir: Path, *, sessions=None, runs=None, duration_s=None, arms=None,
              first_run: int = 0, progress: bool = True) -> dict:
    """All data points; returns the raw result (also written to ``out_dir/raw.json`` as it goes).

    Runs are numbered (and seeded) from ``first_run``, so a sweep split over several processes draws
    different audio in each part and the parts join without clashes (``report.merge_raws``)."""
    from tqdm import tqdm

    sessions = tuple(sessions or preset.sessions)
    runs = runs or preset.runs
    duration_s = duration_s or preset.duration_s
    arms = tuple(arms or ARMS)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    raw = {"preset": preset.to_dict(), "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "command": " ".join(sys.argv), "runs_per_point": runs, "first_run": first_run, "duration_s": duration_s,
           "points": []}
    # Interleave arms and N inside each repetition so slow drift of a shared machine hits both arms alike.
    plan = [(r, n, arm) for r in range(first_run, first_run + runs) for n in sessions for arm in arms]
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="metronome-bench-") as tmp:
        model = prepare_model(preset.model, tmp, preset.max_position_embeddings)
        bar = tqdm(plan, desc=f"{preset.name} sweep", unit="run", disable=not progress, dynamic_ncols=True)
        for r, n, arm in bar:
            bar.set_description(f"{arm} N={n} run {r + 1}/{first_run + runs}")
            spec = {**server_spec(preset, model["model"], arm, n, seed=r), **model}
            t_point = time.monotonic()
            server = Server(spec, out_dir / "logs" / f"{arm}-N{n}-r{r}.log")
            try:
                load = LoadRun(gateway=server.addresses["gateway"], worker=server.addresses["worker"], sessions=n,
                               rate=preset.arrival_rate, duration_s=duration_s, sample_s=preset.sample_s, seed=r,
                               audio=preset.audio,
                               on_progress=(lambda d: bar.set_postfix(d, refresh=True)) if progress else None)
                import asyncio

                result = asyncio.run(load.run())
            finally:
                server.stop()
            raw["points"].append({"arm": arm, "run": r, "spec": spec,   # N is spec["sessions"]; "sessions" holds the traces
                                  "wall_clock_s": round(time.monotonic() - t_point, 2), **result})
            raw["elapsed_s"] = round(time.monotonic() - t_start, 1)
            (out_dir / "raw.json").write_text(json.dumps(raw))
    raw["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    (out_dir / "raw.json").write_text(json.dumps(raw))
    return raw
