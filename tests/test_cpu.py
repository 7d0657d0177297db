"""The thread plan: fixed shares of the box's cores, handed to worker processes through the environment."""

from __future__ import annotations

import threading

import pytest

from metronome.cpu import (PLAN_ENV, ThreadPlan, lower_thread_priority, thread_wait_env, start_at_lower_priority,
                           thread_nice)

needs_thread_nice = pytest.mark.skipif(thread_nice() is None, reason="this OS keeps no nice value per thread")


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 6, 8, 12, 16, 64, 128])
@pytest.mark.parametrize("speech", [True, False])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_shares_never_oversubscribe_a_box_of_two_or_more_cores(cores, speech, workers):
    plan = ThreadPlan.for_box(cores, speech=speech, workers=workers)
    assert plan.worker >= 1 and plan.vad == (1 if speech else 0) and (plan.asr >= 1) == speech
    parts = workers * (1 + speech) + (cores >= 8)   # engines, ASRs, the gateway on a larger box
    if cores >= parts:                              # with fewer cores than parts some must share
        assert workers * (plan.worker + plan.asr) + plan.gateway <= cores
    assert plan.asr <= 4       # Whisper tiny gains little past four threads


def test_the_speech_front_end_takes_cores_from_the_engine_only_when_it_exists():
    assert ThreadPlan.for_box(2, speech=True).worker == 1
    assert ThreadPlan.for_box(2, speech=False).worker == 2


def test_speech_yields_to_the_tick_only_where_there_is_speech():
    assert ThreadPlan.for_box(2, speech=True).speech_nice > 0
    assert ThreadPlan.for_box(2, speech=False).speech_nice == 0
    assert ThreadPlan.from_env("cores=2 workers=1 worker=1 asr=1 vad=1 gateway=0").speech_nice == 0   # an older serve's


@needs_thread_nice
def test_threads_a_library_starts_while_it_loads_keep_the_lower_priority():
    """As CTranslate2's worker thread does: started inside ``build``, it runs on at the lowered priority, and
    the caller's own priority is untouched."""
    base, release, seen = thread_nice(), threading.Event(), []

    def build() -> threading.Thread:
        worker = threading.Thread(target=lambda: (release.wait(10), seen.append(thread_nice())))
        worker.start()
        return worker

    worker = start_at_lower_priority(build, 3)
    release.set()
    worker.join(10)
    assert seen == [min(19, base + 3)] and thread_nice() == base


@needs_thread_nice
def test_lowering_a_thread_leaves_the_others_alone():
    base, seen = thread_nice(), []

    def lowered() -> None:
        lower_thread_priority(2)
        seen.append(thread_nice())

    t = threading.Thread(target=lowered)
    t.start()
    t.join(10)
    assert seen == [min(19, base + 2)] and thread_nice() == base


def test_a_load_that_fails_raises_in_the_callers_thread():
    with pytest.raises(ValueError, match="no such model"):
        start_at_lower_priority(lambda: (_ for _ in ()).throw(ValueError("no such model")), 3)


def test_a_worker_reads_back_the_plan_serve_gave_it():
    plan = ThreadPlan.for_box(16, speech=True, workers=2)
    assert ThreadPlan.from_env(plan.to_env()) == plan
    assert ThreadPlan.for_this_process(environ={PLAN_ENV: plan.to_env()}) == plan
    for junk in ("", "worker=x", "cores=2 bogus=1", "=="):
        assert ThreadPlan.from_env(junk) is None


def test_thread_wait_env_keeps_what_the_user_set():
    env = {"GOMP_SPINCOUNT": "0"}
    added = thread_wait_env(env)
    assert env["GOMP_SPINCOUNT"] == "0" and "GOMP_SPINCOUNT" not in added
    assert env["KMP_BLOCKTIME"] == "1" and "OMP_WAIT_POLICY" not in env
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}      # a spin count would override it in libgomp: none is added
    assert thread_wait_env(passive) == {} and passive == {"OMP_WAIT_POLICY": "PASSIVE"}
