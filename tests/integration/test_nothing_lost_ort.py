"""Nothing lost (issue 14), class 5: outputs onnxruntime cannot load.

Every model `qpasses run` writes loads in onnxruntime at its default optimization level (it is
loaded before it is committed). Types onnxruntime's optimizer fuses into kernels that lack them —
4-bit activations into a Conv with 8-bit weights (QLinearConv) or into MaxPool — are refused up
front, once the types are final and before the costly passes, with exit 2 naming the nodes.
Everything else 4-bit either loads at every optimization level or is refused the same way.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.kits.nothing_lost_kit import Workspace, assert_refused, convs, mlp, run_cli, snapshot
from qpasses.testing import parse

# the default pipeline without search-precision (which may promote the 4-bit tensors away)
PIPELINE = ("fold-constants,fold-batchnorm,cleanup,annotate-types,propagate-mixed-precision,calibrate,"
            "select-by-snr,compute-qparams,correct-bias,fix-bias-scales,insert-qdq,insert-converts,cleanup")


def _no_pool():
    text = onnx.printer.to_text(convs())
    m = convs()
    del m.graph.node[-1]
    m.graph.output[0].name = "r2"
    m.graph.output[0].type.tensor_type.shape.dim[2].dim_value = 8
    m.graph.output[0].type.tensor_type.shape.dim[3].dim_value = 8
    assert "MaxPool" in text
    return m


def _pool_first():
    return parse("""
        m (float[1,2,4,4] x) => (float[1,2,2,2] y) {
            s = Sigmoid (x)
            y = MaxPool <kernel_shape = [2,2], strides = [2,2]> (s)
        }""")


def _conv_in_if():
    """The same Relu -> Conv in both branches of an If (bodies are quantized like the main graph)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(0, 0.3, (4, 4, 1, 1)).astype(np.float32), "w")

    def branch(name):
        nodes = [helper.make_node("Relu", ["x"], [f"{name}_r"]),
                 helper.make_node("Conv", [f"{name}_r", "w"], [f"{name}_y"], name=f"{name}_conv")]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT,
                                                                                 [1, 4, 4, 4])])

    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch("t"), else_branch=branch("e"), name="if")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _pool_output_only():
    """Found by the 4-bit fuzz: only MaxPool's output is quantized (Relu and Pad read it)."""
    return parse("""
        fuzz (float[1,1,1,1] x1) => (float[?,?,?,?] relu_4, float[?,?,?,?] pad_7) <int64[8] pads6 = {0,0,0,0,0,0,0,0}> {
            maxp_2 = MaxPool <kernel_shape = [1, 1]> (x1)
            relu_4 = Relu (maxp_2)
            pad_7 = Pad <mode = "reflect"> (maxp_2, pads6)
        }""", opset=13)


def _clip_then_conv():
    """Found by the 4-bit fuzz: a Clip kept in front of a quantized Conv."""
    return parse("""
        fuzz (float[1,1,1,1] x3) => (float[?,?,?,?] relu_6, float[?,?,?,?] conv_13)
          <float lo8 = {0}, float hi9 = {6}, float[1,1,1,1] w12 = {0.12573022}> {
            relu_4 = Relu (x3)
            relu_6 = Relu (relu_4)
            clip_10 = Clip (relu_4, lo8, hi9)
            conv_13 = Conv <kernel_shape = [1, 1]> (clip_10, w12)
        }""", opset=13)


def _conv_then_relus():
    """Found by the 4-bit fuzz: the Conv's output kept float, the Relus reading it quantized."""
    return parse("""
        fuzz (float[1,1,1,1] x1) => (float[?,?,?,?] relu_5, float[?,?,?,?] relu_6) <float[1,1,1,1] w2 = {0.12573022}> {
            conv_3 = Conv <kernel_shape = [1, 1]> (x1, w2)
            relu_4 = Relu (conv_3)
            relu_5 = Relu (relu_4)
            relu_6 = Relu (conv_3)
        }""", opset=13)


def _reshape_then_pool():
    """Found by the 4-bit fuzz: a float Reshape between a quantized Relu and a float MaxPool."""
    return parse("""
        fuzz (float[1,1] x1) => (float[?,?,?,?] relu_9) <int64[4] shape4 = {1,1,1,1}> {
            [Relu_3] relu_2 = Relu (x1)
            [Reshape_6] resh_5 = Reshape (relu_2, shape4)
            [MaxPool_8] maxp_7 = MaxPool <kernel_shape = [1, 1]> (resh_5)
            [Relu_10] relu_9 = Relu (maxp_7)
        }""", opset=13)


def _pool_then_transpose():
    """Found by the 4-bit fuzz: a float MaxPool and Transpose in front of a quantized ConvTranspose
    input; onnxruntime moves the QuantizeLinear up past the Transpose to the MaxPool."""
    return parse("""
        fuzz (float[1,1,1,1] x1) => (float[?,?,?,?] conv_12) <float[1,1,1,1] w11 = {0.12573022}> {
            [MaxPool_4] maxp_7 = MaxPool <kernel_shape = [1, 1]> (x1)
            tran_10 = Transpose <perm = [0, 1, 2, 3]> (maxp_7)
            conv_12 = ConvTranspose <kernel_shape = [1, 1]> (tran_10, w11)
        }""", opset=13)


