"""Parity with onnxruntime's quantizer where users compare: each check runs onnxruntime's own code."""
from __future__ import annotations

import pytest
from onnxruntime.quantization.quant_utils import get_qmin_qmax_for_qType

from qpasses.qtypes import qtype

TYPES = ["uint8", "int8", "uint16", "int16", "uint4", "int4"]


# -- integer limits: onnxruntime's get_qmin_qmax_for_qType -------------------------------------------
@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("name", TYPES)
def test_limits_match_onnxruntime(name, symmetric, reduce_range):
    qt = qtype(name)
    ort = get_qmin_qmax_for_qType(qt.onnx_type, reduce_range=reduce_range, symmetric=symmetric)
    assert qt.limits(symmetric, reduce_range) == (int(ort[0]), int(ort[1]))


def test_reduce_range_symmetric_int8_is_minus_64_to_64():
    assert qtype("int8").limits(symmetric=True, reduce_range=True) == (-64, 64)
