"""Pure quantization math: ranges -> (scale, zero_point), quantize and dequantize. No graph code.

Every function is vectorised: ``rmin``/``rmax`` may be arrays (one entry per channel).

How a range becomes (scale, zero_point), in order:
1. NaN or infinite bounds make the range *degenerate* (it is replaced by [0, 0]); the range is
   widened to contain 0 (so 0 is exactly representable, as ONNX QDQ needs), then to at least
   ``minimum_real_range`` (``rmax = rmin + minimum_real_range``, as onnxruntime's MinimumRealRange).
2. Integer limits come from ``QType.limits`` (onnxruntime's get_qmin_qmax_for_qType): symmetric
   int8/int16 are narrow ([-127, 127]); ``reduce_range`` drops one bit ([-64, 64] for int8).
3. Zero point: asymmetric -> wherever ``rmin`` lands; symmetric -> 0 (signed) or the midpoint
   (unsigned: 128 for uint8, 32768 for uint16); restricted (unsigned) -> 0 when ``rmin >= 0``, the
   midpoint otherwise (signed types: 0). A fixed zero point gets the smallest scale covering both
   sides, so nothing clips: [-1, 2] restricted uint8 -> zp 128, scale max(1/128, 2/127).
4. Scale: raised to ``min_scale`` if given; a zero scale (zero-width or degenerate range) becomes
   1.0; ``power_of_two`` rounds it UP to a power of two; then it is rounded UP to a value of
   ``scale_type`` (float32 or float16) and clamped to that type's normal range, so the stored scale
   is never 0, inf or subnormal and the range is still covered.
5. The asymmetric zero point is computed from the final scale with round-half-even (as
   QuantizeLinear rounds), so [rmin, rmax] round-trips within half a step.
"""
from __future__ import annotations

import math

import numpy as np

from .qtypes import QType, qtype

SCALE_TYPES = {"float32": np.float32, "float16": np.float16}
DEGENERATE_SCALE = 1.0
INT32_MAX = 2**31 - 1
BIAS_SAFETY = 1.0 - 2.0**-10  # int32 biases use at most this fraction of the int32 range


def _broadcast(param, x: np.ndarray, axis: int | None) -> np.ndarray:
    param = np.asarray(param, dtype=np.float64)
    if axis is None or param.size == 1:
        return param.reshape(())
    shape = [1] * x.ndim
    shape[axis] = -1
    return param.reshape(shape)


def quantize(x, scale, zero_point, qt: QType | str, axis: int | None = None) -> np.ndarray:
    """round_half_even(x / scale) + zero_point, saturated to the type's range (ONNX QuantizeLinear).
    In float32, as onnxruntime computes it (and one temporary of the input's size, not three in
    float64); in float64 for 32-bit types, whose range float32 cannot count in steps of 1."""
    qt = qtype(qt)
    compute = np.float64 if qt.bits > 16 else np.float32
    q = np.array(x, dtype=compute)   # a copy: the ops below work in place
    q /= _broadcast(scale, q, axis).astype(compute)
    np.rint(q, out=q)
    q += _broadcast(zero_point, q, axis).astype(compute)
    np.clip(q, qt.qmin, qt.qmax, out=q)
    return np.asarray(q.astype(qt.storage))  # 0-d stays an array


def dequantize(q, scale, zero_point, axis: int | None = None) -> np.ndarray:
    """(q - zero_point) * scale as float32 (ONNX DequantizeLinear). Integers of up to 16 bits and
    their differences are exact in float32, so one float32 product is the correctly rounded result."""
    q = np.asarray(q)
    compute = np.float32 if q.dtype.itemsize <= 2 else np.float64
    out = np.array(q, dtype=compute)
    out -= _broadcast(zero_point, out, axis).astype(compute)
    out *= _broadcast(scale, out, axis).astype(compute)
    return np.asarray(out, dtype=np.float32)


# -- ranges -> (scale, zero_point) ----------------------------------------------------------------
def prepare_range(rmin, rmax, minimum_real_range: float | None = None):
    """(rmin, rmax) as float64 arrays: non-finite ranges -> [0, 0], widened to contain 0 and to
    at least ``minimum_real_range``."""
    lo, hi = np.broadcast_arrays(np.asarray(rmin, np.float64), np.asarray(rmax, np.float64))
    bad = ~(np.isfinite(lo) & np.isfinite(hi))
    lo = np.minimum(np.where(bad, 0.0, lo), 0.0)
    hi = np.maximum(np.where(bad, 0.0, hi), 0.0)
    if minimum_real_range:
        hi = np.maximum(hi, lo + float(minimum_real_range))
    return lo, hi


def is_finite_range(rmin, rmax) -> bool:
    """True when every bound is a finite number."""
    if isinstance(rmin, float) and isinstance(rmax, float):
        return math.isfinite(rmin) and math.isfinite(rmax)
    return bool(np.all(np.isfinite(np.asarray(rmin, np.float64)) & np.isfinite(np.asarray(rmax, np.float64))))


