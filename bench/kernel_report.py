"""What the compiler makes of the paged-attention kernel for a GPU, on a machine without one.

    python bench/kernel_report.py --out kernel_report.json          # Qwen2.5-7B 28/4x128, sm_90, 132 SMs
    python bench/kernel_report.py --model qwen3-30b-a3b --sessions 16,64,128,256,512
    python bench/kernel_report.py --model qwen3-8b --kv-cache-dtype fp8   # E4M3 pages: "byte LDS" in the loop

Figures: docs/benchmarks/gpu.md (kernel as compiled for sm_90); raw: docs/benchmarks/raw/kernel_report.json
(Triton 3.6) and docs/benchmarks/raw/kernel_report_triton3.9.json.

Compiles ``_paged_attn_fwd`` ahead of time for a CUDA target (default sm_90, the H200) with the specialisation
an engine launch gets at a model's shape, and reports for each launch variant the compiler's resource report
(shared memory, registers, spills), how many K/V tiles the software pipeliner keeps buffered and how
many it leaves in flight during a tile's math, the main loop's size in SASS, and from those how many programs
fit on one SM, so how many waves a decode launch of N sessions takes under the engine's launch rule. No device
time: Triton's wheel carries ptxas and cuobjdump. With Triton 3.6 it prints::

    variant                      BLOCK_M stages  smem KB  regs  local  K/V bufs  in flight  loop instrs  per SM
    decode                            16      3     70.0   117      0       2/2          2          585       3
    decode-1buf                       16      2     38.0   117      0       1/1          0          573       4
    ...
    N     programs  splits  stages  per SM fit  waves
    64         256       1       3           3      1
    128        512       1       2           4      1

``in flight`` is the ``num`` of the loop's ``async_wait``: commit groups (one K and one V copy per tile) still
outstanding while a tile is used, so ``2`` = one more tile's K and V. Per SM uses the sm_90 limits
(228 KB shared memory with 1 KB reserved per block, 64 K registers in 256-register warp units, 64 warps).

``main`` sets ``TRITON_INTERPRET=0`` before Triton is imported (the interpreter has no compiler): run it as a
script or a subprocess, not inside a process that already interprets kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

MODELS = {"smollm2-135m": (9, 3, 64), "qwen2.5-7b": (28, 4, 128), "qwen3-30b-a3b": (32, 4, 128),
          "qwen3-8b": (32, 8, 128)}

# sm_90 occupancy limits (CUDA programming guide, compute capability 9.0).
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_BLOCK = 1024
REGS_PER_SM = 64 * 1024
REG_ALLOC_UNIT = 256           # registers are allocated per warp in units of 256
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32


@dataclass(frozen=True)
class Variant:
    """One compiled form of ``_paged_attn_fwd``: what the engine's launches choose between."""

    name: str
    block_m: int
    num_stages: int
    split: bool = False
    num_warps: int = 4
    timeline: bool = False     # the launch-timeline probe compiled in (TIMELINE)
    maxnreg: int | None = None  # ptxas register cap per thread (None: ptxas chooses)


VARIANTS = (
    Variant("decode", 16, 3),
    Variant("decode-1buf", 16, 2),
    Variant("decode-split", 16, 3, split=True),
    Variant("prefill", 64, 3),
    Variant("decode-timeline", 16, 3, timeline=True),
    Variant("decode-1buf-timeline", 16, 2, timeline=True),
    Variant("decode-1buf-128reg", 16, 2, maxnreg=128),
    Variant("decode-1buf-timeline-128reg", 16, 2, timeline=True, maxnreg=128),
    Variant("decode-128reg", 16, 3, maxnreg=128),
    Variant("decode-4stage-128reg", 16, 4, maxnreg=128),
)


@dataclass
class Report:
    variant: str
    block_m: int
    num_stages: int
    split: bool
    num_warps: int
    shared_bytes: int            # dynamic shared memory Triton asks for at launch
    static_shared_bytes: int
    registers: int
    stack_bytes: int             # > 0: ptxas spilled registers (to the stack frame, in local memory)
    spill_instructions: int      # STL / LDL in the whole kernel's SASS
    kv_buffers: list[int]        # leading dimension of each mutable shared-memory K/V buffer
    loop_wait_groups: list[int]  # ``num`` of the async_wait in the main loop (groups left in flight)
    loop_instructions: int       # SASS instructions in the main (tile) loop's body
    loop_opcodes: dict[str, int]
    programs_per_sm: int
    loop_shared_byte_loads: int  # LDS.U8 / LDS.S8 in the main loop: an operand gathered from shared memory bytewise


