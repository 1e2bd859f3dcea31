"""Bias and share derivations after fix-bias-scales (whole chains, one resolver), and insert-qdq's
refusal of int32 biases that fix-bias-scales would still fix (issue 13)."""
import numpy as np
import pytest

from qpasses.analysis.bias_fixes import clipping_biases
from qpasses.core.context import RunContext
from qpasses.core.pipeline import PassManager
from qpasses.errors import PreconditionError
from qpasses.ir.model import from_proto
from qpasses.passes.fix_bias_scales import FixBiasScales
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


# -- insert-qdq refuses an int32 bias fix-bias-scales would still fix -----------------------------
CONV = """
g (float[1,8,3,3] x) => (float[1,2,3,3] y)
  <float[2,8,1,1] w = {1.01e-07, 1.45e-07, 6.44e-08, 1.45e-07, 8.12e-08, 9.23e-08, 1.33e-07, 9.09e-08,
                       1.05e-07, 5.28e-08, 1.25e-07, 1.04e-07, 8.3e-08, 1.29e-07, 8.03e-08, 9.53e-08},
   float[2] b = {5.0, -4.5}>
{
  y = Conv (x, w, b)
}
"""


def conv_run(passes: str, config=None):
    """The tiny-weight Conv, 16-bit activations, inputs around 100: correct-bias moves the fixed
    bias by ~2e-5 of its value, past what its scale holds."""
    proto = parse(CONV, opset=17)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.uniform(100, 112, (1, 8, 3, 3)).astype(np.float32)} for _ in range(4)]
    model = from_proto(proto)
    PassManager(passes).run(model, RunContext({"activation_type": "uint16"} | (config or {}), feeds))
    return model


PREFIX = "annotate-types,calibrate,compute-qparams"
CORRECT = "correct-bias"


@pytest.mark.parametrize("after_fix", ["compute-qparams", CORRECT])
def test_insert_qdq_refuses_a_bias_clipping_after_the_fix(after_fix):
    run = quantized if after_fix == "compute-qparams" else conv_run
    with pytest.raises(PreconditionError) as info:
        run(f"{PREFIX},fix-bias-scales,{after_fix},insert-qdq")
    message = str(info.value)
    assert "\n" not in message and "int32 bias 'b'" in message
    assert "run fix-bias-scales after compute-qparams/correct-bias" in message


@pytest.mark.parametrize("run, fix_first", [(quantized, "compute-qparams"), (conv_run, CORRECT)])
def test_insert_qdq_accepts_fixed_biases_and_clipping_the_config_allows(run, fix_first):
    for passes, config in ((f"{PREFIX},{fix_first},fix-bias-scales,insert-qdq", None),
                           (f"{PREFIX},fix-bias-scales,{fix_first},insert-qdq", {"fix_bias_scales": False})):
        assert "qdq-inserted" in run(passes, config).facts


def test_clipping_biases_is_what_fix_bias_scales_would_change():
    model = conv_run(PREFIX)
    ctx = RunContext({"activation_type": "uint16"})
    assert clipping_biases(model, ctx.config) == ["b"]
    assert FixBiasScales().run(model, ctx).modified
    assert clipping_biases(model, ctx.config) == []
    assert FixBiasScales().run(model, ctx).modified is False
