"""Bias and share derivations after fix-bias-scales: whole chains, one resolver (issue 13)."""
import numpy as np

from qpasses.context import RunContext
from qpasses.ir import from_proto
from qpasses.pipeline import PassManager
from qpasses.testing import parse, random_feed

# W is read by a Gather (whose output a Reshape moves on) and by a Gemm with a big bias: the tiny
# weights make the int32 bias clip, so fix-bias-scales must raise W's scale
GATHER_GEMM = """
g (int64[2] idx, float[1,4] x) => (float[8] y, float[1,4] z)
  <float[4,4] W = {1e-7, -2e-7, 3e-7, 1e-7, 2e-7, -1e-7, 1e-7, 1e-7, 3e-7, -2e-7, 1e-7, 1e-7, -1e-7, 2e-7, 1e-7, 3e-7},
   float[4] b = {5.0, -4.0, 3.0, 1.0}, int64[1] s = {8}>
{
  g = Gather <axis = 0> (W, idx)
  y = Reshape (g, s)
  z = Gemm <transB = 1> (x, W, b)
}
"""
CONFIG = {"per_channel": False}


def quantized(passes: str, config=None):
    proto = parse(GATHER_GEMM, opset=17)
    model = from_proto(proto)
    ctx = RunContext(CONFIG | (config or {}), [random_feed(proto, seed) for seed in range(3)])
    PassManager(passes).run(model, ctx)
    return model


def test_a_reshape_of_a_gather_of_a_raised_weight_takes_the_raised_scale():
    table = quantized("annotate-types,calibrate,compute-qparams").quant
    assert table["g"].shares == "W" and table["y"].shares == "g"
    before = list(table["W"].scale)
    model = quantized("annotate-types,calibrate,compute-qparams,fix-bias-scales")
    table = model.quant
    assert table["W"].why[-1].startswith("fix-bias-scales: scale x") and table["W"].scale[0] > before[0]
    for name in ("g", "y"):   # the whole chain W <- g <- y shares the raised scale
        assert (table[name].scale, table[name].zero_point) == (table["W"].scale, table["W"].zero_point), name
    assert table["y"].why[-1] == "fix-bias-scales: qparams shared with 'g'"
    bias = np.abs(model.tensors()["b"].values).max()
    assert bias / table["b"].scale[0] < 2**31 - 1
    np.testing.assert_allclose(table["b"].scale[0], table["x"].scale[0] * table["W"].scale[0], rtol=1e-6)
