"""qpasses compare --per-layer: the provider's integers against the simulation's, in LSBs."""
import json

import numpy as np
import onnx
import pytest

from qpasses.cli import main
from qpasses.evaluation.evaluate import session
from qpasses.report import backends, provider
from qpasses.report.backends import with_outputs
from qpasses.report.layers import layers

from tests.kits import report_kit

@pytest.fixture(scope="module")
def convs():
    return report_kit.convs(8)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return report_kit.quantized_example(tmp_path_factory.mktemp("example"))


class ShiftedZeroPoint:
    """A stand-in provider: the simulation, except that the QuantizeLinear of ``TENSOR`` uses a
    zero point 2 higher than its DequantizeLinear (its integers, and what its readers see, move by
    2 LSB)."""

    name, TENSOR = "shifted", "x"

    def __init__(self, qproto, qnames):
        proto = onnx.ModelProto()
        proto.CopyFrom(qproto)
        inits = {t.name: t for t in proto.graph.initializer}
        node = next(n for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == self.TENSOR)
        zp = onnx.numpy_helper.to_array(inits[node.input[2]])
        proto.graph.initializer.append(onnx.numpy_helper.from_array(zp + np.asarray(2, zp.dtype), "shifted_zp"))
        node.input[2] = "shifted_zp"
        self.outputs, self.qnames = [o.name for o in qproto.graph.output], list(qnames)
        self.sess = session(with_outputs(proto, self.qnames), optimize=False)
        self.readable, self.dropped, self.notes = set(qnames), set(), []

    def run(self, feed):
        names = self.qnames + self.outputs
        return dict(zip(names, self.sess.run(names, feed)))

    def deployed(self, feed):
        return self.sess.run(self.outputs, feed)

    def kernel(self, qname):
        return "shifted"

    def cause(self, qname):
        return "shifted zero point"


def test_lsb_differences_first_divergence_and_inheritance(convs, monkeypatch):
    float_model, qdq, feeds = convs
    monkeypatch.setitem(provider.PROVIDERS, "shifted", ShiftedZeroPoint)
    result = provider.compare_per_layer(float_model, qdq, feeds, provider="shifted")
    rows = {r["tensor"]: r for r in result["tensors"]}
    assert list(rows) == ["x", "c1"]
    x = rows["x"]
    assert x["max_lsb"] == 2 and x["values"] == 8 * 4 * 8 * 8
    assert x["share_over_1"] > 0.9   # all but the values clipped at the top of the grid
    assert result["first_divergence"]["tensor"] == "x" and x["cause"] == "shifted zero point"
    c1 = rows["c1"]   # reads x through its DequantizeLinear: 2 LSB of x, summed by the Conv
    assert c1["upstream"] == ["x"] and c1["max_lsb"] > 1
    assert c1["cause"] == "inherits the divergence of x"
    assert x["provider_snr"] < x["sim_snr"] - 3 and c1["mean_lsb"] > 0.5
    out = result["outputs"]["y"]
    assert out["provider_snr_db"] < out["sim_snr_db"] and out["read_vs_deployed_max_abs"] == 0


def test_ort_int8_reads_the_fused_kernels_integers(convs):
    float_model, qdq, feeds = convs
    result = provider.compare_per_layer(float_model, qdq, feeds)
    rows = {r["tensor"]: r for r in result["tensors"]}
    assert rows["c1"]["kernel"] == "QLinearConv"   # DQ -> Conv -> Relu -> Q fused, Q output read
    # the simulation side is the accumulated error of the HTML report's per-layer table
    for layer in layers(float_model, qdq, feeds):
        assert rows[layer.tensor]["sim_snr"] == pytest.approx(layer.accumulated_snr, abs=1e-6)
    assert all(r["max_lsb"] <= 1 for r in rows.values()) and result["first_divergence"] is None
    assert all(abs(r["provider_snr"] - r["sim_snr"]) < 0.5 for r in rows.values())
    out = result["outputs"]["y"]
    assert out["read_vs_deployed_max_abs"] == 0   # reading the tensors changed nothing downstream
    assert abs(out["provider_snr_db"] - out["sim_snr_db"]) < 0.5
    assert "unchanged" in result["notes"][0] or "layout and data-movement ops only" in result["notes"][0]


