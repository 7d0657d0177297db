"""The Triton paged sink + window kernel against the torch reference and the float64 dense oracle.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before
triton is imported). Shapes are small: the interpreter runs every program one after another in numpy.
Freed blocks are NaN-poisoned by ``build_case``: a single read of one would put NaN in the output.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from metronome.attention.reference import paged_attention_reference, plan_reference  # noqa: E402
from metronome.attention.triton_paged import (  # noqa: E402
    CROWDED_DECODE_STAGES, SINGLE_BUFFERED_MAX_REGISTERS, TritonPagedAttention, choose_splits, choose_stages,
    launch_stages, live_tiles, paged_attention_triton, plan_triton)
from tests.attention.test_reference import CASES, build_case, dense_oracle  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _case(seqs, sinks, window, bs, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, seed=0):
    meta, query, k_cache, v_cache, dense = build_case(seqs, sinks, window, bs, heads=heads, kv_heads=kv_heads,
                                                      head_dim=head_dim, seed=seed)
    if DEVICE != "cpu":
        meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(DEVICE)
                                            for f in dataclasses.fields(meta)
                                            if isinstance(getattr(meta, f.name), torch.Tensor)})
    to = dict(device=DEVICE, dtype=dtype)
    return meta, query.to(**to), k_cache.to(**to), v_cache.to(**to), dense


def _run(meta, query, k_cache, v_cache, **plan_options):
    heads, kv_heads = query.shape[1], k_cache.shape[2]
    plan = plan_triton(meta, heads, kv_heads, **plan_options)
    out = torch.full_like(query, float("nan"))  # every element must be written
    paged_attention_triton(query, k_cache, v_cache, meta, plan=plan, out=out)
    return out, plan


def _check(out, meta, query, k_cache, v_cache, dense, seqs, sinks, window):
    assert torch.isfinite(out).all(), "a freed (NaN) block or an unwritten row reached the output"
    tol = TOL[query.dtype]
    ref = paged_attention_reference(query, k_cache, v_cache, plan_reference(meta, query.shape[1]))
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    start = 0
    for (ctx, qlen), (keys, values) in zip(seqs, dense):
        q = query[start:start + qlen].cpu()
        if query.dtype != torch.float32:  # the oracle sees the same rounded inputs as the kernel
            keys, values = keys.to(query.dtype), values.to(query.dtype)
        expect = dense_oracle(q, keys, values, ctx - qlen, sinks, window)
        torch.testing.assert_close(out[start:start + qlen].cpu().double(), expect, **tol)
        start += qlen


# Reference cases (t < S, S <= t < S+W, t >> W, window ending mid-block, S = 0, no window, mixed
# prefill + decode, block size 1), small key tiles so that tiles, sinks and splits all interact.
@pytest.mark.parametrize("name", CASES)
def test_matches_reference_and_oracle(name):
    seqs, sinks, window, bs = CASES[name]
    meta, query, k_cache, v_cache, dense = _case(seqs, sinks, window, bs)
    out, _ = _run(meta, query, k_cache, v_cache, block_n=16, force_splits=1)
    _check(out, meta, query, k_cache, v_cache, dense, seqs, sinks, window)


MIXED = [(150, 1), (40, 40), (97, 13), (5, 1)]  # decode past the window, a first chunk, a later chunk, t < S


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype,bs", [
    (2, 2, 64, torch.float32, 16),     # GQA ratio 1 (MHA)
    (6, 2, 64, torch.float32, 8),      # ratio 3 (not a power of two), block size 8
    (4, 1, 128, torch.float32, 16),    # ratio 4, head_dim 128
    (3, 1, 64, torch.bfloat16, 16),    # bf16, ratio 3
    (4, 1, 128, torch.bfloat16, 8),    # bf16, head_dim 128, block size 8
    (2, 1, 64, torch.float16, 16),     # fp16
], ids=["mha-d64-fp32-bs16", "gqa3-d64-fp32-bs8", "gqa4-d128-fp32-bs16", "gqa3-d64-bf16-bs16",
        "gqa4-d128-bf16-bs8", "gqa2-d64-fp16-bs16"])
def test_heads_dims_dtypes(heads, kv_heads, head_dim, dtype, bs):
    sinks, window = 16, 48
    meta, query, k_cache, v_cache, dense = _case(MIXED, sinks, window, bs, heads, kv_heads, head_dim, dtype, seed=1)
    out, _ = _run(meta, query, k_cache, v_cache, block_n=32, force_splits=1)
    _check(out, meta, query, k_cache, v_cache, dense, MIXED, sinks, window)


@pytest.mark.parametrize("name", ["t>>W", "window ends mid-block", "S=0 plain sliding window",
                                  "no window (causal)", "mixed prefill and decode"])
def test_split_kv_matches_unsplit(name):
    seqs, sinks, window, bs = CASES[name]
    meta, query, k_cache, v_cache, dense = _case(seqs, sinks, window, bs, seed=2)
    whole, plan1 = _run(meta, query, k_cache, v_cache, block_n=16, force_splits=1)
    assert all(ln.num_splits == 1 for ln in plan1.launches)
    # 3 splits: uneven chunks; max tiles + 1 splits: some splits get no tile at all and must not count.
    most = max(live_tiles(c - q, q, sinks, window, 16) for c, q in seqs)
    for splits in (3, most + 1):
        split, plan = _run(meta, query, k_cache, v_cache, block_n=16, force_splits=splits)
        assert all(ln.num_splits == splits for ln in plan.launches)
        torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-5)
    _check(split, meta, query, k_cache, v_cache, dense, seqs, sinks, window)


def test_default_tiles_and_automatic_split():
    """GPU defaults (64-key tiles, 16/64-row programs) with the split rule choosing by itself."""
    seqs, sinks, window, bs = [(300, 1), (41, 41), (260, 50), (17, 1)], 16, 64, 16
    meta, query, k_cache, v_cache, dense = _case(seqs, sinks, window, bs, heads=6, kv_heads=2, seed=3)
    out, plan = _run(meta, query, k_cache, v_cache, num_sms=16)  # few SMs: the split rule must split
    assert {ln.block_m for ln in plan.launches} == {16, 64}
    assert any(ln.num_splits > 1 for ln in plan.launches)
    _check(out, meta, query, k_cache, v_cache, dense, seqs, sinks, window)


def test_split_rule_is_a_host_function():
    assert choose_splits(1024, 20, target_programs=528) == 1
    assert choose_splits(4, 20, target_programs=528) == 10      # capped by 2 tiles per split
    assert choose_splits(4, 200, target_programs=528) == 16     # capped by max_splits
    assert choose_splits(200, 200, target_programs=528) == 3
    # The plan reads only the metadata's host lists: device tensors on the 'meta' device (no data) work.
    seqs = [(1100, 1)] * 3 + [(1100, 26)]
    meta, *_ = build_case(seqs, 16, 1024, 16, heads=4, kv_heads=1)
    ghost = dataclasses.replace(meta, **{f.name: torch.empty_like(getattr(meta, f.name), device="meta")
                                         for f in dataclasses.fields(meta)
                                         if isinstance(getattr(meta, f.name), torch.Tensor)})
    plan = plan_triton(ghost, 4, 1, num_sms=132)
    real = plan_triton(meta, 4, 1, num_sms=132)
    assert [(ln.block_m, ln.num_items, ln.num_splits) for ln in plan.launches] == \
        [(ln.block_m, ln.num_items, ln.num_splits) for ln in real.launches] == [(16, 3, 9), (64, 2, 9)]
    # 1041 live keys for a decode past the window: one sink tile and 17 window tiles of 64 -> 18 tiles,
    # so at most 9 splits of 2 tiles; a chunk whose window reaches back into the sink tile merges them.
    assert live_tiles(1099, 1, 16, 1024, 64) == 18
    assert live_tiles(1074, 16, 16, 1024, 64) == 18


def test_the_decode_launch_takes_its_own_tile_width():
    """``decode_block_n`` widens the decode launch's tiles only: its tile count (and so its splits) follows its
    width, the prefill launch keeps ``block_n``; the kernel attends the same either way."""
    seqs = [(1100, 1)] * 3 + [(1100, 26)]
    meta, *_ = build_case(seqs, 16, 1024, 16, heads=4, kv_heads=1)
    plan = plan_triton(meta, 4, 1, num_sms=132, decode_block_n=128)
    # 1100 keys in tiles of 128: 9 tiles (the window starts inside the sink tile), so at most 4 splits of 2.
    assert [(ln.block_m, ln.block_n, ln.max_tiles, ln.num_splits) for ln in plan.launches] == \
        [(16, 128, 9, 4), (64, 64, 18, 9)]
    assert TritonPagedAttention(4, num_kv_heads=1).decode_block_n == 64
    with pytest.raises(ValueError, match="power of two"):
        plan_triton(meta, 4, 1, decode_block_n=48)
    assert TritonPagedAttention(4, num_kv_heads=1, decode_block_n=128).decode_block_n == 128
    seqs, sinks, window = [(300, 1), (41, 41), (260, 50), (17, 1)], 16, 64
    meta, query, k_cache, v_cache, dense = _case(seqs, sinks, window, 16, heads=6, kv_heads=2, seed=3)
    out, plan = _run(meta, query, k_cache, v_cache, block_n=16, decode_block_n=32, force_splits=2)
    assert [(ln.block_m, ln.block_n) for ln in plan.launches] == [(16, 32), (64, 16)]
    _check(out, meta, query, k_cache, v_cache, dense, seqs, sinks, window)


def test_decode_launches_of_many_programs_are_single_buffered():
    assert choose_stages(256, 132, decode=True) == 3       # 64 sessions x 4 KV heads: 1.9 programs per SM
    assert choose_stages(512, 132, decode=True) == 2       # 128 sessions: 3.9 per SM
    assert choose_stages(10_000, 132, decode=False) == 3   # prefill tiles keep their two K/V buffers
    seqs = [(1100, 1)] * 70 + [(1100, 26)] * 40
    meta, *_ = build_case(seqs, 16, 1024, 16, heads=28, kv_heads=4)
    wide = plan_triton(meta, 28, 4, num_sms=132)
    assert [(ln.block_m, ln.num_splits, ln.num_stages) for ln in wide.launches] == [(16, 1, 2), (64, 1, 3)]
    assert [launch_stages(wide, ln, 256) for ln in wide.launches] == [2, 2]   # no room for three at D = 256
    narrow = plan_triton(meta, 28, 4, num_sms=132 * 2)
    assert [ln.num_stages for ln in narrow.launches] == [3, 3]
    forced = plan_triton(meta, 28, 4, num_sms=132, num_stages=4)
    assert [launch_stages(forced, ln, 128) for ln in forced.launches] == [4, 4]


def test_crowded_decode_launches_take_their_own_stages_and_the_register_cap():
    """Only a decode launch of more than 2 programs per SM is crowded: it takes ``crowded_stages`` and the plan's
    register cap; the prefill launch and a decode launch of few programs keep 3 stages and no cap."""
    from metronome.attention.triton_paged import _launch_config

    assert choose_stages(512, 132, decode=True, crowded_stages=4) == 4
    assert choose_stages(256, 132, decode=True, crowded_stages=4) == 3
    seqs = [(1100, 1)] * 70 + [(1100, 26)] * 40
    meta, *_ = build_case(seqs, 16, 1024, 16, heads=28, kv_heads=4)
    for num_sms, crowded_launch in ((132, True), (132 * 2, False)):
        plan = plan_triton(meta, 28, 4, num_sms=num_sms, crowded_stages=4, max_registers=128)
        decode, prefill = plan.launches
        assert (decode.crowded, decode.num_stages) == (crowded_launch, 4 if crowded_launch else 3)
        assert (prefill.crowded, prefill.num_stages) == (False, 3)
        configs = [_launch_config(plan, ln, 128, is_cuda=True) for ln in plan.launches]
        assert [c.get("maxnreg") for c in configs] == [128 if crowded_launch else None, None]


def test_the_values_widening_group_limit_is_a_backend_option():
    from metronome.attention.triton_paged import WIDEN_V_MAX_GROUP, widen_values_at_load

    assert widen_values_at_load(True, True, torch.bfloat16, WIDEN_V_MAX_GROUP)
    assert not widen_values_at_load(True, True, torch.bfloat16, 2 * WIDEN_V_MAX_GROUP)
    assert not widen_values_at_load(True, True, torch.bfloat16, 8, max_group=4)
    assert not widen_values_at_load(True, False, torch.bfloat16, 1, max_group=8)   # the interpreter casts
    meta, *_ = build_case([(300, 1)], 16, 64, 16, heads=8, kv_heads=1)
    assert plan_triton(meta, 8, 1).widen_v_max_group == WIDEN_V_MAX_GROUP
    assert TritonPagedAttention(8, num_kv_heads=1, widen_v_max_group=4).prepare(meta).widen_v_max_group == 4


def test_crowded_stages_follow_the_pages_element_type():
    """Over E4M3 pages a crowded decode launch keeps a second K/V buffer (half the bytes a tile); over 16-bit pages
    one, so that 4 programs fit an SM. An explicit depth wins."""
    from metronome.attention.triton_paged import CROWDED_DECODE_STAGES_E4M3

    assert CROWDED_DECODE_STAGES_E4M3 > CROWDED_DECODE_STAGES
    seqs = [(1100, 1)] * 140
    meta, *_ = build_case(seqs, 16, 1024, 16, heads=28, kv_heads=4)
    for kv_dtype, stages in ((torch.bfloat16, CROWDED_DECODE_STAGES), (torch.float16, CROWDED_DECODE_STAGES),
                             (torch.float8_e4m3fn, CROWDED_DECODE_STAGES_E4M3)):
        backend = TritonPagedAttention(28, num_kv_heads=4, num_sms=132, kv_dtype=kv_dtype)
        (launch,) = backend.prepare(meta).launches
        assert (launch.crowded, launch.num_stages) == (True, stages)
    backend = TritonPagedAttention(28, num_kv_heads=4, num_sms=132, kv_dtype=torch.float8_e4m3fn, crowded_stages=2)
    assert backend.prepare(meta).launches[0].num_stages == 2


def test_backend_writes_new_keys_then_attends():
    seqs, sinks, window = [(10, 3), (30, 1)], 2, 4
    meta, query, k_cache, v_cache, dense = _case(seqs, sinks, window, 4)
    flat_k, flat_v = (c.view(-1, *c.shape[2:]) for c in (k_cache, v_cache))
    new_k = torch.cat([dense[0][0][7:], dense[1][0][29:]]).to(DEVICE)
    new_v = torch.cat([dense[0][1][7:], dense[1][1][29:]]).to(DEVICE)
    flat_k[meta.slot_mapping] = float("nan")  # the backend must overwrite them with the given K/V
    flat_v[meta.slot_mapping] = float("nan")
    for backend in (TritonPagedAttention(num_heads=4), TritonPagedAttention(num_heads=4, num_kv_heads=2)):
        plan = backend.prepare(meta)
        for _layer in range(2):  # the plan is built once per forward and reused by every layer
            out = backend(query, new_k, new_v, k_cache, v_cache, plan)
            _check(out, meta, query, k_cache, v_cache, dense, seqs, sinks, window)
    assert backend.name == "triton"


@pytest.mark.parametrize("heads, kv_heads, sinks, window", [(4, 2, 4, 32), (7, 1, 0, None), (8, 8, 16, 64)])
def test_warm_up_launches_every_variant_a_plan_can_use_and_touches_only_the_scratch_block(heads, kv_heads, sinks,
                                                                                         window):
    """The start-up warm-up compiles each (BLOCK_M, split) variant once: the set it launches must cover every
    plan of mixed decode/prefill batches, and it may read and write only the scratch block (the K/V write
    kernel is compiled by writing zeros there)."""
    bs, head_dim, num_blocks = 16, 16, 12
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn((num_blocks + 1, bs, kv_heads, head_dim), generator=gen).to(DEVICE)
                        for _ in range(2))
    k_cache[num_blocks] = float("nan")  # the scratch block may hold anything: outputs are discarded
    before = k_cache.clone(), v_cache.clone()
    attention = TritonPagedAttention(heads, num_kv_heads=kv_heads, num_sms=8)
    launched = attention.warm_up(k_cache, v_cache, block_size=bs, sinks=sinks, window=window,
                                 sink_blocks=-(-sinks // bs), block=num_blocks, dtype=torch.float32)
    assert {split for _, split, _ in launched} == {False, True} and len({bm for bm, _, _ in launched}) == 2
    assert {stages for _, _, stages in launched} == {2, 3}
    if DEVICE == "cpu":   # the interpreter compiles nothing, so no register count can ask for a cap
        assert attention.options["max_registers"] is None
    for a, b in zip(before, (k_cache, v_cache)):
        assert torch.equal(a[:num_blocks], b[:num_blocks])
        assert (b[num_blocks, 0] == 0).all()
    # Whatever a forward's batch looks like, its launches are variants the warm-up compiled.
    seen = set()
    for seed in range(12):
        rng = torch.Generator().manual_seed(seed)
        seqs = []
        for _ in range(int(torch.randint(1, 6, (1,), generator=rng))):
            qlen = int(torch.randint(1, 40, (1,), generator=rng)) if torch.rand(1, generator=rng) < 0.5 else 1
            seqs.append((qlen + int(torch.randint(0, 400, (1,), generator=rng)), qlen))
        meta, *_ = build_case(seqs, sinks, window, bs, heads=heads, kv_heads=kv_heads)
        # The H200's rule; one that splits whenever the tiles allow; one SM, where a decode launch of a few
        # programs is single-buffered.
        for target, sms in ((None, 132), (10_000, 132), (None, 1)):
            plan = plan_triton(meta, heads, kv_heads, target_programs=target, num_sms=sms)
            seen |= {(ln.block_m, ln.num_splits > 1, launch_stages(plan, ln, head_dim)) for ln in plan.launches}
    assert seen <= launched
    if window is None:  # long contexts: every variant occurs (a 32-token window never has tiles to split)
        assert seen == launched


def _timelines(plan, kv_heads, device):
    return [torch.full((ln.num_splits, ln.num_items, kv_heads, 6), -1, dtype=torch.int64, device=device)
            for ln in plan.launches]


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's refusal; the GPU test below fills them")
def test_launch_timelines_are_refused_where_there_are_no_gpu_clocks():
    seqs, sinks, window = [(300, 1), (60, 20)], 16, 64
    meta, query, k_cache, v_cache, _ = _case(seqs, sinks, window, 16)
    plan = plan_triton(meta, 4, 2)
    with pytest.raises(ValueError, match="need compiled kernels on a CUDA device"):
        paged_attention_triton(query, k_cache, v_cache, meta, plan=plan, timelines=_timelines(plan, 2, "cpu"))


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (GPU clocks)")
@pytest.mark.parametrize("decode_block_n", [None, 32])
def test_launch_timelines_record_every_program_and_leave_the_output_unchanged(decode_block_n):
    """Each program reads the tiles of its launch's width (with ``decode_block_n``, the decode launch's)."""
    seqs, sinks, window = [(1100, 1)] * 5 + [(300, 1), (41, 41), (260, 50)], 16, 64
    meta, query, k_cache, v_cache, dense = _case(seqs, sinks, window, 16, heads=8, kv_heads=2,
                                                 dtype=torch.bfloat16, seed=4)
    # 12 and 14 programs for 32 SMs: both launches split
    plan = plan_triton(meta, 8, 2, num_sms=32, block_n=16, decode_block_n=decode_block_n)
    assert any(ln.num_splits > 1 for ln in plan.launches)
    plain = torch.full_like(query, float("nan"))
    paged_attention_triton(query, k_cache, v_cache, meta, plan=plan, out=plain)
    probed = torch.full_like(query, float("nan"))
    timelines = _timelines(plan, 2, DEVICE)
    capped = dataclasses.replace(plan, max_registers=128)     # the probe under a register cap
    paged_attention_triton(query, k_cache, v_cache, meta, plan=capped, out=probed, timelines=timelines)
    assert torch.equal(plain, probed)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for ln, rows in zip(plan.launches, timelines):
        rows = rows.view(-1, 6).cpu()
        assert (rows[:, 0] >= 0).all() and (rows[:, 0] < sms).all()          # every program wrote its SM
        assert (rows[:, 2] >= rows[:, 1]).all() and (rows[:, 4] > rows[:, 3]).all()   # ends after it starts
        items = ln.items.cpu().tolist()
        per_item = [live_tiles(t0, n_q, sinks, window, ln.block_n) for _, _, n_q, t0 in items]
        tiles = rows[:, 5].view(ln.num_splits, ln.num_items, 2).sum(0)       # the splits share the tiles
        assert tiles.tolist() == [[n, n] for n in per_item]
    with pytest.raises(ValueError, match="one int64"):
        paged_attention_triton(query, k_cache, v_cache, meta, plan=plan, timelines=timelines[:1])


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (compiled register counts)")
def test_warm_up_caps_crowded_decode_registers_only_where_ptxas_takes_more():
    """Qwen3-30B-A3B's 32/4 x 128 decode: ptxas gives the crowded (single-buffered) kernel 150 registers with
    Triton 3.6 (3 programs per SM where the launch rule wants 4). After the warm-up, plans cap it, and the output
    stays the function it was."""
    heads, kv_heads, head_dim, bs = 32, 4, 128, 16
    scratch = [torch.randn((4, bs, kv_heads, head_dim), device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    attention = TritonPagedAttention(heads, num_kv_heads=kv_heads)
    attention.warm_up(*scratch, block_size=bs, sinks=16, window=1024, sink_blocks=1, block=3, dtype=torch.bfloat16)
    seqs = [(1100, 1)] * 70                                 # 280 programs, over 2 per SM: single-buffered
    meta, query, k_cache, v_cache, dense = _case(seqs, 16, 1024, bs, heads=heads, kv_heads=kv_heads,
                                                 head_dim=head_dim, dtype=torch.bfloat16, seed=6)
    plan = attention._plan(meta, kv_heads)
    assert [(ln.decode, ln.crowded, ln.num_stages) for ln in plan.launches] == [(True, True, CROWDED_DECODE_STAGES)]
    outs, kernels = [], []
    for p in (plan, dataclasses.replace(plan, max_registers=None)):
        out = torch.full_like(query, float("nan"))
        paged_attention_triton(query, k_cache, v_cache, meta, plan=p, out=out, kernels=kernels)
        outs.append(out)
    planned, uncapped = (k.n_regs for k in kernels)
    assert planned <= SINGLE_BUFFERED_MAX_REGISTERS
    expected_cap = SINGLE_BUFFERED_MAX_REGISTERS if uncapped > SINGLE_BUFFERED_MAX_REGISTERS else None
    assert attention.options["max_registers"] == expected_cap and plan.max_registers == expected_cap
    _check(outs[0], meta, query, k_cache, v_cache, dense, seqs, 16, 1024)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=["float32", "bfloat16", "e4m3"])
def test_kv_write_kernel_stores_what_the_torch_scatter_stores(cache_dtype):
    """The one-launch K/V write against ``metadata.write_kv`` (torch's scatter, ``to_e4m3`` for E4M3): the same
    bytes in every slot, from keys and values that are column slices of one fused projection's output (rows
    not contiguous), E4M3 values past the scale saturating, and no other slot touched."""
    from metronome.attention.metadata import write_kv
    from metronome.attention.triton_paged import write_kv_triton

    tokens, kv_heads, head_dim, blocks, bs = 7, 3, 16, 5, 4
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    key = qkv[:, 4 * head_dim:(4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, (4 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    kv_scale = None
    if cache_dtype == torch.float8_e4m3fn:
        kv_scale = torch.tensor([[0.01, 0.02, 0.03], [0.015, 0.004, 0.02]], device=DEVICE)
        key[0, 1, 0] = 1e4   # 448 x its scale at most
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens].to(DEVICE)
    caches = [[torch.randn(blocks, bs, kv_heads, head_dim, generator=gen).to(DEVICE, cache_dtype)
               for _ in range(2)] for _ in range(2)]
    caches[1] = [c.clone() for c in caches[0]]
    write_kv(key, value, *caches[0], slots, kv_scale)
    write_kv_triton(key, value, *caches[1], slots, kv_scale)
    for want, got in zip(*caches):
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    if kv_scale is not None:
        assert caches[1][0].view(-1, kv_heads, head_dim)[slots[0], 1, 0].float() == 448
    with pytest.raises(ValueError, match="scales"):
        write_kv_triton(key, value, *caches[1], slots, None if kv_scale is not None else torch.ones(2, kv_heads))
