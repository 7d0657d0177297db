"""The worker supervisor restarts a worker that exits, waiting longer after each failed restart."""

from __future__ import annotations

import sys

from metronome.serving.supervisor import Backoff, WorkerSupervisor


def test_a_worker_that_keeps_exiting_is_restarted_with_doubling_waits():
    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    supervisor = WorkerSupervisor({"127.0.0.1:1": crash}, {}, None, Backoff(first_s=1.0, max_s=3.0, reset_after_s=60))
    supervisor.start()
    worker = supervisor.workers[0]
    try:
        waits, now = [], 0.0
        for _ in range(4):
            worker.proc.wait(timeout=30)
            supervisor.poll(now)                      # notices the exit, schedules the restart
            assert worker.exits[-1] == 3 and worker.restart_at is not None
            waits.append(worker.restart_at - now)
            supervisor.poll(worker.restart_at - 0.01)  # not yet
            assert worker.restart_at is not None
            now = worker.restart_at
            supervisor.poll(now)                      # restarted: a new process
            assert worker.restart_at is None and worker.started_at > 0
        assert waits == [1.0, 2.0, 3.0, 3.0] and worker.restarts == 4
    finally:
        supervisor.stop()


def test_a_worker_that_stayed_up_starts_over_from_the_first_wait():
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    supervisor = WorkerSupervisor({"127.0.0.1:1": sleep}, {}, None, Backoff(first_s=1.0, max_s=8.0, reset_after_s=5))
    supervisor.start()
    worker = supervisor.workers[0]
    try:
        worker.delay_s = 8.0                          # after several failed restarts
        supervisor.poll(worker.started_at + 6)        # up longer than reset_after_s
        assert worker.delay_s == 1.0
    finally:
        supervisor.stop()
    assert worker.proc.poll() is not None             # stop() ended it
