"""The attention kernel as the compiler builds it for an H200 (sm_90), checked on a machine without a GPU.

The decode loop's pipelining is a property of the compiled code, not of its results: loading each tile's block
ids in the same iteration as its K/V once made Triton single-buffer K/V at ``num_stages=3``, which left every
tile's load latency exposed (docs/benchmarks/gpu.md, launch rule) while every numerical test still passed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kernel_report import programs_per_sm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sm90_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernel_report") / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_report.py"), "--sessions", "64,128",
                    "--out", str(out)], check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    return report, {v["variant"]: v for v in report["variants"]}


def _fp8_report(tmp_path_factory, widen: str):
    out = tmp_path_factory.mktemp("kernel_report_fp8") / f"{widen}.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_report.py"), "--model", "qwen3-8b", "--kv-cache-dtype",
                    "fp8", "--widen-values", widen, "--variants", "decode,decode-1buf", "--sessions", "64",
                    "--out", str(out)], check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    return {v["variant"]: v for v in json.loads(out.read_text())["variants"]}


def test_e4m3_values_widened_where_loaded_are_not_gathered_bytewise(tmp_path_factory):
    """Over E4M3 pages the values' cast to fp16, left to Triton, follows their change to the dot's operand layout
    and gathers each tile from shared memory one byte at a time; widened where loaded (``e4m3_to_f16``, what the
    engine's rule picks at Qwen3-8B's 4 query heads a KV head) they are not, and the loop is shorter."""
    widened = _fp8_report(tmp_path_factory, "auto")
    cast = _fp8_report(tmp_path_factory, "off")
    for name in ("decode", "decode-1buf"):
        assert widened[name]["loop_shared_byte_loads"] == 0, name
        assert cast[name]["loop_shared_byte_loads"] > 0, name
        assert widened[name]["loop_instructions"] < cast[name]["loop_instructions"], name
        assert widened[name]["stack_bytes"] == 0 and widened[name]["programs_per_sm"] >= 3, name


def test_double_buffered_decode_keeps_a_second_kv_tile_in_flight_during_the_math(sm90_report):
    _, variants = sm90_report
    decode = variants["decode"]
    assert decode["num_stages"] == 3
    assert decode["kv_buffers"] == [2, 2]                 # K and V, two tiles each
    assert decode["loop_wait_groups"] and min(decode["loop_wait_groups"]) >= 2   # next tile's K and V copies
    single = variants["decode-1buf"]
    assert single["kv_buffers"] == [1, 1] and single["loop_wait_groups"] == [0]
    assert single["shared_bytes"] < decode["shared_bytes"]


def test_a_128_register_cap_fits_four_single_buffered_programs_per_sm(sm90_report):
    _, variants = sm90_report
    for name in ("decode-1buf-128reg", "decode-1buf-timeline-128reg"):
        assert variants[name]["registers"] <= 128 and variants[name]["programs_per_sm"] == 4, name


def test_the_engines_variants_do_not_spill_and_each_fits_on_an_sm(sm90_report):
    _, variants = sm90_report
    for name, v in variants.items():
        assert v["registers"] <= 255 and v["programs_per_sm"] >= 1, name
        tensor_core = v["loop_opcodes"].get("HMMA", 0) + v["loop_opcodes"].get("HGMMA", 0)   # mma.sync, wgmma
        assert v["loop_instructions"] > 0 and tensor_core > 0, name
        if "128reg" not in name:          # a cap below what ptxas wants spills (40 B with Triton 3.6)
            assert v["stack_bytes"] == 0 and v["spill_instructions"] == 0, f"{name} spills registers"


def test_waves_follow_the_engines_launch_rule(sm90_report):
    report, variants = sm90_report
    rows = {r["sessions"]: r for r in report["decode_waves"]}
    from metronome.attention.triton_paged import SINGLE_BUFFERED_MAX_REGISTERS, choose_stages

    for n, row in rows.items():
        assert row["splits"] == 1                          # 64 and 128 sessions fill 132 SMs unsplit
        assert row["stages"] == choose_stages(n * 4, report["num_sms"], decode=True)
    assert rows[64]["variant"] == "decode" and rows[64]["waves"] == 1       # 256 programs, 3 fit per SM
    # crowded: single-buffered, capped at 128 registers where ptxas takes more (as the engine's warm-up caps it)
    capped = variants["decode-1buf"]["registers"] > SINGLE_BUFFERED_MAX_REGISTERS
    assert rows[128]["variant"] == ("decode-1buf-128reg" if capped else "decode-1buf")
    assert rows[128]["waves"] == 1 if capped else rows[128]["waves"] in (1, 2)


def test_programs_per_sm_follows_the_sm90_occupancy_limits():
    # shared memory bound: (70 KB + 1 KB static + 1 KB reserved) x 3 <= 228 KB < x 4
    assert programs_per_sm(71680, 1024, 117, 4) == 3
    # register bound: 117 -> 3,840 a warp (15 units of 256), 4 warps = 15,360; 65,536 // 15,360 = 4
    assert programs_per_sm(38912, 1024, 117, 4) == 4
    # 141 -> 4,608 a warp, 18,432 a program: 3 fit
    assert programs_per_sm(38912, 1024, 141, 4) == 3
    # warps bound: 8 warps of 16 registers, no shared memory: 64 warps // 8 (registers would allow 16)
    assert programs_per_sm(0, 0, 16, 8) == 8
    # a program larger than the SM fits nowhere
    assert programs_per_sm(300 * 1024, 0, 32, 4) == 0
