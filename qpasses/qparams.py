"""Pure quantization math: ranges -> (scale, zero_point), quantize and dequantize. No graph code."""
from __future__ import annotations

import numpy as np

from .qtypes import QType, qtype


def _broadcast(param, x: np.ndarray, axis: int | None) -> np.ndarray:
    param = np.asarray(param, dtype=np.float64)
    if axis is None or param.size == 1:
        return param.reshape(())
    shape = [1] * x.ndim
    shape[axis] = -1
    return param.reshape(shape)


def quantize(x, scale, zero_point, qt: QType | str, axis: int | None = None) -> np.ndarray:
    """round_half_even(x / scale) + zero_point, saturated to the type's range (ONNX QuantizeLinear)."""
    qt = qtype(qt)
    x = np.asarray(x, dtype=np.float64)
    q = np.rint(x / _broadcast(scale, x, axis)) + _broadcast(zero_point, x, axis)
    return np.clip(q, qt.qmin, qt.qmax).astype(qt.storage)


def dequantize(q, scale, zero_point, axis: int | None = None) -> np.ndarray:
    """(q - zero_point) * scale as float32 (ONNX DequantizeLinear)."""
    q = np.asarray(q, dtype=np.float64)
    return ((q - _broadcast(zero_point, q, axis)) * _broadcast(scale, q, axis)).astype(np.float32)
