"""qpasses.analysis.sensitivity: what taking a weighted op out of 8 bits costs."""
import numpy as np
import onnx_graphsurgeon as gs

from qpasses.analysis import op_costs
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


def test_a_conv_whose_output_stays_float_leaves_the_8bit_share():
    """onnxruntime runs a Conv without a QuantizeLinear after it in float: promoting its output
    takes the Conv's work out of the share, as promoting its input does; a MatMul's output does not
    (MatMulIntegerToFloat)."""
    from qpasses.analysis.sensitivity import eight_bit_share, promotion_groups
    from qpasses.core.pipeline import make_pass
    from qpasses.testing import model_from_text, random_feed, run_passes

    model = model_from_text("""
        g (float[1, 4, 8, 8] x) => (float[1, 4, 8, 8] y, float[1, 4, 8, 4] z)
        <float[4, 4, 3, 3] w = {%s}, float[8, 4] v = {%s}>
        {
            c = Conv <pads = [1, 1, 1, 1]> (x, w)
            y = Relu(c)
            m = MatMul(y, v)
            z = Relu(m)
        }
    """ % (", ".join(["0.1", "-0.2"] * 72), ", ".join(["0.3", "-0.1"] * 16)))
    feeds = [random_feed(model, seed) for seed in range(4)]
    run_passes([make_pass(name) for name in ("annotate-types", "calibrate", "compute-qparams")], model, data=feeds)
    share = eight_bit_share(model, promotion_groups(model), 0.8)
    owner = {m: root for root, members in promotion_groups(model).items() for m in members}
    conv, matmul = (next(n for n in model.graph.nodes if n.op == op) for op in ("Conv", "MatMul"))
    assert share.total == share.eight == sum(op_costs.costs([conv, matmul], macs([conv, matmul]), op_costs.shipped()).values())
    assert share.total > 0
    assert id(conv) in share.reads[owner["c"]] and owner["c"] not in (owner["x"], owner["w"])
    assert share.reads[owner["m"]] == set()
