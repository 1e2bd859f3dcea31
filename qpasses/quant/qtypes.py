"""Quantized data types: value ranges, numpy/ONNX mapping and the opset each one needs."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from onnx import TensorProto

from ..errors import ConfigError

EIGHT_BIT = frozenset({"int8", "uint8"})   # table qtypes that count as 8-bit


@dataclass(frozen=True)
class QType:
    name: str
    onnx_type: int
    qmin: int
    qmax: int
    min_opset: int
    storage: type  # numpy dtype used to hold quantized values before export
    reduced: tuple[int, int] | None = None  # reduce_range limits (onnxruntime's, symmetric or not)
    narrow: bool = False  # symmetric quantization drops qmin (int8/int16 only, as in onnxruntime)
    is_float: bool = False  # FP8: qmin/qmax are the largest finite values; zero point 0, no rounding to integers

    @property
    def bits(self) -> int:
        if self.is_float:
            return 8 * np.dtype(self.storage).itemsize
        return int(np.log2(self.qmax - self.qmin + 1))

    @property
    def signed(self) -> bool:
        return self.qmin < 0

    def limits(self, symmetric: bool = False, reduce_range: bool = False) -> tuple[int, int]:
        """Integer range used for quantization, as onnxruntime's get_qmin_qmax_for_qType: with
        ``reduce_range`` the ``reduced`` limits (whatever ``symmetric``: [-64, 64] for int8), else
        [-qmax, qmax] for symmetric ``narrow`` types, else the full range."""
        if reduce_range:
            if self.reduced is None:
                raise ConfigError(f"reduce_range is not supported for {self.name}")
            return self.reduced
        if symmetric and self.narrow:
            return -self.qmax, self.qmax
        return self.qmin, self.qmax


QTYPES: dict[str, QType] = {
    t.name: t
    for t in (
        QType("uint8", TensorProto.UINT8, 0, 255, 10, np.uint8, (0, 127)),
        QType("int8", TensorProto.INT8, -128, 127, 10, np.int8, (-64, 64), narrow=True),
        QType("uint16", TensorProto.UINT16, 0, 65535, 21, np.uint16, (0, 32767)),
        QType("int16", TensorProto.INT16, -32768, 32767, 21, np.int16, (-16384, 16384), narrow=True),
        QType("uint4", TensorProto.UINT4, 0, 15, 21, np.uint8, (0, 7)),
        QType("int4", TensorProto.INT4, -8, 7, 21, np.int8, (-4, 3)),
        QType("int32", TensorProto.INT32, -(2**31), 2**31 - 1, 10, np.int32),
        QType("float8e4m3fn", TensorProto.FLOAT8E4M3FN, -448, 448, 19, ml_dtypes.float8_e4m3fn, is_float=True),
        QType("float8e5m2", TensorProto.FLOAT8E5M2, -57344, 57344, 19, ml_dtypes.float8_e5m2, is_float=True),
    )
}

# Spellings accepted from users: ORT's QuantType names and ONNX names.
_ALIASES = {
    "quint8": "uint8", "qint8": "int8", "quint16": "uint16", "qint16": "int16",
    "quint4": "uint4", "qint4": "int4", "u8": "uint8", "s8": "int8", "u16": "uint16", "s16": "int16",
    "qfloat8e4m3fn": "float8e4m3fn", "float8_e4m3fn": "float8e4m3fn", "fp8": "float8e4m3fn", "e4m3": "float8e4m3fn",
    "float8_e5m2": "float8e5m2", "e5m2": "float8e5m2",
}

PER_AXIS_MIN_OPSET = 13


def qtype(name) -> QType:
    """Look up a quantized type by any accepted spelling (``uint8``, ``QUInt8``, ``QuantType.QUInt8``)."""
    if isinstance(name, QType):
        return name
    key = str(getattr(name, "name", name)).lower().replace("quanttype.", "")
    key = _ALIASES.get(key, key)
    if key not in QTYPES:
        raise ConfigError(f"unknown quantized type '{name}' (expected one of {', '.join(QTYPES)})")
    return QTYPES[key]
