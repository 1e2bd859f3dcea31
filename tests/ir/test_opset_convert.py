"""Raising old opsets without changing results (qpasses.ir.opset_convert, upgrade.prepare_opset): each
rewrite checked in onnxruntime against the original model, and the CLI on opset-10 models with
Resize and Split and default per-channel weights."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from qpasses.cli import main
from qpasses.errors import ModelError
from qpasses.ir.model import from_proto
from qpasses.ir.opset_convert import convert, resize_modes
from qpasses.quant.qdq import require_opset
from qpasses.quant.upgrade import upgrade_opset
from qpasses.testing import parse


def _run(proto: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _same(before: onnx.ModelProto, after: onnx.ModelProto, shape=(1, 2, 7, 9), seed=0) -> None:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    for ref, got in zip(_run(before, x), _run(after, x), strict=True):
        assert ref.shape == got.shape
        np.testing.assert_array_equal(got, ref)


def _opset(proto: onnx.ModelProto) -> int:
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def resize10(mode: str, scales) -> onnx.ModelProto:
    values = ", ".join(str(float(s)) for s in scales)
    return parse(f"""
    g (float[1,2,7,9] x) => (float[1,2,?,?] y) <float[4] s = {{{values}}}> {{
      [rs] y = Resize <mode = "{mode}"> (x, s)
    }}""", opset=10, ir_version=6)


SCALES = [(1, 1, 2, 2), (1, 1, 3, 2.5), (1, 1, 1.3, 1.7), (1, 1, 0.5, 0.6), (1, 1, 0.3, 0.45), (1, 1, 1, 1)]


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize10_keeps_its_results(mode, scales, opset):
    before = resize10(mode, scales)
    after = convert(before, opset)
    assert _opset(after) == opset
    onnx.checker.check_model(after, full_check=True)
    _same(before, after)


def test_plain_version_converter_changes_linear_resize10():
    """Why qpasses rewrites Resize itself: the converter's opset-11 defaults change linear results."""
    before = resize10("linear", (1, 1, 2, 2))
    after = onnx.version_converter.convert_version(before, 13)
    x = np.random.default_rng(0).standard_normal((1, 2, 7, 9)).astype(np.float32)
    assert not np.allclose(_run(before, x)[0], _run(after, x)[0])


def test_rewritten_resize_attributes_and_absent_roi():
    after = convert(resize10("nearest", (1, 1, 0.5, 0.6)), 13)
    (node,) = after.graph.node      # the converter's roi constant is dropped with the roi
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"mode": b"nearest", "coordinate_transformation_mode": b"asymmetric", "nearest_mode": b"ceil"}
    assert node.input[1] == ""
    eleven = convert(resize10("nearest", (1, 1, 2, 2)), 11)
    assert [n.op_type for n in eleven.graph.node] == ["Constant", "Resize"]   # roi is required at 11