def test_upstream_follows_float_ops_and_stops_at_quantized_tensors():
    proto = onnx.parser.parse_model("""<ir_version: 10, opset_import: ["" : 17]>
    g (float[4] a) => (float[4] y) <float s = {0.1}, uint8 z = {128}> {
      aq = QuantizeLinear (a, s, z)
      ad = DequantizeLinear (aq, s, z)
      b = Relu (ad)
      bq = QuantizeLinear (b, s, z)
      bd = DequantizeLinear (bq, s, z)
      c = Add (bd, ad)
      d = Neg (c)
      y = Mul (d, bd)
    }""")
    ups = provider.upstream(proto, {"a": "aq", "b": "bq", "y": "yq"})
    assert ups == {"a": [], "b": ["a"], "y": ["a", "b"]}


def test_cli_table_and_report(example, tmp_path, capsys):
    model, q, evals = example
    report = tmp_path / "r.json"
    assert main(["compare", str(model), str(q), "--data", str(evals), "--per-layer", "--samples", "2",
                 "--report", str(report)]) == 0
    out = capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["provider"] == "ort-int8" and data["samples"] == 2
    kernels = {r["tensor"]: r["kernel"] for r in data["tensors"]}
    assert kernels["bn1"] == kernels["bn2"] == "QLinearConv" and kernels["gap"] == "QLinearGlobalAveragePool"
    assert out.splitlines()[0].split()[:3] == ["tensor", "op", "provider"]
    assert len([line for line in out.splitlines() if line.startswith(tuple(kernels))]) >= len(kernels)
    assert "output logits: SNR vs float" in out


@pytest.mark.parametrize("extra, message", [
    (["--provider", "ort-int8"], "go with --per-layer"),
    (["--per-layer", "--samples", "0"], "at least 1"),
    (["--per-layer", "--metric", "top1"], "does not apply"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(example, tmp_path, capsys, extra, message):
    model, q, evals = example
    report = tmp_path / "r.json"
    assert main(["compare", str(model), str(q), "--data", str(evals), "--report", str(report), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not report.exists()


def test_openvino_missing_is_one_line(example, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    model, q, evals = example
    assert main(["compare", str(model), str(q), "--data", str(evals), "--per-layer", "--provider", "openvino"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "qpasses: error: --provider openvino needs OpenVINO: pip install 'qpasses[openvino]'"


@pytest.fixture(scope="module")
def vnni_example(tmp_path_factory):
    """The example quantized for VNNI CPUs only (cpu x86-64-vnni: every weight int8)."""
    folder = tmp_path_factory.mktemp("vnni")
    (folder / "vnni.json").write_text(json.dumps({"cpu": "x86-64-vnni"}))
    return report_kit.quantized_example(folder, "--config", str(folder / "vnni.json"))


def test_openvino_runs_the_qdq_model_in_u8(vnni_example):
    pytest.importorskip("openvino")
    model, q, evals = vnni_example
    result = provider.compare_per_layer(model, q, evals, provider="openvino", samples=2)
    rows = {r["tensor"]: r for r in result["tensors"]}
    assert not result["unread"] and rows["bn1"]["kernel"].startswith("Convolution u8")
    assert rows["input"]["max_lsb"] <= 1
    out = result["outputs"]["logits"]
    assert abs(out["provider_snr_db"] - out["sim_snr_db"]) < 1.0
    assert any("inference precision" in n for n in result["notes"])


@pytest.fixture(scope="module")
def uint8_example(tmp_path_factory):
    """The example with protect-pair-sums{fix=uint8}: the weights of the layers at risk stored as uint8."""
    from qpasses.core.pipeline import QUANTIZE_PIPELINE

    passes = QUANTIZE_PIPELINE.replace("protect-pair-sums", "protect-pair-sums{fix=uint8}")
    return report_kit.quantized_example(tmp_path_factory.mktemp("uint8"), "--passes", passes)


def test_openvino_names_the_layers_protect_pair_sums_left_in_float(uint8_example):
    """protect-pair-sums{fix=uint8} stores the weights of layers that could saturate without VNNI as
    uint8; OpenVINO runs uint8 weights in float (f32 or bf16), and a note says so and what to change."""
    pytest.importorskip("openvino")
    model, q, evals = uint8_example
    proto = onnx.load(q)
    protected = {n.name for n in proto.graph.node if n.op_type == "Conv"} & \
        backends.uint8_weight_readers(proto)
    assert protected, "the example has no layer protect-pair-sums changes: pick another model"
    result = provider.compare_per_layer(model, q, evals, provider="openvino", samples=2)
    note = next(n for n in result["notes"] if "protect-pair-sums" in n)
    assert all(name in note for name in protected) and "fix=grid" in note
    out = result["outputs"]["logits"]
    assert abs(out["provider_snr_db"] - out["sim_snr_db"]) < 1.0
