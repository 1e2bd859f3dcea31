"""qpasses.analysis.sensitivity: what taking a weighted op out of 8 bits costs."""
import numpy as np
import onnx_graphsurgeon as gs

from qpasses.analysis.sensitivity import macs


def _node(op, w_shape, out_shape, in_shape=None):
    x = gs.Variable("x", np.float32, in_shape)
    w = gs.Constant("w", np.zeros(w_shape, np.float32))
    return gs.Node(op, inputs=[x, w], outputs=[gs.Variable("y", np.float32, out_shape)])


def test_macs_count_positions_from_shapes_and_the_median_where_unknown():
    conv = _node("Conv", (4, 2, 3, 3), [1, 4, 8, 8])
    matmul = _node("MatMul", (8, 3), [2, 5, 3])
    deconv = _node("ConvTranspose", (2, 4, 2, 2), [1, 4, 8, 8], in_shape=[1, 2, 4, 4])
    unknown = _node("Conv", (4, 2, 1, 1), ["n", 4, 8, 8])
    cost = macs([conv, matmul, deconv, unknown])
    assert cost[id(conv)] == 72 * 64 and cost[id(matmul)] == 24 * 10 and cost[id(deconv)] == 32 * 16
    assert cost[id(unknown)] == 8 * np.median([64, 10, 16])