def midpoint(qmin: int, qmax: int) -> int:
    """Zero point of symmetric unsigned quantization: 128 for [0, 255], 32768 for [0, 65535]."""
    return (qmin + qmax + 1) // 2


def fit_scale(scale, scale_type: str = "float32") -> np.ndarray:
    """The smallest ``scale_type`` value >= scale, clamped to its finite normal range (float64 array)."""
    dt = SCALE_TYPES[scale_type]
    info = np.finfo(dt)
    s = np.clip(np.asarray(scale, np.float64), float(info.tiny), float(info.max))
    fitted = s.astype(dt)
    with np.errstate(over="ignore"):  # nextafter(max) is computed but never selected
        fitted = np.where(fitted.astype(np.float64) < s, np.nextafter(fitted, dt(np.inf)), fitted)
    return np.asarray(fitted, np.float64)


def round_up_pow2(scale) -> np.ndarray:
    """2**ceil(log2(scale)) for positive scales."""
    return np.exp2(np.ceil(np.log2(np.asarray(scale, np.float64))))


def compute_qparams(rmin, rmax, qt: QType | str, *, symmetric: bool = False, reduce_range: bool = False,
                    restricted: bool = False, minimum_real_range: float | None = None,
                    power_of_two: bool = False, scale_type: str = "float32", min_scale=None):
    """(scale float64 array, zero_point int64 array) for the real range [rmin, rmax].

    ``min_scale`` is a lower bound on the scale (fix-bias-scales uses it to raise weight scales);
    the zero point is re-derived so the range stays covered.
    """
    qt = qtype(qt)
    lo, hi = prepare_range(rmin, rmax, minimum_real_range)
    qmin, qmax = qt.limits(symmetric, reduce_range)
    if symmetric:
        absmax = np.maximum(-lo, hi)
        lo, hi = -absmax, absmax
    fixed_zp = _fixed_zero_point(lo, qt, qmin, qmax, symmetric, restricted)
    if fixed_zp is None:
        scale = (hi - lo) / (qmax - qmin)
    else:
        below = fixed_zp - qmin
        neg = np.where(below > 0, -lo / np.maximum(below, 1), 0.0)
        scale = np.maximum(neg, hi / (qmax - fixed_zp))
    if min_scale is not None:
        scale = np.maximum(scale, np.asarray(min_scale, np.float64))
    scale = np.where(scale > 0, scale, DEGENERATE_SCALE)
    if power_of_two:
        scale = round_up_pow2(scale)
    scale = fit_scale(scale, scale_type)
    if fixed_zp is None:
        zp = np.where(hi > lo, np.rint(qmin - lo / scale), np.clip(0, qmin, qmax))
        zp = np.clip(zp, qmin, qmax)
    else:
        zp = np.broadcast_to(fixed_zp, scale.shape)
    return scale, np.asarray(zp, np.int64)


def _fixed_zero_point(lo, qt: QType, qmin: int, qmax: int, symmetric: bool, restricted: bool):
    """The zero point forced by symmetric/restricted quantization (None: asymmetric, computed)."""
    if symmetric:
        return np.full(lo.shape, 0 if qt.signed else midpoint(qmin, qmax), np.int64)
    if restricted:
        if qt.signed:
            return np.zeros(lo.shape, np.int64)
        return np.where(lo < 0, midpoint(qmin, qmax), qmin).astype(np.int64)
    return None


def value_range(values, axis: int | None = None):
    """(min, max) of an array as float64 arrays: scalars, or one per index of ``axis``."""
    v = np.asarray(values)
    if v.size == 0:
        return np.zeros(()), np.zeros(())
    if v.dtype.kind != "f":
        v = v.astype(np.float64)
    axes = None if axis is None else tuple(i for i in range(v.ndim) if i != axis % v.ndim)
    return np.asarray(v.min(axis=axes), np.float64), np.asarray(v.max(axis=axes), np.float64)


# -- int32 biases -----------------------------------------------------------------------------------
def bias_qparams(input_scale, weight_scale, scale_type: str = "float32"):
    """(scale, zero_point) of an int32 bias: input_scale * weight_scale (broadcast), zero point 0."""
    scale = fit_scale(np.asarray(input_scale, np.float64) * np.asarray(weight_scale, np.float64), scale_type)
    return scale, np.zeros(scale.shape, np.int64)


def bias_min_scale(bias_absmax, scale_type: str = "float32", qmax: int = INT32_MAX) -> np.ndarray:
    """Smallest bias scale at which |bias| <= bias_absmax quantizes (to int32, or ``qmax``) without
    clipping, with the BIAS_SAFETY margin; never below the scale type's smallest normal value."""
    tiny = float(np.finfo(SCALE_TYPES[scale_type]).tiny)
    return np.maximum(np.asarray(bias_absmax, np.float64) / (qmax * BIAS_SAFETY), tiny)
