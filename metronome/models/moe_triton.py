"""Grouped GEMM for a sparse MoE block in Triton: every expert's tokens in one launch per projection.

A decode round of N sessions routes N·k (token, expert) assignments over E experts; with E = 128 and
k = 8 most experts see a handful of rows each. One small matmul per expert would be 128 launches per
layer (and a host sync to learn which experts are used); here the assignments are sorted by expert and
two kernels walk the sorted rows tile by tile, each tile reading its own expert's weights:

1. ``_gate_up_act``: rows of ``x`` gathered by token id × ``w_gate_up[e]`` ([2I, H]) → ``silu(gate)·up``
   ([M, I], in sorted order). Gate and up share the A tile: two fp32 accumulators per program.
2. ``_down``: those rows × ``w_down[e]`` ([H, I]) → scaled by the routing weight, written to the
   assignment's own row of an [M, H] fp32 buffer (no atomics).
3. ``_sum_assignments``: each token's k rows summed in slot order, in the activations' dtype. Deterministic:
   the same input gives the same bits, whatever the routing.

Routing metadata (``route``, ``models/moe_routing_triton.py``) is built in one launch of static shape with no
host synchronisation, so a decode round that uses it can be captured in a CUDA graph: the grid has an upper bound of
``cdiv(M, BLOCK_M) + min(E, M)`` row tiles (each expert's rows are padded to whole tiles); the tiles
past the real ones find the sentinel expert ``E`` and return at once.

FP8 experts (``scales``, ``models/fp8.py``): on a GPU with FP8 tensor cores the activations are quantised too
(each token's input and each assignment's SiLU·up row to E4M3 with a scale of its own, one launch each; the
token's input comes quantised already where the norm before the block wrote its codes, ``x_rows``) and both
products take E4M3 operands (W8A8). Hopper's E4M3 warpgroup MMA takes 64 rows or more: row tiles that tall
(prefill) multiply as they are; on Hopper, shorter ones (decode rounds) multiply transposed where a program has 64
columns or more, the weight tile the tall operand and the rows the narrow one (``multiplies_transposed``); other
GPUs multiply them as they are. Untransposed, such tiles have both operands widened to fp16 for the warp-level
MMA (``bench/moe_kernel_report.py``). Otherwise (and with ``fp8_activations=False``) the E4M3 weight tiles are
converted to the activations' dtype in registers (W8A16); that conversion, not the memory, had held a decode
round's kernels to 2.3–2.7 TB/s. A scale per output channel multiplies the accumulator once after the reduction;
block scales (one per row and group of ``G`` columns) multiply each reduction step's partial product, so every
step must lie in one group (``G % BLOCK_K == 0``).

CPU: the kernels run under ``TRITON_INTERPRET=1`` (tests). The interpreter mishandles bf16 in
``tl.dot`` (see ``attention/triton_paged.py``), so when interpreting the operands are upcast to fp32.
fp32 operands use IEEE fp32 products (``input_precision="ieee"``), not TF32, so float32 models match
their references; bf16 runs on the tensor cores with fp32 accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from metronome.attention.fp8 import E4M3
from metronome.cpu import triton_interpreted
from metronome.models.fp8 import ACTIVATION_AMAX_FLOOR, ExpertScales, scaled_mm_available, warpgroup_mma_available
from metronome.models.fp8_triton import quantize_rows_triton
from metronome.models.moe_routing_triton import Routing, route

# How expert weights are scaled (the kernels' SCALE): float weights, E4M3 per output channel, E4M3 per group.
NO_SCALE, CHANNEL_SCALE, GROUP_SCALE = 0, 1, 2
# The rows of Hopper's warpgroup MMA (one warpgroup's tile): shorter tiles of E4M3 rows multiply transposed.
WARPGROUP_MMA_ROWS = 64


@triton.jit
def _tile_rows(tile_expert_ptr, tile_start_ptr, start_ptr, count_ptr, order_ptr, pid_m, BLOCK_M: tl.constexpr):
    """The expert of this row tile, the tile's rows in sorted order, their assignment ids and a mask."""
    e = tl.load(tile_expert_ptr + pid_m)  # a real expert: the caller returned for the sentinel
    local = (pid_m - tl.load(tile_start_ptr + e)) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = local < tl.load(count_ptr + e)
    sorted_row = tl.load(start_ptr + e) + local
    assign = tl.load(order_ptr + sorted_row, mask=row_mask, other=0)
    return e, sorted_row, assign, row_mask