@pytest.mark.parametrize("text, fragment", [
    ("""g (float[1,2,7,9] x) => (float[1,2,?,?] y) <float[4] s = {1.0, 1.0, 2.0, 0.5}> {
          [rs] y = Resize <mode = "nearest"> (x, s)
        }""", "node 'rs' (Resize, nearest) enlarges some axes and shrinks others"),
    ("""g (float[1,2,7,9] x, float[4] s) => (float[1,2,?,?] y) {
          [rs] y = Resize <mode = "nearest"> (x, s)
        }""", "node 'rs' (Resize, nearest) has scales computed at run time"),
])
def test_nearest_resize_without_one_opset11_form_is_named(text, fragment):
    proto = parse(text, opset=10, ir_version=6)
    assert isinstance(resize_modes(proto)["y"], str)
    with pytest.raises(ModelError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        convert(proto, 13)


def test_linear_resize_with_runtime_scales_converts():
    proto = parse("""g (float[1,2,7,9] x, float[4] s) => (float[1,2,?,?] y) {
          [rs] y = Resize <mode = "linear"> (x, s)
        }""", opset=10, ir_version=6)
    after = convert(proto, 13)
    x = np.random.default_rng(1).standard_normal((1, 2, 7, 9)).astype(np.float32)
    feed = {"x": x, "s": np.array([1, 1, 1.5, 2], np.float32)}
    run = [ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
           for p in (proto, after)]
    np.testing.assert_array_equal(run[1], run[0])


@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_hardmax_keeps_its_2d_meaning_at_13(axis):
    before = parse(f"""g (float[1,2,7,9] x) => (float[1,2,7,9] y) {{
          [hm] y = Hardmax <axis = {axis}> (x)
        }}""", opset=10, ir_version=6)
    after = convert(before, 13)
    onnx.checker.check_model(after, full_check=True)
    assert "hm" in {n.name for n in after.graph.node}
    _same(before, after)


@pytest.mark.parametrize("body", [
    "[sp] a, b = Split <axis = 1, split = [1, 1]> (x)\n y = Add (a, b)",
    "[sq] u = Unsqueeze <axes = [0]> (x)\n y = Squeeze <axes = [0]> (u)",
    "[rd] r = ReduceSum <axes = [2], keepdims = 1> (x)\n y = Add (x, r)",
    "[sm] y = Softmax <axis = 1> (x)",
    "[ls] y = LogSoftmax <axis = 2> (x)",
    "[cl] y = Clip <min = -0.5, max = 0.7> (x)",
    "[pd] p = Pad <pads = [0, 0, 1, 2, 0, 0, 2, 1], value = 1.5> (x)\n y = Slice (p, st, en, ax)",
])
def test_other_ops_whose_form_changes_by_13_keep_their_results(body):
    before = parse(f"""g (float[1,2,7,9] x) => (float[1,2,7,9] y)
        <int64[2] st = {{1, 2}}, int64[2] en = {{8, 11}}, int64[2] ax = {{2, 3}}> {{
          {body}
        }}""", opset=10, ir_version=6)
    model = from_proto(before)
    assert require_opset(model, 13) and model.opset == 13
    _same(before, model.to_proto(metadata=False))


@pytest.mark.parametrize("opset, mode", [(9, "linear"), (9, "nearest"), (7, "linear")])
def test_upsample_below_10_keeps_its_results(opset, mode):
    call = f'<mode = "{mode}"> (x, s)' if opset == 9 else f'<mode = "{mode}", scales = [1.0, 1.0, 2.0, 1.5]> (x)'
    before = parse(f"""g (float[1,2,7,9] x) => (float[1,2,14,13] y) <float[4] s = {{1.0, 1.0, 2.0, 1.5}}> {{
          [up] y = Upsample {call}
        }}""", opset=opset, ir_version=4)
    after, notice = upgrade_opset(before)
    assert _opset(after) == 11 and "from opset" in notice
    _same(before, after)


def test_upsample_without_an_opset11_form_goes_to_10_with_the_reason():
    before = parse("""g (float[1,2,8,8] x) => (float[1,2,16,12] y) <float[4] s = {1.0, 1.0, 2.0, 1.5}> {
          t = Identity (s)
          [up] y = Upsample <mode = "nearest"> (x, t)
        }""", opset=9, ir_version=4)
    after, notice = upgrade_opset(before)
    assert _opset(after) == 10 and "to 10 (not 11: node 'up' (Upsample, nearest) has scales computed" in notice
    _same(before, after, shape=(1, 2, 8, 8))


# -- through the CLI: the opset-10 model ------------------------------------------------------
def opset10_model(scales=(1, 1, 2, 2), mode="nearest") -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = ", ".join(f"{v:.3f}" for v in rng.standard_normal(4 * 3 * 9) * 0.3)
    w2 = ", ".join(f"{v:.3f}" for v in rng.standard_normal(2 * 3))
    values = ", ".join(str(float(s)) for s in scales)
    return parse(f"""
    g (float[1,3,8,8] x) => (float[1,1,?,?] a, float[1,2,?,?] y)
      <float[4,3,3,3] w = {{{w}}}, float[4] b = {{0.1, -0.2, 0.3, 0.05}}, float[4] s = {{{values}}},
       float[2,3,1,1] w2 = {{{w2}}}> {{
      [conv] c = Conv <pads = [1, 1, 1, 1]> (x, w, b)
      [relu] r = Relu (c)
      [rs] u = Resize <mode = "{mode}"> (r, s)
      [sp] a, b2 = Split <axis = 1, split = [1, 3]> (u)
      [conv2] y = Conv (b2, w2)
    }}""", opset=10, ir_version=6)


def _cli(tmp_path, capsys, proto, config=None):
    src, out, calib = tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "calib.npz"
    onnx.save(proto, src)
    np.savez(calib, x=np.random.default_rng(1).standard_normal((8, 1, 3, 8, 8)).astype(np.float32))
    args = ["run", src, "-o", out, "--calib", calib]
    if config is not None:
        (tmp_path / "cfg.json").write_text(json.dumps(config))
        args += ["--config", tmp_path / "cfg.json"]
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err, out


def _weight_axes(proto: onnx.ModelProto) -> dict[str, int | None]:
    out = {}
    for node in proto.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in ("w_quantized", "w2_quantized"):
            axis = [helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"]
            out[node.input[0]] = axis[0] if axis else None
    return out


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_opset10_resize_and_split_quantize_per_channel_at_13(tmp_path, capsys, mode):
    float_model = opset10_model(mode=mode)
    code, err, out = _cli(tmp_path, capsys, float_model, {"calibration": {"method": "minmax"}})
    assert code == 0, err
    assert "raised from opset 10 to 13 for per-channel weights; its Resize, Split nodes rewritten" in err
    q = onnx.load(out)
    onnx.checker.check_model(q, full_check=True)
    assert _opset(q) == 13 and _weight_axes(q) == {"w_quantized": 0, "w2_quantized": 0}
    resize = next(n for n in q.graph.node if n.op_type == "Resize")
    assert helper.get_attribute_value(next(a for a in resize.attribute if a.name == "coordinate_transformation_mode")) \
        == b"asymmetric"
    # the float model raised the same way computes what the original does
    model = from_proto(float_model)
    require_opset(model, 13)
    _same(float_model, model.to_proto(metadata=False), shape=(1, 3, 8, 8))


def test_opset10_resize_without_an_opset13_form_gets_per_tensor_weights(tmp_path, capsys):
    code, err, out = _cli(tmp_path, capsys, opset10_model(scales=(1, 1, 2, 0.5)))
    assert code == 0, err
    notice = [line for line in err.splitlines() if "weights per-tensor" in line]
    assert len(notice) == 1 and "node 'rs' (Resize, nearest) enlarges some axes and shrinks others" in notice[0]
    q = onnx.load(out)
    assert _opset(q) == 10 and _weight_axes(q) == {"w_quantized": None, "w2_quantized": None}


@pytest.mark.parametrize("config", [{"per_channel": True},
                                    {"tensor_overrides": {"w": [{"axis": 0, "quant_type": "int8"}]}}])
def test_asked_per_channel_that_cannot_be_expressed_is_refused(tmp_path, capsys, config):
    code, err, out = _cli(tmp_path, capsys, opset10_model(scales=(1, 1, 2, 0.5)), config)
    assert code == 2 and not out.exists()
    (line,) = err.strip().splitlines()
    assert line.startswith("qpasses: error: ") and "need opset 13" in line and "node 'rs'" in line
