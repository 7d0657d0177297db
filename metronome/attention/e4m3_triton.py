"""Exact rounding onto the E4M3 grid in Triton, for every kernel that writes E4M3 codes.

``e4m3_grid`` rounds float32 to the nearest E4M3 value (ties to even, saturating at ±448) before a kernel casts
to ``float8e4nv``, so the cast itself is exact. Left to the cast, compiled kernels may round through an fp16
intermediate (values just past a midpoint then round down, triton-lang/triton#11753) and the interpreter drops
the carry into the exponent (126.3 became 64, triton-lang/triton#11897).
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
