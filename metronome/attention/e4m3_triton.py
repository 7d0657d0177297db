"""E4M3 in Triton: exact rounding onto its grid for every kernel that writes E4M3 codes, and the widening of a
loaded tile to fp16 where it was loaded.

``e4m3_grid`` rounds float32 to the nearest E4M3 value (ties to even, saturating at ±448) before a kernel casts
to ``float8e4nv``, so the cast itself is exact. Left to the cast, compiled kernels may round through an fp16
intermediate (values just past a midpoint then round down, triton-lang/triton#11753) and the interpreter drops
the carry into the exponent (126.3 became 64, triton-lang/triton#11897).

``e4m3_to_f16`` widens E4M3 codes to fp16 (exact: every E4M3 value is an fp16 value) in the layout the tile has,
before ``tl.dot`` asks for another. Left to ``.to(tl.float16)``, Triton moves the cast after the layout change to
the dot's operand layout, and for an operand whose reduction runs across rows of memory (the values of
``P @ V``) that change gathers the tile from shared memory one byte at a time (64 one-byte loads a thread for a
64 x 128 tile, a third of the attention loop's instructions). The conversion is marked impure only so that
Triton keeps it where it is written: Triton does not document that it never moves an impure op, so
``tests/bench/test_kernel_report.py`` compiles the attention kernel for sm_90 with the installed Triton and checks
that the loop has no one-byte loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from metronome.attention.fp8 import E4M3_MAX

_MAX = tl.constexpr(E4M3_MAX)


@triton.jit
def e4m3_grid(x):
    """``x`` (float32) rounded to the nearest E4M3 value, ties to even, saturated at ±448 (NaN stays NaN)."""
    nan = x != x
    x = tl.clamp(x, -_MAX, _MAX)
    bits = x.to(tl.int32, bitcast=True)
    ax = tl.abs(x)
    # E4M3 values are 2**(e - 3) apart in the binade [2**e, 2**(e + 1)), and 2**-9 apart below 2**-6.
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ax / step  # exact: a power of two
    f = tl.floor(r)
    half = r - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    up = (half > 0.5) | ((half == 0.5) & (odd == 1.0))
    q = (f + up.to(tl.float32)) * step
    q = (q.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # x's sign, -0 too
    return tl.where(nan, float("nan"), q)  # the clamp does not keep NaN


@triton.jit
def e4m3_to_f16(x):
    """E4M3 codes ``x`` as fp16, two pairs per instruction (``cvt.rn.f16x2.e4m3x2``, sm_89 and later), in ``x``'s own
    layout. Compiled kernels only: the interpreter runs no PTX."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
