"""The collector is held off inside ``collector_held_off`` and restored after; garbage from before is collected."""

from __future__ import annotations

import gc
import weakref

import pytest

from metronome.graph_capture import collector_held_off
from metronome.serving.gc_pauses import CollectorPauses


class _Node:
    pass


def _cycle_with_finalizer(log: list[str]) -> None:
    node = _Node()
    node.self = node
    weakref.finalize(node, log.append, "freed")


def test_garbage_is_collected_on_entry_and_none_while_held_off():
    log: list[str] = []
    thresholds = gc.get_threshold()
    try:
        _cycle_with_finalizer(log)
        with collector_held_off(collect_first=True), CollectorPauses() as pauses:
            assert log == ["freed"]          # the cycle from before went on entry
            gc.set_threshold(1, 1, 1)
            for _ in range(2000):            # would collect many times over with the collector on
                _cycle_with_finalizer(log)
            assert not gc.isenabled()
            assert pauses.take() == []
        assert gc.isenabled()
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    assert log.count("freed") == 2001


def test_without_collect_first_nothing_is_collected_on_entry():
    log: list[str] = []
    gc.disable()   # no automatic collection between making the cycle and entering
    try:
        _cycle_with_finalizer(log)
        with collector_held_off(collect_first=False):
            assert log == []
        assert not gc.isenabled()
    finally:
        gc.enable()
    gc.collect()
    assert log == ["freed"]


def test_the_collector_state_is_restored_after_an_error_and_stays_off_if_it_was():
    with pytest.raises(RuntimeError):
        with collector_held_off(collect_first=False):
            raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_held_off(collect_first=False):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
