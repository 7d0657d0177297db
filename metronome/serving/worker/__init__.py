"""The worker: a transport-free tick core (``tick.py``) behind a thin gRPC service (``service.py``).

    config.py    WorkerConfig, the adapter it builds
    tick.py      TickCore: sessions, streamed input, one tick over the engine and the adapter
    service.py   the gRPC Worker service over the core, on one engine thread; serve_worker, run_worker, drain
    admission.py the worker's own admission: its latency cap and draining (memory is the engine's reservation)
    budget.py    typed text and instructions counted in tokens before the engine thread
"""

from metronome.serving.worker.config import WorkerConfig, adapter_context, make_adapter, policy_name
from metronome.serving.worker.service import WorkerServer, WorkerService, run_worker, serve_worker
from metronome.serving.worker.tick import StreamedInput, StreamedTick, TickCore

__all__ = ["StreamedInput", "StreamedTick", "TickCore", "WorkerConfig", "WorkerServer", "WorkerService",
           "adapter_context", "make_adapter", "policy_name", "run_worker", "serve_worker"]
