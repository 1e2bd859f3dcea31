"""What this CPU's onnxruntime int8 kernels do, for the few tests that must depend on it: those run
a quantized model in the fused integer kernels, say so in their names, and skip elsewhere."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses.evaluation.evaluate import session

# 255 * 127 + 255 * 127: what a pair of uint8 x int8 products sums to, and the int16 bound it hits
PAIR_EXACT, INT16_MAX = 64770, 32767


@functools.cache
def u8s8_saturates() -> bool:
    """Whether onnxruntime's U8S8 kernels on this CPU sum products in int16 pairs, saturating
    (x86-64 without VNNI: VPMADDUBSW; VNNI and ARM sum in int32): one MatMulInteger tells."""
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "u8s8_probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
        [numpy_helper.from_array(np.full((2, 1), 127, np.int8), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    pair = int(session(model).run(None, {"a": np.full((1, 2), 255, np.uint8)})[0][0, 0])
    assert pair in (PAIR_EXACT, INT16_MAX), pair
    return pair != PAIR_EXACT


without_u8s8_saturation = pytest.mark.skipif(
    u8s8_saturates(), reason="onnxruntime's U8S8 kernels saturate int16 pair sums on this CPU (x86-64 without VNNI)")