def _nvidia_tool(name: str) -> str:
    import triton.backends.nvidia as nv

    path = Path(nv.__file__).parent / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this Triton wheel ships no {name}")
    return str(path)


def compile_variant(v: Variant, *, heads: int, kv_heads: int, head_dim: int, block_n: int = 64,
                    block_size: int = 16, sinks: int = 16, window: int = 1024, arch: int = 90, kv_fp8: bool = False,
                    widen_values: bool | None = None):
    """The kernel as a launch of the engine compiles it: pointers 16-byte aligned, ints specialised on
    divisibility by 16 (or == 1) except ``num_splits`` and ``stride_bt``, as ``do_not_specialize`` says, and
    32-bit cache offsets (``KV_I64`` is for one layer's cache past 2**31 elements: 262,144 blocks at the 7B
    shape, more than an H200 holds). ``kv_fp8``: E4M3 pages under bf16 queries, the values widened where loaded
    as the engine's rule says for this shape (``widen_values`` True or False overrides it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import torch

    from metronome.attention import triton_paged as tp

    fn = tp._paged_attn_fwd
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError("the kernel was imported under TRITON_INTERPRET=1; run this module on its own")
    g = heads // kv_heads
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    partial = "*fp32" if v.split else "*bf16"
    cache = "*fp8e4nv" if kv_fp8 else "*bf16"
    pointers = {"Q": "*bf16", "K": cache, "V": cache, "O": "*bf16", "BT": "*i32", "WF": "*i64",
                "ITEMS": "*i32", "LSE_P": partial, "O_P": partial, "TIMES": "*i64" if v.timeline else "*i32",
                "KV_SCALE": "*fp32"}
    qkv_width = (heads + 2 * kv_heads) * head_dim   # q is a view into the fused qkv projection
    ints = dict(stride_qt=qkv_width, stride_qh=head_dim, stride_ot=heads * head_dim, stride_oh=head_dim,
                stride_kb=block_size * kv_heads * head_dim, stride_ks=kv_heads * head_dim, stride_kh=head_dim,
                stride_vb=block_size * kv_heads * head_dim, stride_vs=kv_heads * head_dim, stride_vh=head_dim,
                stride_bt=70, sinks=sinks, window=window, sink_blocks=-(-sinks // block_size), num_splits=1)
    not_specialised = {"num_splits", "stride_bt"}
    constexprs = dict(G=g, BLOCK_M=v.block_m, BLOCK_N=block_n, BLOCK_D=block_d, HEAD_D=head_dim,
                      BLOCK_SIZE=block_size, HAS_WINDOW=True, SPLIT=v.split, KV_I64=False, DOT_F32=False,
                      IEEE=False, TIMELINE=v.timeline, KV_FP8=kv_fp8,
                      WIDEN_V_AT_LOAD=(tp.widen_values_at_load(kv_fp8, True, torch.bfloat16, g)
                                       if widen_values is None else kv_fp8 and widen_values))
    source = ASTSource(fn, *launch_signature(fn, pointers, ints, constexprs, floats={"qk_scale"},
                                             not_specialised=not_specialised))
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": v.num_warps, "num_stages": v.num_stages,
                                   **({"maxnreg": v.maxnreg} if v.maxnreg else {})})


def launch_signature(fn, pointers: dict[str, str], ints: dict[str, int], constexprs: dict, *,
                     floats: set[str] = frozenset(),
                     not_specialised: set[str] = frozenset()) -> tuple[dict, dict, dict]:
    """Triton's ahead-of-time signature, constants and attributes of ``fn`` as a launch specialises it: pointers
    16-byte aligned; ints == 1 made constants and ints divisible by 16 marked so, except ``not_specialised``
    (``do_not_specialize``); ``floats`` fp32 scalars."""
    signature, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            signature[name] = "fp32"
        elif name in ints:
            value = ints[name]
            if value == 1 and name not in not_specialised:
                signature[name], consts[name] = "constexpr", 1
            else:
                signature[name] = "i32"
                if value % 16 == 0 and name not in not_specialised:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in constexprs:
            signature[name], consts[name] = "constexpr", constexprs[name]
        else:
            raise KeyError(f"kernel argument {name!r} of {fn.__name__} is new: teach the report its type")
    return signature, consts, attrs


def resource_usage(cubin: bytes, workdir: Path) -> dict[str, int]:
    """``cuobjdump -res-usage`` of the kernel: REG, SHARED (static), LOCAL, STACK (spilled registers live in the
    stack frame, not under LOCAL)."""
    path = workdir / "kernel.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", str(path)], check=True, capture_output=True,
                          text=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}


def disassemble(cubin: bytes, workdir: Path) -> list[str]:
    path = workdir / "kernel.cubin"
    path.write_bytes(cubin)
    return subprocess.run([_nvidia_tool("nvdisasm"), "-c", str(path)], check=True, capture_output=True,
                          text=True).stdout.splitlines()


def opcode(line: str) -> str | None:
    m = re.match(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)", line)
    return m.group(1) if m else None


def main_loop(sass: list[str]) -> tuple[int, dict[str, int], int]:
    """Size, opcode counts and one-byte shared-memory loads of the SASS loop holding the tensor-core
    instructions (the tile loop)."""
    labels = {m.group(1): i for i, ln in enumerate(sass) if (m := re.match(r"^(\.L_x_\d+):", ln))}
    best: list[str] = []
    for i, ln in enumerate(sass):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ln)
        if m and labels.get(m.group(1), i) < i:          # a backward branch closes a loop
            body = sass[labels[m.group(1)]:i + 1]
            if any(re.search(r"\b[HQ]G?MMA\b", b) for b in body) and len(body) > len(best):
                best = body
    opcodes: dict[str, int] = {}
    for ln in best:
        if op := opcode(ln):
            opcodes[op] = opcodes.get(op, 0) + 1
    byte_loads = sum(bool(re.search(r"\bLDS\.[US]8\b", ln)) for ln in best)
    return sum(opcodes.values()), dict(sorted(opcodes.items(), key=lambda kv: -kv[1])), byte_loads


def programs_per_sm(shared: int, static_shared: int, registers: int, num_warps: int) -> int:
    """Resident programs per SM under the sm_90 limits (shared memory, registers, warps, blocks)."""
    by_smem = SMEM_PER_SM // (shared + static_shared + SMEM_RESERVED_PER_BLOCK)
    regs_per_warp = math.ceil(registers * 32 / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = REGS_PER_SM // (regs_per_warp * num_warps)
    return max(0, min(by_smem, by_regs, MAX_WARPS_PER_SM // num_warps, MAX_BLOCKS_PER_SM))


def report(v: Variant, workdir: Path, **shape) -> Report:
    kernel = compile_variant(v, **shape)
    ttgir = kernel.asm["ttgir"]
    buffers = [int(n) for n in re.findall(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)]
    loop = ttgir[ttgir.index("scf.for"):] if "scf.for" in ttgir else ""
    waits = [int(n) for n in re.findall(r"ttg\.async_wait [^{]*\{num = (\d+)", loop.split("scf.yield")[0])]
    res = resource_usage(kernel.asm["cubin"], workdir)
    sass = disassemble(kernel.asm["cubin"], workdir)
    instructions, opcodes, byte_loads = main_loop(sass)
    spills = sum(opcode(ln) in ("STL", "LDL") for ln in sass)
    shared = int(kernel.metadata.shared)
    return Report(v.name, v.block_m, v.num_stages, v.split, v.num_warps, shared, res.get("SHARED", 0),
                  res["REG"], res.get("STACK", 0), spills, buffers, waits, instructions, opcodes,
                  programs_per_sm(shared, res.get("SHARED", 0), res["REG"], v.num_warps), byte_loads)


def decode_waves(reports: dict[str, Report], sessions: list[int], *, kv_heads: int, sinks: int, window: int,
                 block_n: int, num_sms: int, kv_fp8: bool = False) -> list[dict]:
    """The engine's launch rule at each N (splits, stages; E4M3 pages' crowded stages with ``kv_fp8``) and the waves
    that takes with these resources (a crowded launch capped at 128 registers where the warm-up would cap it)."""
    import torch

    from metronome.attention import triton_paged as tp

    tiles = tp.live_tiles(4096, 1, sinks, window, block_n)
    rows = []
    for n in sessions:
        programs = n * kv_heads
        splits = tp.choose_splits(programs, tiles, target_programs=tp.PROGRAMS_PER_SM * num_sms)
        stages = tp.choose_stages(programs * splits, num_sms, decode=True, crowded_stages=tp.crowded_stages_for(
            torch.float8_e4m3fn if kv_fp8 else torch.bfloat16))
        name = "decode-split" if splits > 1 else ("decode" if stages == 3 else "decode-1buf")
        if (tp.crowded(programs * splits, num_sms, decode=True) and f"{name}-128reg" in reports and name in reports
                and reports[name].registers > tp.SINGLE_BUFFERED_MAX_REGISTERS):   # the warm-up's cap
            name = f"{name}-128reg"
        fit = reports[name].programs_per_sm if name in reports else 0
        rows.append({"sessions": n, "programs": programs * splits, "splits": splits, "stages": stages,
                     "variant": name, "programs_per_sm_fit": fit,
                     "waves": math.ceil(programs * splits / (fit * num_sms)) if fit else None})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=type(
        "Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--model", default="qwen2.5-7b", choices=sorted(MODELS), help="attention shape")
    p.add_argument("--variants", default=",".join(v.name for v in VARIANTS),
                   help=f"comma list of {[v.name for v in VARIANTS]}")
    p.add_argument("--sessions", default="16,64,128,256,512", help="decode sizes for the waves table")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    p.add_argument("--num-sms", type=int, default=132, help="SMs of the target GPU (H200: 132)")
    p.add_argument("--sinks", type=int, default=16, help="SinkWindow sinks S")
    p.add_argument("--window", type=int, default=1024, help="SinkWindow window W")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="the pages' element type: bf16 (auto) or E4M3 (fp8)")
    p.add_argument("--widen-values", choices=["auto", "on", "off"], default="auto",
                   help="E4M3 pages: widen the values where loaded as the engine's rule says (auto), always or never")
    p.add_argument("--out", default="results/kernel_report.json", help="raw report (JSON)")
    args = p.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    import tempfile

    import triton

    heads, kv_heads, head_dim = MODELS[args.model]
    wanted = args.variants.split(",")
    unknown = set(wanted) - {v.name for v in VARIANTS}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}")
    shape = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, sinks=args.sinks, window=args.window,
                 kv_fp8=args.kv_cache_dtype == "fp8", arch=args.arch,
                 widen_values={"auto": None, "on": True, "off": False}[args.widen_values])
    reports: dict[str, Report] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in VARIANTS:
            if v.name in wanted:
                print(f"compiling {v.name} for sm_{args.arch} ...", file=sys.stderr, flush=True)
                reports[v.name] = report(v, Path(tmp), **shape)
    waves = decode_waves(reports, [int(n) for n in args.sessions.split(",") if n], kv_heads=kv_heads,
                         sinks=args.sinks, window=args.window, block_n=64, num_sms=args.num_sms,
                         kv_fp8=args.kv_cache_dtype == "fp8")
    print(f"\nTriton {triton.__version__}, sm_{args.arch}, {args.model} {heads}/{kv_heads}x{head_dim}, "
          f"S = {args.sinks}, W = {args.window}, pages {'E4M3' if args.kv_cache_dtype == 'fp8' else 'bf16'}")
    print(f"{'variant':<28} {'BLOCK_M':>7} {'stages':>6} {'smem KB':>8} {'regs':>5} {'spill B':>7} "
          f"{'K/V bufs':>9} {'in flight':>10} {'loop instrs':>12} {'byte LDS':>9} {'per SM':>7}")
    for r in reports.values():
        bufs = "/".join(map(str, r.kv_buffers)) or "-"
        waits = "/".join(map(str, r.loop_wait_groups)) or "-"
        print(f"{r.variant:<28} {r.block_m:>7} {r.num_stages:>6} {r.shared_bytes / 1024:>8.1f} {r.registers:>5} "
              f"{r.stack_bytes:>7} {bufs:>9} {waits:>10} {r.loop_instructions:>12} {r.loop_shared_byte_loads:>9} "
              f"{r.programs_per_sm:>7}")
    print(f"\n{'N':<5} {'programs':>8} {'splits':>7} {'stages':>7} {'per SM fit':>11} {'waves':>6}")
    for w in waves:
        print(f"{w['sessions']:<5} {w['programs']:>8} {w['splits']:>7} {w['stages']:>7} "
              f"{w['programs_per_sm_fit']:>11} {str(w['waves']):>6}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "triton": triton.__version__, "arch": args.arch, "model": args.model, "num_sms": args.num_sms,
        "sinks": args.sinks, "window": args.window, "kv_cache_dtype": args.kv_cache_dtype,
        "widen_values": args.widen_values, "variants": [asdict(r) for r in reports.values()],
        "decode_waves": waves}, indent=1))
    print(f"raw report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