@triton.jit
def _partial(a, b, acc, scale, DOT_F32: tl.constexpr, SCALE: tl.constexpr):
    """``acc + a @ b`` of one reduction step; ``b`` (float or E4M3) is converted to ``a``'s dtype, and with group
    scales the step's product is scaled per output column first."""
    if DOT_F32:
        a, b = a.to(tl.float32), b.to(tl.float32)
    else:
        b = b.to(a.dtype)
    if SCALE == 2:
        if DOT_F32:
            return acc + tl.dot(a, b, input_precision="ieee") * scale[None, :]
        return acc + tl.dot(a, b) * scale[None, :]
    if DOT_F32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _partial_transposed(w, a, acc_t, scale, DOT_F32: tl.constexpr, SCALE: tl.constexpr):
    """``acc_t + w @ a.T`` of one reduction step, the output transposed ([columns, rows]): the weight tile is the
    MMA's tall operand, so a few rows still fill Hopper's warpgroup MMA; group scales scale each row of ``acc_t``
    (one output column)."""
    if DOT_F32:
        w, a = w.to(tl.float32), a.to(tl.float32)
    if SCALE == 2:
        if DOT_F32:
            return acc_t + tl.dot(w, tl.trans(a), input_precision="ieee") * scale[:, None]
        return acc_t + tl.dot(w, tl.trans(a)) * scale[:, None]
    if DOT_F32:
        return tl.dot(w, tl.trans(a), acc_t, input_precision="ieee")
    return tl.dot(w, tl.trans(a), acc_t)


