"""quantize-dynamic: the same model as onnxruntime's quantize_dynamic, output for output."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qpasses
from qpasses.config.quant_config import load_config
from qpasses.errors import ConfigError
from qpasses.evaluation.evaluate import session
from qpasses.passes.quantize_dynamic import QuantizeDynamic
from qpasses.testing import model_from_text, random_feed, run_pass

ort_quant = pytest.importorskip("onnxruntime.quantization")


def _model(seed: int = 0) -> onnx.ModelProto:
    """Conv(+bias) -> Relu -> Flatten -> MatMul -> Gemm(transB, bias) -> MatMul on a 3-D tensor."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("MatMul", ["f", "m"], ["mm"], name="mm"),
             helper.make_node("Gemm", ["mm", "g", "gb"], ["gg"], transB=1, name="gemm"),
             helper.make_node("Reshape", ["gg", "shape"], ["seq"]),
             helper.make_node("MatMul", ["seq", "m2"], ["y"], name="mm2")]
    w = rng.standard_normal((4, 3, 3, 3)) * np.array([1, 0.1, 3, 0.5])[:, None, None, None]
    inits = [numpy_helper.from_array(w.astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"),
             numpy_helper.from_array((rng.standard_normal((64, 8)) * np.linspace(0.1, 2, 8)).astype(np.float32), "m"),
             numpy_helper.from_array(rng.standard_normal((6, 8)).astype(np.float32), "g"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "gb"),
             numpy_helper.from_array(np.array([1, 3, 2], np.int64), "shape"),
             numpy_helper.from_array(rng.standard_normal((2, 5)).astype(np.float32), "m2")]
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 5])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


OPTIONS = [dict(per_channel=True, weight_type="int8"), dict(per_channel=False, weight_type="int8"),
           dict(per_channel=True, weight_type="uint8"), dict(per_channel=True, weight_type="int8", reduce_range=True)]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_outputs_equal_quantize_dynamic(tmp_path, options):
    src, ort_out = tmp_path / "f.onnx", tmp_path / "ort.onnx"
    onnx.save(_model(), src)
    qt = {"int8": ort_quant.QuantType.QInt8, "uint8": ort_quant.QuantType.QUInt8}[options["weight_type"]]
    ort_quant.quantize_dynamic(src, ort_out, per_channel=options["per_channel"], weight_type=qt,
                               reduce_range=options.get("reduce_range", False))
    model, records = qpasses.run_pipeline(str(src), config={"mode": "dynamic", **options})
    assert [r.name for r in records][-3:] == ["quantize-dynamic", "quantize-gathers", "cleanup"]
    proto = model.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("DynamicQuantizeLinear") == 4 and ops.count("MatMulInteger") == 3 and "ConvInteger" in ops
    assert not {"Conv", "MatMul", "Gemm"} & set(ops)
    theirs, mine = session(str(ort_out)), session(proto)
    for seed in range(4):
        feed = random_feed(proto, seed=seed)
        np.testing.assert_array_equal(mine.run(None, feed)[0], theirs.run(None, feed)[0])
    # and the weights themselves: same integers, same scales
    ort_inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(ort_out).graph.initializer}
    my_inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    for name in ("m_quantized", "m_scale", "w_quantized", "w_scale", "g_Transposed_quantized"):
        np.testing.assert_array_equal(my_inits[name], ort_inits[name])


@pytest.mark.parametrize("opset", [11, 17])
def test_qdq_form_runs_close_to_the_integer_form(opset):
    proto = _model()
    proto.opset_import[0].version = opset
    integer, qdq = (qpasses.run_pipeline(proto, f"quantize-dynamic{{form={f}}},cleanup")[0].to_proto()
                    for f in ("integer", "qdq"))
    onnx.checker.check_model(qdq, full_check=True)
    assert "DynamicQuantizeLinear" in [n.op_type for n in qdq.graph.node]
    feed = random_feed(proto)
    a, b = session(integer).run(None, feed)[0], session(qdq).run(None, feed)[0]
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(a).max())


def test_leaves_alone_what_onnxruntime_leaves_alone():
    model = model_from_text("""
    g (float[2,4] x, float[4,3] b) => (float[2,3] y, float[2,3] z) <float[3,4] w = {1,2,3,4,5,6,7,8,9,10,11,12}>
    {
      y = MatMul(x, b)
      z = Gemm <alpha=0.5, transB=1> (x, w)
    }""")
    before = model.to_proto().SerializeToString()
    result = run_pass(QuantizeDynamic(), model, {"mode": "dynamic"})
    assert not result.modified and result.stats["skipped"] == 2
    assert model.to_proto().SerializeToString() == before


def test_selection_and_idempotence():
    model = qpasses.load(_model())
    config = {"mode": "dynamic", "nodes_to_exclude": ["mm2"], "op_types_to_quantize": ["MatMul", "Gemm"]}
    first = run_pass(QuantizeDynamic(), model, config)
    assert first.stats["matmul_quantized"] == 1 and first.stats["gemm_quantized"] == 1
    assert "conv_quantized" not in first.stats
    assert not run_pass(QuantizeDynamic(), model, config).modified


def test_cli_dynamic_mode_needs_no_calibration_data(tmp_path):
    from qpasses.cli import main

    onnx.save(_model(), tmp_path / "f.onnx")
    (tmp_path / "c.yaml").write_text("mode: dynamic\n")
    assert main(["run", str(tmp_path / "f.onnx"), "-o", str(tmp_path / "q.onnx"), "--config",
                 str(tmp_path / "c.yaml"), "--quiet"]) == 0
    assert "MatMulInteger" in [n.op_type for n in onnx.load(tmp_path / "q.onnx").graph.node]


def test_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="mode: 'dynamc' is not one of"):
        load_config({"mode": "dynamc"})
