"""Element types of a model's top-level tensors, as the calibration runner and the segmented
executor need them: which tensors are float (to measure), the type of every value crossing a cut
between sessions (a session input must be declared with its type) and static sizes (to estimate
what a cut costs).

- ``analysis.dtypes.infer_types(proto)`` (the package's one shape inference, used here as is):
  element types of the graph inputs, initializers, value_info and outputs, and element counts of
  those whose shape is fully static;
- ``gs_types(model)``: the element types gs holds (from the model's own value_info);
- ``tensor_bytes(elem_type, count)``: the bytes of ``count`` elements of an ONNX element type;
- ``FLOAT_TYPES``: what calibration measures (float, float16 and double).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ..ir.model import QModel

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE})


def gs_types(model: QModel) -> dict[str, int]:
    """Element types gs knows (from the model's own value_info), as ONNX enums."""
    out = {}
    for name, tensor in model.tensors().items():
        dtype = getattr(tensor, "dtype", None)
        if dtype is None:
            continue
        try:
            out[name] = int(dtype) if isinstance(dtype, int) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        except Exception:
            continue
    return out


def tensor_bytes(elem_type: int, count: int | None) -> int | None:
    """Bytes of ``count`` elements of an ONNX element type (None when either is unknown)."""
    if count is None:
        return None
    try:
        return count * np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    except Exception:
        return None