@triton.jit
def _gate_up_act(x_ptr, w_ptr, act_ptr, order_ptr, start_ptr, count_ptr, tile_expert_ptr, tile_start_ptr, s_ptr,
                 x_scale_ptr, H, I, TOPK, NUM_EXPERTS,
                 stride_x, stride_we, stride_wn, stride_act, stride_se, stride_sn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                 SCALE: tl.constexpr, GROUP_K: tl.constexpr, ROW_SCALE: tl.constexpr, TRANSPOSED: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tl.load(tile_expert_ptr + pid_m) >= NUM_EXPERTS:
        return
    e, sorted_row, assign, row_mask = _tile_rows(tile_expert_ptr, tile_start_ptr, start_ptr, count_ptr,
                                                 order_ptr, pid_m, BLOCK_M)
    token = (assign // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_gate = s_ptr + e.to(tl.int64) * stride_se + offs_n * stride_sn  # this tile's columns' scale rows
    s_up = s_gate + I * stride_sn
    scale_gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    scale_up = scale_gate
    if TRANSPOSED:
        acc_gate_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        a = tl.load(x_ptr + token[:, None] * stride_x + offs_k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if SCALE == 2:
            scale_gate = tl.load(s_gate + k0 // GROUP_K, mask=n_mask, other=0.0)
            scale_up = tl.load(s_up + k0 // GROUP_K, mask=n_mask, other=0.0)
        if TRANSPOSED:    # weight tiles [columns, reduction]
            w_mask = n_mask[:, None] & k_mask[None, :]
            g = tl.load(w_base + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=w_mask, other=0.0)
            u = tl.load(w_base + (offs_n[:, None] + I).to(tl.int64) * stride_wn + offs_k[None, :], mask=w_mask,
                        other=0.0)
            acc_gate_t = _partial_transposed(g, a, acc_gate_t, scale_gate, DOT_F32, SCALE)
            acc_up_t = _partial_transposed(u, a, acc_up_t, scale_up, DOT_F32, SCALE)
        else:
            w_mask = k_mask[:, None] & n_mask[None, :]
            g = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
            u = tl.load(w_base + (offs_n[None, :] + I).to(tl.int64) * stride_wn + offs_k[:, None], mask=w_mask,
                        other=0.0)
            acc_gate = _partial(a, g, acc_gate, scale_gate, DOT_F32, SCALE)
            acc_up = _partial(a, u, acc_up, scale_up, DOT_F32, SCALE)
    if TRANSPOSED:
        acc_gate, acc_up = tl.trans(acc_gate_t), tl.trans(acc_up_t)
    if SCALE == 1:
        acc_gate = acc_gate * tl.load(s_gate, mask=n_mask, other=0.0)[None, :]
        acc_up = acc_up * tl.load(s_up, mask=n_mask, other=0.0)[None, :]
    if ROW_SCALE:   # E4M3 activations: each token's own scale
        x_scale = tl.load(x_scale_ptr + token, mask=row_mask, other=0.0)[:, None]
        acc_gate, acc_up = acc_gate * x_scale, acc_up * x_scale
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out = act_ptr + sorted_row[:, None].to(tl.int64) * stride_act + offs_n[None, :]
    tl.store(out, h.to(act_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down(act_ptr, w_ptr, out_ptr, weight_ptr, order_ptr, start_ptr, count_ptr, tile_expert_ptr, tile_start_ptr, s_ptr,
          act_scale_ptr, H, I, NUM_EXPERTS,
          stride_act, stride_we, stride_wn, stride_out, stride_se, stride_sn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
          SCALE: tl.constexpr, GROUP_K: tl.constexpr, ROW_SCALE: tl.constexpr, TRANSPOSED: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tl.load(tile_expert_ptr + pid_m) >= NUM_EXPERTS:
        return
    e, sorted_row, assign, row_mask = _tile_rows(tile_expert_ptr, tile_start_ptr, start_ptr, count_ptr,
                                                 order_ptr, pid_m, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_rows = s_ptr + e.to(tl.int64) * stride_se + offs_n * stride_sn
    scale = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if TRANSPOSED:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < I
        a = tl.load(act_ptr + sorted_row[:, None].to(tl.int64) * stride_act + offs_k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if SCALE == 2:
            scale = tl.load(s_rows + k0 // GROUP_K, mask=n_mask, other=0.0)
        if TRANSPOSED:    # weight tile [columns, reduction]
            b = tl.load(w_base + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc_t = _partial_transposed(b, a, acc_t, scale, DOT_F32, SCALE)
        else:
            b = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = _partial(a, b, acc, scale, DOT_F32, SCALE)
    if TRANSPOSED:
        acc = tl.trans(acc_t)
    if SCALE == 1:
        acc = acc * tl.load(s_rows, mask=n_mask, other=0.0)[None, :]
    if ROW_SCALE:   # E4M3 activations: each sorted row's own scale
        acc = acc * tl.load(act_scale_ptr + sorted_row, mask=row_mask, other=0.0)[:, None]
    weight = tl.load(weight_ptr + assign, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out = out_ptr + assign[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class TileConfig:
    """One kernel's launch shape: output columns and reduction step per program, warps, pipeline stages."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeLaunch:
    """Both kernels' tiles for one forward; ``block_m`` rows of one expert per program."""

    block_m: int
    gate_up: TileConfig
    down: TileConfig


def choose_launch(num_assignments: int, num_experts: int, itemsize: int = 2, *,
                  warpgroup_mma: bool = False) -> MoeLaunch:
    """Tiles by the mean rows per expert (measured on an H200 at Qwen3-Omni's layer shape, H = 2048,
    I = 768, E = 128, k = 8; ``bench/models_gpu.py --model qwen3_omni --tune-moe``).

    Decode rounds put a few rows on each expert: the kernels stream weights (bf16 at the copy rate in a CUDA
    graph), so 16-row tiles and long reduction steps with deep pipelines. Prefill batches are compute-bound: tall
    row tiles reuse each weight tile (about 430 TFLOP/s at 16k tokens). These are bf16/fp16 tiles;
    4-byte operands (float32 models, tests) take half the reduction step and two stages so a program's
    pipelined tiles still fit in shared memory (227 KiB on Hopper). ``warpgroup_mma``: E4M3 rows multiply on
    Hopper's warpgroup MMA, where prefill tiles take twice the reduction step, 8 warps and 4 stages, and the down
    product 256 columns a program (measured on an H100; gpu.md).
    """
    mean = num_assignments / num_experts
    if mean <= 2:
        launch = MoeLaunch(16, TileConfig(64, 128, 4, 4), TileConfig(128, 128, 4, 4))
    elif mean <= 16:
        launch = MoeLaunch(16, TileConfig(128, 128, 4, 4), TileConfig(128, 128, 4, 3))
    elif mean <= 128:
        launch = MoeLaunch(64, TileConfig(64, 64, 4, 3), TileConfig(128, 64, 8, 3))
    else:
        launch = MoeLaunch(128, TileConfig(128, 64, 8, 3), TileConfig(128, 64, 4, 3))
    if itemsize == 1 and mean <= 128:   # E4M3 weights: a reduction step streams half the bytes (tuned likewise)
        launch = (MoeLaunch(16, TileConfig(64, 256, 4, 3), TileConfig(64, 256, 4, 3)) if mean <= 8 else
                  MoeLaunch(32, TileConfig(64, 128, 4, 3), TileConfig(64, 128, 4, 4)))
    elif itemsize == 1 and warpgroup_mma:   # E4M3 rows and weights: half the bytes a step, so twice the step
        launch = MoeLaunch(128, TileConfig(128, 128, 8, 4), TileConfig(256, 128, 8, 4))
    if itemsize > 2:
        def narrow(c: TileConfig) -> TileConfig:
            return TileConfig(c.block_n, min(c.block_k, 64), c.num_warps, 2)

        launch = MoeLaunch(launch.block_m, narrow(launch.gate_up), narrow(launch.down))
    return launch


def _scale_args(w: torch.Tensor, scale: torch.Tensor | None, group: int, tiles: TileConfig) -> tuple[dict, tuple]:
    """The scale operands of one kernel: its SCALE mode, GROUP_K and a reduction step that fits the groups,
    then (pointer, expert stride, row stride); ``w`` stands in for the pointer of float weights (unused)."""
    if scale is None:
        return dict(SCALE=NO_SCALE, GROUP_K=1, BLOCK_K=tiles.block_k), (w, 0, 0)
    scale = scale.contiguous()
    if scale.shape[-1] == 1:
        return dict(SCALE=CHANNEL_SCALE, GROUP_K=1, BLOCK_K=tiles.block_k), (scale, scale.stride(0), scale.stride(1))
    block_k = min(tiles.block_k, group & -group)  # a power of two that divides the group
    if block_k < 16:
        raise ValueError(f"FP8 scale groups of {group} columns do not split into reduction steps of {block_k}")
    return (dict(SCALE=GROUP_SCALE, GROUP_K=group, BLOCK_K=block_k), (scale, scale.stride(0), scale.stride(1)))


def launch_gate_up(x: torch.Tensor, w_gate_up: torch.Tensor, act: torch.Tensor, routing: Routing, top_k: int,
                   tiles: TileConfig, dot_f32: bool, scale: torch.Tensor | None = None, group: int = 0,
                   x_scale: torch.Tensor | None = None, transposed: bool | None = None) -> None:
    """``act[j] = silu(gate)·up`` of the j-th sorted assignment's token under its expert; ``x`` E4M3 codes with
    ``x_scale`` [T, 1] when given. ``transposed``: the weight tile as the MMA's tall operand; default:
    ``multiplies_transposed``."""
    e, two_i, h = w_gate_up.shape
    inter = two_i // 2
    grid = (routing.tile_expert.numel(), triton.cdiv(inter, tiles.block_n))
    mode, (s, stride_se, stride_sn) = _scale_args(w_gate_up, scale, group, tiles)
    _gate_up_act[grid](
        x, w_gate_up, act, routing.order, routing.start, routing.count, routing.tile_expert, routing.tile_start, s,
        s if x_scale is None else x_scale, h, inter, top_k, e, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        act.stride(0), stride_se, stride_sn,
        BLOCK_M=routing.block_m, BLOCK_N=tiles.block_n, DOT_F32=dot_f32, **mode, ROW_SCALE=x_scale is not None,
        TRANSPOSED=(transposed if transposed is not None
                    else multiplies_transposed(x.dtype, routing.block_m, tiles, x.device)),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def launch_down(act: torch.Tensor, w_down: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, routing: Routing,
                tiles: TileConfig, dot_f32: bool, scale: torch.Tensor | None = None, group: int = 0,
                act_scale: torch.Tensor | None = None, transposed: bool | None = None) -> None:
    """``out[assignment] = weight · down(act)`` (fp32), every assignment in its own row; ``act`` E4M3 codes with
    ``act_scale`` [M, 1] when given. ``transposed``: the weight tile as the MMA's tall operand; default:
    ``multiplies_transposed``."""
    e, h, inter = w_down.shape
    grid = (routing.tile_expert.numel(), triton.cdiv(h, tiles.block_n))
    mode, (s, stride_se, stride_sn) = _scale_args(w_down, scale, group, tiles)
    _down[grid](
        act, w_down, out, weights, routing.order, routing.start, routing.count, routing.tile_expert,
        routing.tile_start, s, s if act_scale is None else act_scale, h, inter, e, act.stride(0), w_down.stride(0),
        w_down.stride(1), out.stride(0),
        stride_se, stride_sn,
        BLOCK_M=routing.block_m, BLOCK_N=tiles.block_n, DOT_F32=dot_f32, **mode, ROW_SCALE=act_scale is not None,
        TRANSPOSED=(transposed if transposed is not None
                    else multiplies_transposed(act.dtype, routing.block_m, tiles, act.device)),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _dot_f32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels multiply in IEEE float32: float32 operands, or the interpreter (which upcasts bf16)."""
    return triton_interpreted() or device.type != "cuda" or dtype == torch.float32


def multiplies_transposed(dtype: torch.dtype, block_m: int, tiles: TileConfig,
                          device: torch.device | None = None) -> bool:
    """Whether a kernel multiplies transposed, the weight tile as the MMA's tall operand: E4M3 rows in row tiles
    too short for Hopper's warpgroup MMA, where the tile's columns fill it. Untransposed, such tiles widen both
    E4M3 operands to fp16 for the warp-level MMA (``bench/moe_kernel_report.py``). A GPU without the warpgroup MMA
    never does: there the form only takes more shared memory. ``device`` None or the CPU (the interpreter runs
    either form): the tile rule alone."""
    hopper = device is None or device.type != "cuda" or warpgroup_mma_available(device)
    return hopper and dtype == E4M3 and block_m < WARPGROUP_MMA_ROWS <= tiles.block_n


def multiplies_e4m3_rows(dtype: torch.dtype, device: torch.device, scales: ExpertScales | None) -> bool:
    """Whether ``grouped_moe`` multiplies rows of ``dtype`` on ``device`` as E4M3 rows unless told otherwise: E4M3
    experts on a GPU with FP8 tensor cores, activations narrower than float32, compiled kernels."""
    return scales is not None and not _dot_f32(dtype, device) and scaled_mm_available(device)


def launch_for(x: torch.Tensor, w_gate_up: torch.Tensor, num_assignments: int, fp8_activations: bool) -> MoeLaunch:
    """The tiles ``grouped_moe`` launches for rows ``x`` over experts ``w_gate_up`` unless told otherwise."""
    # 4-byte activations narrow the tiles; else the weights' bytes choose them (E4M3 experts: 1).
    itemsize = x.element_size() if x.element_size() > 2 else w_gate_up.element_size()
    return choose_launch(num_assignments, w_gate_up.shape[0], itemsize,
                         warpgroup_mma=fp8_activations and warpgroup_mma_available(x.device))


def grouped_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, *, launch: MoeLaunch | None = None,
                block_m: int | None = None, scales: ExpertScales | None = None,
                fp8_activations: bool | None = None,
                x_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``sum_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t])`` for every token ``t``.

    ``x`` [T, H]; ``w_gate_up`` [E, 2I, H] (gate rows first, then up); ``w_down`` [E, H, I];
    ``topk_ids`` [T, k] (int); ``topk_weights`` [T, k]. Returns [T, H] in ``x``'s dtype. ``launch``
    overrides the tiles ``choose_launch`` picks (``block_m`` only their row height). ``scales``: the weights
    are E4M3 codes with these scales. ``fp8_activations``: quantise each token's input and each assignment's
    SiLU·up row to E4M3 (one scale per row) and multiply E4M3 operands (which tiles reach the FP8 MMA: above); default:
    ``multiplies_e4m3_rows``. ``x_rows``: ``x``'s E4M3 codes [T, H] and row scales [T, 1] as ``quantize_rows``
    makes them, where the kernel that wrote ``x`` made them too (E4M3 activations only).
    """
    t, h = x.shape
    e, two_i, h_w = w_gate_up.shape
    inter = two_i // 2
    if h_w != h or tuple(w_down.shape) != (e, h, inter):
        raise ValueError(f"expert weights {tuple(w_gate_up.shape)} / {tuple(w_down.shape)} do not fit hidden {h}")
    k = topk_ids.shape[1]
    m = t * k
    if t == 0:
        return x.new_zeros((0, h))
    if fp8_activations is None:
        fp8_activations = multiplies_e4m3_rows(x.dtype, x.device, scales)
    if fp8_activations and scales is None:
        raise ValueError("E4M3 activations need E4M3 experts (scales)")
    launch = launch or launch_for(x, w_gate_up, m, fp8_activations)
    if block_m is not None:
        launch = MoeLaunch(block_m, launch.gate_up, launch.down)
    x = x.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    routing = route(topk_ids, e, launch.block_m)
    act = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((m, h), dtype=torch.float32, device=x.device)
    # fp32 operands multiply in IEEE fp32 (not TF32), as do the interpreter's upcast bf16 operands.
    dot_f32 = _dot_f32(x.dtype, x.device)
    gate_up_scale = (scales.gate_up, scales.gate_up_group) if scales is not None else (None, 0)
    down_scale = (scales.down, scales.down_group) if scales is not None else (None, 0)
    if x_rows is not None:
        codes, row_scale = x_rows
        if not fp8_activations:
            raise ValueError("x_rows: E4M3 rows multiply only with E4M3 activations")
        if (codes.shape != x.shape or codes.dtype != E4M3 or codes.stride(-1) != 1
                or row_scale.shape != (t, 1) or row_scale.dtype != torch.float32 or not row_scale.is_contiguous()):
            raise ValueError(f"x_rows: E4M3 codes {tuple(x.shape)} (rows contiguous) and float32 scales ({t}, 1) "
                             f"expected, got {codes.dtype} {tuple(codes.shape)} and {row_scale.dtype} "
                             f"{tuple(row_scale.shape)}")
    weights = topk_weights.reshape(-1).contiguous()
    if fp8_activations:
        xq, x_scale = x_rows if x_rows is not None else quantize_rows_triton(x, ACTIVATION_AMAX_FLOOR)
        launch_gate_up(xq, w_gate_up, act, routing, k, launch.gate_up, dot_f32, *gate_up_scale, x_scale=x_scale)
        actq, act_scale = quantize_rows_triton(act, ACTIVATION_AMAX_FLOOR)
        launch_down(actq, w_down, out, weights, routing, launch.down, dot_f32, *down_scale, act_scale=act_scale)
    else:
        launch_gate_up(x, w_gate_up, act, routing, k, launch.gate_up, dot_f32, *gate_up_scale)
        launch_down(act, w_down, out, weights, routing, launch.down, dot_f32, *down_scale)
    return sum_assignments(out, k, x.dtype)


@triton.jit
def _sum_assignments(src_ptr, dst_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(src_ptr + (token * K + j) * H + offs, mask=mask, other=0.0)
    tl.store(dst_ptr + token * H + offs, acc.to(dst_ptr.dtype.element_ty), mask=mask)


def sum_assignments(out: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T·k, H] fp32 rows → [T, H] in ``dtype``: each token's k rows summed in slot order (one launch, where
    torch's sum and cast took two)."""
    m, h = out.shape
    t = m // k
    y = torch.empty((t, h), dtype=dtype, device=out.device)
    block_h = min(1024, triton.next_power_of_2(h))
    _sum_assignments[(t, triton.cdiv(h, block_h))](out, y, h, K=k, BLOCK_H=block_h)
    return y