REFUSED = [
    ("uint4 activations into Conv", convs, {"activation_type": "uint4"}, "QLinearConv has no uint4 kernel"),
    ("int4 activations into Conv", convs, {"activation_type": "int4"}, "QLinearConv has no int4 kernel"),
    ("uint4 activations, uint8 weights", _no_pool, {"activation_type": "uint4", "weight_type": "uint8"},
     "QLinearConv has no uint4 kernel"),
    ("uint4 activations into MaxPool", convs, {"activation_type": "uint4", "weight_type": "int4"},
     "MaxPool has no uint4 kernel"),
    ("int4 Sigmoid into MaxPool", _pool_first, {"activation_type": "int4", "op_types_to_quantize": ["Sigmoid", "MaxPool"]},
     "MaxPool has no int4 kernel"),
    ("an int4 override on a Conv input", _no_pool, {"tensor_overrides": {"r1": [{"quant_type": "int4"}]}},
     "reads 'r1' as int4"),
    ("uint4 activations into a Conv in an If branch", _conv_in_if, {"activation_type": "uint4"},
     "node 't_conv' (Conv) reads 't_r' as uint4"),
    ("a uint4 MaxPool output", _pool_output_only, {"activation_type": "uint4"}, "(MaxPool) writes 'maxp_2' as uint4"),
    ("uint4 into MaxPool through a float Reshape", _reshape_then_pool,
     {"activation_type": "uint4", "nodes_to_quantize": ["Relu_3"]}, "reads 'relu_2' as uint4 through float Reshape"),
    ("a MaxPool whose output a float Transpose hands to uint4", _pool_then_transpose, {"activation_type": "uint4"},
     "(MaxPool) writes 'tran_10' as uint4 through float Reshape/Transpose"),
    ("a Clip before a uint4 QuantizeLinear", _clip_then_conv, {"activation_type": "uint4", "weight_type": "int16"},
     "(Clip) writes 'clip_10' as uint4"),
]


@pytest.mark.parametrize("model, config, fragment", [pytest.param(m, c, f, id=i) for i, m, c, f in REFUSED])
def test_4_bit_types_onnxruntime_cannot_load_are_refused_up_front(model, config, fragment, tmp_path, capsys):
    ws = Workspace(tmp_path, model())
    ws.config.write_text(json.dumps(config))
    line = assert_refused(capsys, tmp_path, ws.run("--config", ws.config, "--passes", PIPELINE, "--report", ws.report,
                                                   "--dump-after", ws.out_dir / "d"), fragment)
    assert "onnxruntime cannot load such a model" in line


def test_a_conv_whose_output_search_precision_keeps_float_is_still_checked():
    """Found by the 4-bit fuzz: search-precision keeps conv_3 float, the Relus reading it stay
    uint4; onnxruntime drops those Relus in front of their QuantizeLinear and fuses the Conv into
    a QLinearConv reading uint4, which it cannot load."""
    import qpasses

    feeds = [{"x1": np.full((1, 1, 1, 1), v, np.float32)} for v in (0.12573022, -0.13210486, 0.64042264, 0.10490011)]
    with pytest.raises(qpasses.QpassesError, match=r"\(Conv\) reads 'x1' as uint4"):
        qpasses.quantize(_conv_then_relus(), feeds, config={"activation_type": "uint4"})


def test_the_refusal_comes_before_calibration(tmp_path, capsys, monkeypatch):
    from qpasses.passes.calibrate import Calibrate

    def never(self, model, ctx):
        raise AssertionError("calibrate ran")

    monkeypatch.setattr(Calibrate, "run", never)
    ws = Workspace(tmp_path, convs())
    ws.config.write_text('{"activation_type": "uint4"}')
    assert_refused(capsys, tmp_path, ws.run("--config", ws.config, "--passes",
                                            "fold-constants,annotate-types,calibrate,compute-qparams,insert-qdq"),
                   "QLinearConv has no uint4 kernel")


LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")
CONFIGS = [
    {"activation_type": "uint4", "weight_type": "int4"},
    {"activation_type": "int4", "weight_type": "int4", "per_channel": False},
    {"activation_type": "uint8", "weight_type": "int4"},
    {"activation_type": "uint8", "weight_type": "uint4", "per_channel": False},
    {"activation_type": "uint16", "weight_type": "int4"},
    {"activation_type": "uint4", "weight_type": "int16"},
    {"activation_type": "uint4"},
    {"activation_type": "int4", "mixed_precision": {"r1": "uint16"}},
]


@pytest.mark.parametrize("model, pipeline", [(mlp, "default"), (_no_pool, "default"), (convs, "default"),
                                             (convs, "without search-precision")],
                         ids=["mlp", "convs", "convs+pool", "convs+pool, no search-precision"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_4_bit_configs_load_at_every_level_or_are_refused(config, model, pipeline, tmp_path, capsys):
    if "mixed_precision" in config and model is mlp:
        config = {k: v for k, v in config.items() if k != "mixed_precision"}
    ws = Workspace(tmp_path, model())
    ws.config.write_text(json.dumps(config))
    before = snapshot(tmp_path)
    extra = ["--passes", PIPELINE] if pipeline != "default" else []
    code, lines, _ = run_cli(capsys, ws.run("--config", ws.config, "--quiet", *extra))
    assert code in (0, 2), lines
    if code == 2:
        assert len(lines) == 1 and "onnxruntime cannot load such a model" in lines[0], lines
        assert snapshot(tmp_path) == before
        return
    for level in LEVELS:
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        ort.InferenceSession(str(ws.out), opts, providers=["CPUExecutionProvider"])
