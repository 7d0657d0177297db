"""The scheduler on its own, as vLLM's core tests do: build sessions, ask for a plan, assert on it (no model)."""

from __future__ import annotations

import doctest

import pytest
import torch

from metronome.config import KVPolicy
from metronome.engine import policy as policy_module
from metronome.engine import session as session_module
from metronome.engine.blocks import BlockPool, blocks_per_session
from metronome.engine.policy import retention_for
from metronome.engine.request import ForwardResult, ForwardSegment, StepInput
from metronome.engine.scheduler import Scheduler
from metronome.engine.session import SessionStatus


def scheduler(policy: KVPolicy, num_blocks: int = 200, chunk: int = 8, max_model_len: int = 4096) -> Scheduler:
    return Scheduler(policy, BlockPool(num_blocks), max_chunk_tokens=chunk, max_model_len=max_model_len,
                     max_batch_tokens=64, vocab_size=100, hidden_size=4)


def run(s: Scheduler, segments: list[ForwardSegment]):
    """Plan a forward and apply a fake result (what the engine does around the runner)."""
    plan = s.schedule_forward(segments)
    rows = tuple(torch.full((4,), float(seg.session.session_id)) for seg in plan.segments)
    s.update_from_output(plan, ForwardResult(torch.zeros(sum(map(len, plan.segments)), 4), rows))
    return plan


def test_doctests():
    assert doctest.testmod(policy_module).failed == 0
    assert doctest.testmod(session_module).failed == 0


def test_step_plan_admits_valid_inputs_in_order_and_refuses_the_rest():
    s = scheduler(KVPolicy(sinks=4, window=16, block_size=4))
    a, b, c = s.admit(), s.admit(), s.admit()
    plan = s.schedule_step([StepInput(b.session_id, token_ids=[1, 2]), StepInput(99, token_ids=[1]),
                            StepInput(a.session_id, token_ids=[3]), StepInput(b.session_id, token_ids=[4]),
                            StepInput(c.session_id, token_ids=list(range(9)))])
    assert [(x.index, x.session) for x in plan.admitted] == [(0, b), (2, a)]
    assert [i for i, _ in plan.errors] == [1, 3, 4]
    assert "unknown session" in plan.errors[0][1] and "more than once" in plan.errors[1][1]
    assert "max_chunk_tokens" in plan.errors[2][1]
    # Refusing changes nothing.
    assert a.num_tokens == b.num_tokens == 0 and s.pool.used == 0


def test_forward_plan_allocates_first_and_releases_what_left_the_window_after():
    pol = KVPolicy(sinks=4, window=8, block_size=4, positions="absolute")
    s = scheduler(pol)
    sess = s.admit()
    plan = s.schedule_forward([ForwardSegment(sess, list(range(8)))])
    assert sess.live_blocks == 2 and sess.num_tokens == 0   # blocks now, length after the forward
    assert plan.release_below == (0,)
    s.update_from_output(plan, ForwardResult(torch.zeros(8, 4), (torch.ones(4),)))
    assert sess.num_tokens == 8 and torch.equal(sess.last_hidden, torch.ones(4))
    plan = run(s, [ForwardSegment(sess, list(range(8)))])
    # At 16 tokens the next query attends to [0, 4) and [8, 16]: block 1 (tokens 4-7) is dead.
    assert plan.release_below == (retention_for(pol).releasable_until(16),) == (2,)
    assert sess.physical(1) is None and sess.live_blocks == 3
    s.check_invariants()


def test_a_session_never_holds_more_than_the_one_formula_through_plans():
    pol = KVPolicy(sinks=3, window=10, block_size=4, positions="absolute")
    s = scheduler(pol, chunk=5)
    sess = s.admit()
    limit = blocks_per_session(pol, 5, 4096)
    assert sess.reservation == limit == retention_for(pol).max_blocks(5, 4096)
    for n in [5, 1, 1, 5, 3, 1, 5, 5, 1, 2] * 5:
        run(s, [ForwardSegment(sess, [1] * n)])
        assert sess.live_blocks <= limit
        s.check_invariants()


def test_rebase_is_planned_with_the_window_slots_and_moves_the_position_base():
    pol = KVPolicy(sinks=2, window=8, block_size=4, rebase_every=4)
    s = scheduler(pol)
    sess = s.admit()
    run(s, [ForwardSegment(sess, [1] * 8)])
    assert s.rebase_delta(sess) == 0              # 8 tokens: nothing to move yet
    plan = None
    while plan is None or plan.rebase is None:
        length = sess.num_tokens
        plan = run(s, [ForwardSegment(sess, [1] * 4)])
    # Past sinks + window + Δ = 14 tokens the window moves back by Δ before the next append.
    assert length == 16 and sess.position_base == 4 and plan.rebase.deltas == (-4,)
    # The keys moved are the window's: tokens [oldest attended, length) as they were before this forward.
    lo = retention_for(pol).oldest_attended_token(length)
    assert len(plan.rebase.slots) == length - lo and set(plan.rebase.rows.tolist()) == {0}


def test_unbounded_baseline_plans_a_preemption_of_the_newest_session():
    s = scheduler(KVPolicy(window=None, block_size=4), num_blocks=5, chunk=4)
    old, new = s.admit(), s.admit()
    run(s, [ForwardSegment(old, [1] * 8)])
    run(s, [ForwardSegment(new, [1] * 8)])
    assert s.pool.free_count == 0
    plan = s.schedule_forward([ForwardSegment(old, [1] * 4)])
    assert plan.preempted == (new.session_id,) and [seg.session for seg in plan.segments] == [old]
    assert new.status is SessionStatus.PREEMPTED and new.live_blocks == 0 and new.last_hidden is None


def test_unbounded_history_keeps_embeddings_without_the_tensor_they_were_cut_from():
    """A tick's rows spliced at once reach the engine as views of one tensor: the history keeps its own rows."""
    s = scheduler(KVPolicy(window=None, block_size=4), chunk=4)
    a, b = s.admit(), s.admit()
    tick = torch.arange(24.0).reshape(6, 4)
    own = torch.ones(2, 4)
    s.record_history(a, ForwardSegment(a, [], tick[:3]))
    s.record_history(b, ForwardSegment(b, [], own))
    kept, = a.history
    assert torch.equal(kept.embeds, tick[:3])
    assert kept.embeds.untyped_storage().nbytes() == 3 * 4 * tick.element_size()
    assert b.history[0].embeds is own   # a whole tensor is kept as it is, not copied


def test_a_session_past_the_position_limit_fails_alone():
    s = scheduler(KVPolicy(sinks=2, window=8, block_size=4, positions="absolute"), max_model_len=12)
    a, b = s.admit(), s.admit()
    run(s, [ForwardSegment(a, [1] * 8), ForwardSegment(b, [1] * 8)])
    seg, error = s.segment(a, [1] * 5)
    assert seg is None and "position limit" in error
    assert a.status is SessionStatus.FAILED and a.live_blocks == 0
    seg, error = s.segment(b, [1] * 4)
    assert error is None and b.status is SessionStatus.ACTIVE and len(seg) == 4


def test_the_table_column_is_the_same_arithmetic_everywhere():
    from metronome.attention.metadata import table_column

    spec = retention_for(KVPolicy(sinks=5, window=8, block_size=4))
    assert spec.sink_blocks == 2
    logical = torch.arange(12)
    assert spec.column(logical, 6).tolist() == [table_column(b, 2, 6) for b in range(12)]
    assert [spec.column(b, 6) for b in (0, 1, 6, 7)] == [0, 1, 2, 3]
