"""Pure quantization math: ranges -> (scale, zero_point), quantize and dequantize. No graph code.

Every function is vectorised: ``rmin``/``rmax`` may be arrays (one entry per channel).

How a range becomes (scale, zero_point): as onnxruntime's compute_scale_zp, bit for bit for
float32 scales (``restricted``, ``min_scale``, ``power_of_two`` and float16 scales are qpasses'):
1. The bounds are float32, as onnxruntime's calibrated ranges and weights are; NaN or infinite
   bounds make the range *degenerate* ([0, 0]). In float32, the range is widened to contain 0, then
   to at least ``minimum_real_range`` (``rmax = max(rmax, rmin + minimum_real_range)``), then made
   symmetric ([-absmax, absmax]) when ``symmetric``.
2. Integer limits come from ``QType.limits`` (onnxruntime's get_qmin_qmax_for_qType): symmetric
   int8/int16 are narrow ([-127, 127]); ``reduce_range`` drops one bit ([-64, 64] for int8).
3. Scale, in float64: (rmax - rmin) / (qmax - qmin); restricted quantization fixes the zero point
   (unsigned: 0 when ``rmin >= 0``, the midpoint otherwise; signed: 0) and takes the smallest scale
   covering both sides. It is raised to ``min_scale`` if given; below float32's smallest normal
   value the range is degenerate: scale 1.0 and zero point 0. ``power_of_two`` rounds it UP to a
   power of two.
4. Zero point, rounded half to even: symmetric -> the middle of the limits (0, or 128 for uint8,
   32768 for uint16); asymmetric -> ``qmin - rmin / scale`` with the float64 scale.
5. The scale is stored as the nearest float32. A float16 scale (``scale_type``) is rounded UP and
   clamped to float16's normal range instead, and the asymmetric zero point is computed from it, so
   the range stays covered.
"""
from __future__ import annotations

import math

import numpy as np

from .qtypes import QType, qtype

SCALE_TYPES = {"float32": np.float32, "float16": np.float16}
DEGENERATE_SCALE = 1.0
F32_TINY = float(np.finfo(np.float32).tiny)   # smaller scales are degenerate (onnxruntime)
F32_MAX = float(np.finfo(np.float32).max)
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
    if qt.is_float:   # FP8 (zero point 0): saturate, then round to nearest even in the cast
        return np.asarray(np.clip(q, qt.qmin, qt.qmax).astype(qt.storage))
    np.rint(q, out=q)
    q += _broadcast(zero_point, q, axis).astype(compute)
    np.clip(q, qt.qmin, qt.qmax, out=q)
    return np.asarray(q.astype(qt.storage))  # 0-d stays an array


def dequantize(q, scale, zero_point, axis: int | None = None) -> np.ndarray:
    """(q - zero_point) * scale as float32 (ONNX DequantizeLinear). Integers of up to 16 bits and
    their differences are exact in float32, so one float32 product is the correctly rounded result."""
    q = np.asarray(q)
    compute = np.float32 if q.dtype.itemsize <= 2 or q.dtype.kind == "V" else np.float64
    out = np.array(q, dtype=compute)
    out -= _broadcast(zero_point, out, axis).astype(compute)
    out *= _broadcast(scale, out, axis).astype(compute)
    return np.asarray(out, dtype=np.float32)


# -- ranges -> (scale, zero_point) ----------------------------------------------------------------
def prepare_range(rmin, rmax, minimum_real_range: float | None = None, symmetric: bool = False):
    """(rmin, rmax) as float32 arrays, in onnxruntime's order: non-finite ranges -> [0, 0], widened
    to contain 0 and to at least ``minimum_real_range``, then [-absmax, absmax] if ``symmetric``."""
    lo, hi = np.broadcast_arrays(np.asarray(rmin, np.float64), np.asarray(rmax, np.float64))
    bad = ~(np.isfinite(lo) & np.isfinite(hi))
    lo, hi = (np.clip(np.where(bad, 0.0, b), -F32_MAX, F32_MAX).astype(np.float32) for b in (lo, hi))
    lo, hi = np.minimum(lo, np.float32(0)), np.maximum(hi, np.float32(0))
    if minimum_real_range:
        hi = np.maximum(hi, lo + np.float32(minimum_real_range))
    if symmetric:
        absmax = np.maximum(-lo, hi)
        lo, hi = -absmax, absmax
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
    if qt.is_float:
        return _float8_qparams(rmin, rmax, qt, minimum_real_range, scale_type, min_scale)
    qmin, qmax = qt.limits(symmetric, reduce_range)
    lo, hi = (b.astype(np.float64) for b in prepare_range(rmin, rmax, minimum_real_range, symmetric))
    fixed_zp = _restricted_zero_point(lo, qt, qmin, qmax) if restricted and not symmetric else None
    if fixed_zp is None:
        scale = (hi - lo) / (qmax - qmin)
    else:
        below = fixed_zp - qmin
        scale = np.maximum(np.where(below > 0, -lo / np.maximum(below, 1), 0.0), hi / (qmax - fixed_zp))
    if min_scale is not None:
        scale = np.maximum(scale, fit_scale(min_scale, scale_type))
    degenerate = ~(scale >= F32_TINY)   # as onnxruntime: scale 1, zero point 0
    scale = np.where(degenerate, DEGENERATE_SCALE, scale)
    if power_of_two:
        scale = round_up_pow2(scale)
    if scale_type == "float32":
        stored = np.asarray(np.minimum(scale, F32_MAX).astype(np.float32), np.float64)
    else:
        stored = scale = fit_scale(scale, scale_type)
    if symmetric:
        zp = np.full(scale.shape, np.round((qmin + qmax) / 2.0))
    elif fixed_zp is not None:
        zp = fixed_zp
    else:
        zp = np.clip(np.rint(qmin - lo / scale), qmin, qmax)
    return stored, np.where(degenerate, 0, zp).astype(np.int64)


def _float8_qparams(rmin, rmax, qt: QType, minimum_real_range, scale_type: str, min_scale):
    """FP8: scale = amax / the type's largest finite value (448 for e4m3fn, 57344 for e5m2), zero
    point 0; symmetric by nature (no reduce_range, restricted or power-of-two grids)."""
    lo, hi = prepare_range(rmin, rmax, minimum_real_range, symmetric=True)
    scale = hi.astype(np.float64) / qt.qmax
    if min_scale is not None:
        scale = np.maximum(scale, fit_scale(min_scale, scale_type))
    degenerate = ~(scale >= F32_TINY)
    scale = np.where(degenerate, DEGENERATE_SCALE, scale)
    stored = (np.asarray(np.minimum(scale, F32_MAX).astype(np.float32), np.float64) if scale_type == "float32"
              else fit_scale(scale, scale_type))
    return stored, np.zeros(stored.shape, np.int64)


def _restricted_zero_point(lo, qt: QType, qmin: int, qmax: int):
    """Restricted asymmetric zero point: unsigned -> qmin if ``lo >= 0`` else the midpoint; signed -> 0."""
    if qt.signed:
        return np.zeros(lo.shape, np.int64)
    return np.where(lo < 0, midpoint(qmin, qmax), qmin).astype(np.int64)


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
