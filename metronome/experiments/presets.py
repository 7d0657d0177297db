"""Settings for the cliff / fill-model sweep: a CPU preset that finishes here in minutes, a GPU one for the H200."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


@dataclass(frozen=True)
class Preset:
    name: str
    model: str                      # "tiny-random" (made into a temp dir) or a checkpoint dir / packaged name
    device: str
    dtype: str
    budget_ms: float                # frame period B
    tokens_per_tick: int            # τ: decode tokens per session per tick
    sessions: tuple[int, ...]       # N values
    runs: int                       # R runs per (arm, N)
    duration_s: float               # streaming time per run, counted from the first arrival
    arrival_rate: float             # open-loop session arrivals per second
    num_blocks: int                 # KV pool size (blocks), so the Unbounded pool fills within the run
    block_size: int
    sinks: int                      # SinkWindow arm
    window: int
    max_chunk_tokens: int
    max_position_embeddings: int    # tiny-random model only: room for the Unbounded arm's absolute positions
    sample_s: float                 # KV usage sampling period
    # Wall rule, scaled from the paper (B = 2 s: 10-s buckets, 500 ms threshold).
    bucket_s: float = 0.0           # 0: 5·B
    wall_ms: float = 0.0            # 0: 0.25·B
    quiet_fraction: float = 0.5     # "quiet wall": median preempted-frame fraction of the last 3 buckets above this
    audio: str = "speech"           # what the clients stream: "speech" (espeak-ng) or "noise" (loadgen.make_audio)
    extra: dict = field(default_factory=dict)

    @property
    def bucket(self) -> float:
        return self.bucket_s or 5.0 * self.budget_ms / 1000.0

    @property
    def wall_threshold_ms(self) -> float:
        return self.wall_ms or 0.25 * self.budget_ms

    def to_dict(self) -> dict:
        d = asdict(self)
        d["bucket_s"], d["wall_ms"] = self.bucket, self.wall_threshold_ms
        return d


# ~7 tokens per session per tick (3.1 audio tokens per 250 ms from the energy adapter + 4 decoded), i.e.
# ~28 tokens/s/session (measured: 0.56 %/s of a 320-block pool): 16 sessions fill 240 blocks of 16 tokens in
# ~8.5 s, 8 sessions in ~17 s, so both N reach the stall in the first half of a 36-s run. SinkWindow
# (S=4, W=64) reserves 8 blocks per session: 30 sessions fit.
# Wall threshold 0.5·B, not the paper's 0.25·B: a tick of the tiny model on this 2-core CPU already takes
# 40-60 ms (~20 % of B; the paper's steady ticks are < 1 % of B), so 0.25·B = 62 ms sits inside normal jitter.
CPU = Preset(name="cpu", model="tiny-random", device="cpu", dtype="float32", budget_ms=250.0, tokens_per_tick=4,
             sessions=(8, 16), runs=3, duration_s=36.0, arrival_rate=8.0, num_blocks=241, block_size=16,
             sinks=4, window=64, max_chunk_tokens=32, max_position_embeddings=4096, sample_s=0.5,
             wall_ms=125.0, audio="noise")   # noise: as in the documented run (docs/experiments/cliff-cpu)

# The paper's setting on one H200: B = 2 s, τ = 25, N = 96 and 128, R = 20 five-minute runs, S = 16,
# W = 1024, with a Qwen2.5-7B-shaped decoder of random weights (shapes.py; the scale of the paper's 7B
# omni model). A session adds 25 audio tokens (80-ms frames) + 25 decoded per tick, 25 tokens/s: 96
# sessions (arrived by 12 s) fill 21,600 blocks at ~150 s, like the paper's stall (145-148 s); SinkWindow
# reserves 70 blocks a session, 308 sessions. Not run here: R = 20 × 5 min is ~7 device-hours.
GPU = Preset(name="gpu", model="random:qwen2.5-7b", device="cuda", dtype="bfloat16", budget_ms=2000.0,
             tokens_per_tick=25, sessions=(96, 128), runs=20, duration_s=300.0, arrival_rate=8.0, num_blocks=21600,
             block_size=16, sinks=16, window=1024, max_chunk_tokens=64, max_position_embeddings=32768, sample_s=1.0)

# What 30 minutes of an H200 hold: N = 128, R = 3 one-minute runs. W = 256 so that the bounded
# arm's reservation (22 blocks) sits well below what the unbounded arm grows to within a minute; 5,400
# blocks are filled by 128 Unbounded sessions (25 tokens/s each, arrived by 16 s) at ~35 s.
GPU_SHORT = replace(GPU, name="gpu-short", sessions=(128,), runs=3, duration_s=60.0, num_blocks=5400, window=256)

# The cliff at R = 10 per arm: N = 128 one-minute runs, arrivals within 4 s (32/s). Unbounded sessions grow
# the pool by ~192 blocks/s (25 audio + 25 decoded tokens per 2-s tick each), so the fill model puts the stall
# at (3,000 + ~384) / 192 ≈ 18 s and the quiet wall (~26 s later in the gpu-short runs) inside the minute.
# SinkWindow reserves 22 blocks a session, 2,816 for 128: it fits. Runs can be split over several
# processes with ``--first-run`` and joined with ``--from a.json.gz,b.json.gz``.
GPU_CLIFF = replace(GPU_SHORT, name="gpu-cliff", runs=10, num_blocks=3000, arrival_rate=32.0)

PRESETS = {"cpu": CPU, "gpu": GPU, "gpu-short": GPU_SHORT, "gpu-cliff": GPU_CLIFF}
