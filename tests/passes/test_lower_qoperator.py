"""lower-qoperator: QLinear* operators within 1 LSB of onnxruntime's fused execution of the QDQ model."""
from __future__ import annotations

import glob
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import qpasses
from qpasses.cli.examples import example_data, example_model
from qpasses.core.pipeline import default_pipeline
from qpasses.passes.lower_qoperator import LowerQOperator, plan_lowering
from qpasses.testing import model_from_text, random_feed, run_pass

from tests.kits.cpu_kit import without_u8s8_saturation

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def _session(proto: onnx.ModelProto, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    opts.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def max_lsb(qdq: onnx.ModelProto, qop: onnx.ModelProto, feeds) -> float:
    """Largest output difference between the QDQ model (ORT_ENABLE_ALL) and the QOperator model,
    in steps of the output's DequantizeLinear scale (outputs not written by a DQ must be equal)."""
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    made = {o: n for n in qdq.graph.node for o in n.output}
    a, b = _session(qdq), _session(qop)
    names = [o.name for o in qdq.graph.output]
    worst = 0.0
    for feed in feeds:
        for name, x, y in zip(names, a.run(None, feed), b.run(None, feed), strict=True):
            node = made.get(name)
            step = float(inits[node.input[1]].max()) if node is not None and node.op_type == "DequantizeLinear" else 0.0
            diff = float(np.abs(x.astype(np.float64) - y).max())
            worst = max(worst, diff / step if step else (0.0 if diff == 0 else np.inf))
    return worst


def _lowered(qdq_model):
    qdq = qdq_model.to_proto(metadata=False)
    model, records = qpasses.run_pipeline(qdq_model, "lower-qoperator,cleanup")
    qop = model.to_proto(metadata=False)
    onnx.checker.check_model(qop, full_check=True)
    _session(qop, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)   # loads without onnxruntime's fusions too
    return qdq, qop, records[0].stats


# int8 activations keep int8 weights (protect-pair-sums has no uint8 kernel for them): on a CPU
# without VNNI those layers saturate int16 pair sums, and the two forms' kernels differ where they do
CONFIGS = [{}, {"op_types_to_quantize": "all"},
           pytest.param({"activation_type": "int8", "per_channel": False}, marks=without_u8s8_saturation,
                        id="activation_type=int8-per_channel=False-in_this_cpus_int8_kernels"),
           pytest.param({"op_types_to_quantize": "all", "activation_type": "int8"}, marks=without_u8s8_saturation,
                        id="op_types_to_quantize=all-activation_type=int8-in_this_cpus_int8_kernels")]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_bundled_example_within_one_lsb(config):
    data = example_data(16)
    feeds = [{k: v[i] for k, v in data.items()} for i in range(16)]
    qdq, qop, stats = _lowered(qpasses.quantize(example_model(), feeds, config))
    ops = [n.op_type for n in qop.graph.node]
    assert stats["QLinearConv"] == 2 and stats["QGemm"] == 1 and "Conv" not in ops and "Gemm" not in ops
    if config.get("op_types_to_quantize") == "all":
        assert "QLinearAdd" in ops
    assert any(d.domain == "com.microsoft" for d in qop.opset_import)
    assert max_lsb(qdq, qop, feeds) <= 1.0


@pytest.mark.parametrize("name", ["light_squeezenet"] + [pytest.param(os.path.basename(p)[:-5], marks=pytest.mark.slow)
                                                         for p in sorted(glob.glob(os.path.join(LIGHT, "*.onnx")))
                                                         if "squeezenet" not in p])
def test_light_models_within_one_lsb(name):
    path = os.path.join(LIGHT, f"{name}.onnx")
    float_model = qpasses.load(path)
    feeds = [random_feed(float_model, seed=s) for s in range(4)]
    # squeezenet (default suite) with the default cpu: the protected uint8 weights lowered too; the
    # big slow ones for VNNI CPUs: protect-pair-sums' emulation on random-normal feeds takes minutes there
    config = {"op_types_to_quantize": "all", **({} if name == "light_squeezenet" else {"cpu": "x86-64-vnni"})}
    qdq, qop, stats = _lowered(qpasses.quantize(path, feeds, config))
    assert stats["QLinearConv"] > 0
    assert max_lsb(qdq, qop, feeds[:2]) <= 1.0


def test_units_without_a_kernel_stay_qdq_with_a_reason():
    model = model_from_text("""
    g (float[1,4] x) => (float[1,4] y) <float s = {0.02}, uint8 z = {128}, float ys = {0.03}, uint8 yz = {0},
        float[4] b = {1,2,3,4}>
    {
      xq = QuantizeLinear(x, s, z)
      xd = DequantizeLinear(xq, s, z)
      e = Exp(xd)
      eq = QuantizeLinear(e, ys, yz)
      ed = DequantizeLinear(eq, ys, yz)
      y = Add(ed, b)
    }""")
    plan, skipped = plan_lowering(model)
    assert not plan and list(skipped.values()) == ["no QLinear kernel"]
    assert not run_pass(LowerQOperator(), model).modified


def test_format_qoperator_appends_the_lowering(tmp_path):
    assert default_pipeline(True, "static", "qoperator").endswith(",lower-qoperator,cleanup")
    cfg = qpasses.load_config({"quant_format": "QOperator"})
    assert cfg.format == "qoperator"
    from qpasses.cli import main

    onnx.save(example_model(), tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", **example_data(8))
    (tmp_path / "c.yaml").write_text("format: qoperator\n")
    assert main(["run", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q.onnx"), "--calib", str(tmp_path / "c.npz"),
                 "--config", str(tmp_path / "c.yaml"), "--quiet"]) == 0
    assert "QLinearConv" in [n.op_type for n in onnx.load(tmp_path / "q.onnx").graph.node]
