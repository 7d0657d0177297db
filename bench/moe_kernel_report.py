"""What the compiler makes of the grouped MoE GEMM's two kernels for a GPU, on a machine without one.

    python bench/moe_kernel_report.py                          # Qwen3-Omni's layer, E4M3 experts and rows, sm_90
    python bench/moe_kernel_report.py --tokens 224,320,6272 --out moe_kernel_report.json
    python bench/moe_kernel_report.py --tokens 64,224 --untransposed --out moe_kernel_report_untransposed.json

Compiles ``_gate_up_act`` and ``_down`` (``models/moe_triton.py``) ahead of time, specialised as a launch
specialises them (``kernel_report.launch_signature``), with the tiles ``choose_launch`` picks for T tokens at
Qwen3-Omni's layer shape (H = 2048, I = 768, E = 128, k = 8), E4M3 weights with a scale per output channel and E4M3
activation rows (what ``grouped_moe`` runs on a GPU with FP8 tensor cores), and reports each kernel's registers,
shared memory and reduction loop in SASS: its tensor-core instruction (``HMMA``: the warp-level MMA on 16-bit
operands; ``QGMMA``: Hopper's warpgroup MMA on E4M3), how many ``F2FP`` conversions widen E4M3 operands in the loop,
the loop's size, and whether the tiles multiply transposed (decode tiles do). No device time: Triton's wheel
carries ptxas and nvdisasm. ``kernel_report.py`` does the same for the attention kernel; run this one as a script or
a subprocess, not inside a process that interprets kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kernel_report import disassemble, launch_signature, main_loop, resource_usage   # beside this script

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8   # Qwen3-Omni-30B-A3B's thinker layer


@dataclass
class KernelReport:
    tokens: int
    kernel: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    registers: int
    stack_bytes: int             # > 0: ptxas spilled registers
    shared_bytes: int
    loop_instructions: int
    loop_mma: dict[str, int]     # tensor-core instructions in the reduction loop, by opcode
    loop_widenings: int          # F2FP in the loop: E4M3 operands converted to 16-bit before the MMA
    transposed: bool             # the weight tile as the MMA's tall operand (moe_triton.multiplies_transposed)


def compile_kernel(kernel: str, block_m: int, tiles, arch: int, transposed: bool):
    """One of the two kernels as ``grouped_moe`` launches it over E4M3 experts and E4M3 rows (``transposed``: the
    weight tile as the MMA's tall operand)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from metronome.models import moe_triton as mt

    routing = {name: "*i32" for name in ("order_ptr", "start_ptr", "count_ptr", "tile_expert_ptr", "tile_start_ptr")}
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_F32=False,
                      SCALE=mt.CHANNEL_SCALE, GROUP_K=1, ROW_SCALE=True, TRANSPOSED=transposed)
    if kernel == "gate_up":
        fn = mt._gate_up_act
        pointers = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "act_ptr": "*bf16", "s_ptr": "*fp32",
                    "x_scale_ptr": "*fp32", **routing}
        ints = dict(H=HIDDEN, I=INTER, TOPK=TOP_K, NUM_EXPERTS=EXPERTS, stride_x=HIDDEN, stride_we=2 * INTER * HIDDEN,
                    stride_wn=HIDDEN, stride_act=INTER, stride_se=2 * INTER, stride_sn=1)
    else:
        fn = mt._down
        pointers = {"act_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "out_ptr": "*fp32", "weight_ptr": "*bf16",
                    "s_ptr": "*fp32", "act_scale_ptr": "*fp32", **routing}
        ints = dict(H=HIDDEN, I=INTER, NUM_EXPERTS=EXPERTS, stride_act=INTER, stride_we=HIDDEN * INTER,
                    stride_wn=INTER, stride_out=HIDDEN, stride_se=HIDDEN, stride_sn=1)
    source = ASTSource(fn, *launch_signature(fn, pointers, ints, constexprs))
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})


def report(tokens: int, kernel: str, workdir: Path, arch: int = 90, untransposed: bool = False) -> KernelReport:
    """One kernel with the engine's tiles for ``tokens``; ``untransposed``: every tile multiplied untransposed."""
    from metronome.attention.fp8 import E4M3
    from metronome.models.moe_triton import choose_launch, multiplies_transposed

    hopper = arch // 10 == 9   # the warpgroup MMA (fp8.warpgroup_mma_available)
    launch = choose_launch(tokens * TOP_K, EXPERTS, itemsize=1, warpgroup_mma=hopper)
    tiles = launch.gate_up if kernel == "gate_up" else launch.down
    transposed = not untransposed and hopper and multiplies_transposed(E4M3, launch.block_m, tiles)
    compiled = compile_kernel(kernel, launch.block_m, tiles, arch, transposed)
    instructions, opcodes, _ = main_loop(disassemble(compiled.asm["cubin"], workdir))
    resources = resource_usage(compiled.asm["cubin"], workdir)
    return KernelReport(tokens, kernel, launch.block_m, tiles.block_n, tiles.block_k, tiles.num_warps,
                        tiles.num_stages, resources["REG"], resources.get("STACK", 0),
                        int(compiled.metadata.shared), instructions,
                        {op: n for op, n in opcodes.items() if "MMA" in op}, opcodes.get("F2FP", 0), transposed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="64,224,320,6272,8960",
                   help="tokens a forward (decode rounds at 64, 224 and 320 sessions, prefills at 28 rows a session)")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    p.add_argument("--untransposed", action="store_true",
                   help="compile the decode tiles untransposed too (the form that widens E4M3 operands to fp16)")
    p.add_argument("--out", default="results/moe_kernel_report.json", help="raw report (JSON)")
    args = p.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    import triton

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in (int(t) for t in args.tokens.split(",") if t):
            for kernel in ("gate_up", "down"):
                print(f"compiling {kernel} for T = {tokens}, sm_{args.arch} ...", file=sys.stderr, flush=True)
                rows.append(report(tokens, kernel, Path(tmp), args.arch, args.untransposed))
    print(f"\nTriton {triton.__version__}, sm_{args.arch}, H = {HIDDEN}, I = {INTER}, E = {EXPERTS}, k = {TOP_K}, "
          "E4M3 experts and rows")
    print(f"{'T':>6} {'kernel':<8} {'M x N x K':>13} {'warps':>5} {'stages':>6} {'regs':>5} {'spill B':>7} "
          f"{'smem KB':>8} {'loop instrs':>11} {'loop MMA':<20} {'widenings':>9} {'transposed':>10}")
    for r in rows:
        mma = ", ".join(f"{op} {n}" for op, n in r.loop_mma.items()) or "-"
        print(f"{r.tokens:>6} {r.kernel:<8} {f'{r.block_m}x{r.block_n}x{r.block_k}':>13} {r.num_warps:>5} "
              f"{r.num_stages:>6} {r.registers:>5} {r.stack_bytes:>7} {r.shared_bytes / 1024:>8.1f} "
              f"{r.loop_instructions:>11} "
              f"{mma:<20} {r.loop_widenings:>9} {str(r.transposed):>10}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"triton": triton.__version__, "arch": args.arch,
                                          "shape": dict(hidden=HIDDEN, inter=INTER, experts=EXPERTS, top_k=TOP_K),
                                          "kernels": [asdict(r) for r in rows]}, indent=1))
    print(f"raw report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
