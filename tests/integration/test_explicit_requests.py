"""Explicit beats default, through the CLI and checked on the output graph: a tensor, node or op type
the config names is quantized as asked (with the neighbours onnxruntime's mixed-precision fixer
gives), or the run exits 2 naming it and why. Re-expressed from onnxruntime's mixed-precision fixer
and TensorQuantOverrides tests (our models and checks), plus the ``target: onnxruntime`` preset
against ``quantize_static`` itself."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.quant_utils import compute_scale_zp, get_qmin_qmax_for_qType
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

from tests.kits.example_graphs import ORT_PR_20028
from qpasses.cli import main
from qpasses.config.targets import load_target
from qpasses.quant.oprules import RULES
from qpasses.testing import parse, random_feed


class Out:
    """The output graph, read node by node: the qparams each node reads and writes through Q/DQ."""

    def __init__(self, path):
        self.proto = onnx.load(path)
        g = self.proto.graph
        self.inits = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
        self.nodes = {n.name: n for n in g.node}
        self.producer = {o: n for n in g.node for o in n.output}
        self.readers: dict[str, list] = {}
        for n in g.node:
            for i in n.input:
                self.readers.setdefault(i, []).append(n)

    def _qp(self, node) -> tuple[str, list[float], list[int]]:
        scale = self.inits[node.input[1]]
        zp = self.inits[node.input[2]] if len(node.input) > 2 else np.zeros_like(scale, np.uint8)
        return zp.dtype.name, [float(s) for s in np.ravel(scale)], [int(z) for z in np.ravel(zp)]

    def read(self, node: str, index: int = 0):
        """(type, scales, zero points) of the DequantizeLinear feeding input ``index``; None: float."""
        p = self.producer.get(self.nodes[node].input[index])
        return self._qp(p) if p is not None and p.op_type == "DequantizeLinear" else None

    def type_read(self, node: str, index: int = 0) -> str | None:
        got = self.read(node, index)
        return None if got is None else got[0]

    def written(self, node: str, index: int = 0):
        """(type, scales, zero points) of the QuantizeLinear reading output ``index``; None: float."""
        q = [r for r in self.readers.get(self.nodes[node].output[index], []) if r.op_type == "QuantizeLinear"]
        return self._qp(q[0]) if q else None


def cli(tmp_path, capsys, proto, config, feeds, name="m"):
    """``qpasses run`` on ``proto`` with ``config``: (exit code, stderr, Out or None)."""
    src, out, calib, cfg = (tmp_path / f"{name}.onnx", tmp_path / f"{name}.q.onnx", tmp_path / f"{name}.npz",
                            tmp_path / f"{name}.json")
    onnx.save(proto, src)
    np.savez(calib, **{k: np.stack([f[k] for f in feeds]) for k in feeds[0]})
    cfg.write_text(json.dumps(config))
    code = main([str(a) for a in ("run", src, "-o", out, "--calib", calib, "--config", cfg)])
    err = capsys.readouterr().err
    return code, err, (Out(out) if code == 0 else None)


def refused(tmp_path, capsys, proto, config, feeds, *fragments):
    code, err, _ = cli(tmp_path, capsys, proto, config, feeds)
    (line,) = err.strip().splitlines()
    assert code == 2 and line.startswith("qpasses: error: "), err
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert not (tmp_path / "m.q.onnx").exists()


# -- onnxruntime's mixed-precision fixer cases (PR 20028), on its own graph ------------------------------
def _seed_feeds(n=16):
    model = parse(ORT_PR_20028, opset=18)
    return model, [random_feed(model, seed=i) for i in range(n)]


# keep Relu op6 (else it merges into op5's Q) and no region growth through it: onnxruntime's plan exactly
ORT_PLAN = {"keep_removable_activations": True, "calibration": {"method": "minmax"}}
PIPELINE_NOTE = "propagate-mixed-precision extends regions through shares links by default"


def test_fixer_1_op4_out_uint16_region_and_converts(tmp_path, capsys):
    model, feeds = _seed_feeds()
    code, err, out = cli(tmp_path, capsys, model, {"activation_type": "uint8", **ORT_PLAN,
                                                   "mixed_precision": {"op4_out": "uint16"}}, feeds)
    assert code == 0, err
    # op4 (Tanh) and op5 (Mul) compute in uint16: op2_out and op3_out are converted for them
    assert out.type_read("op4") == "uint16" and out.written("op4")[0] == "uint16"
    assert out.type_read("op5", 0) == out.type_read("op5", 1) == "uint16"
    # outside the region op2_out is uint8, and op5's output goes back to uint8 for op6
    assert out.type_read("op7") == out.type_read("op8") == "uint8"
    assert out.type_read("op6") == "uint8"
    assert out.written("op2")[0] == "uint8" and out.written("op3")[0] == "uint8"


def test_fixer_with_symmetric_int16(tmp_path, capsys):
    model, feeds = _seed_feeds()
    code, err, out = cli(tmp_path, capsys, model, {"activation_type": "int8", **ORT_PLAN,
                         "mixed_precision": {"op4_out": {"quant_type": "int16", "symmetric": True}}}, feeds)
    assert code == 0, err
    for node, index in (("op4", 0), ("op5", 0), ("op5", 1)):
        qt, _, zps = out.read(node, index)
        assert qt == "int16" and zps == [0], (node, index)     # symmetric: zero point 0
    assert out.written("op4")[0] == "int16" and out.written("op4")[2] == [0]
    assert out.type_read("op6") == out.type_read("op7") == "int8"


def test_fixer_upgrade_output(tmp_path, capsys):
    model, feeds = _seed_feeds()
    code, err, out = cli(tmp_path, capsys, model, {**ORT_PLAN, "mixed_precision": {"op4_out": "uint16",
                                                                                 "output_0": "uint16"}}, feeds)
    assert code == 0, err
    assert out.type_read("op6") == "uint16" and out.written("op6")[0] == "uint16"   # no convert back
    assert out.type_read("op5", 1) == "uint16" and out.type_read("op7") == "uint8"


def test_fixer_upgrade_input(tmp_path, capsys):
    model, feeds = _seed_feeds()
    code, err, out = cli(tmp_path, capsys, model, {**ORT_PLAN, "mixed_precision": {"op4_out": "uint16",
                                                                                 "input_0": "uint16"}}, feeds)
    assert code == 0, err
    assert out.type_read("op1") == "uint16" and out.written("op1")[0] == "uint16"
    assert out.type_read("op3") == "uint8"          # op1_out converted back to uint8 for op3
    assert out.type_read("op4") == out.type_read("op5", 0) == out.type_read("op5", 1) == "uint16"


def test_seed_request_with_the_default_config(tmp_path, capsys):
    """The issue's case: the default config, element-wise ops float by default, still honours it."""
    model, feeds = _seed_feeds()
    code, err, out = cli(tmp_path, capsys, model, {"activation_type": "uint8",
                                                   "mixed_precision": {"op4_out": "uint16"}}, feeds)
    assert code == 0, err
    assert out.written("op4")[0] == "uint16" and out.type_read("op4") == "uint16"
    assert out.type_read("op5", 0) == out.type_read("op5", 1) == "uint16"


def test_request_nothing_can_carry_is_refused(tmp_path, capsys):
    model, feeds = _seed_feeds(4)
    refused(tmp_path, capsys, model, {"mixed_precision": {"output_1": "uint16"}}, feeds,
            "mixed_precision['output_1']: cannot be quantized: Cos 'op7' has no quantization rule")


# -- onnxruntime's TensorQuantOverrides cases: Sigmoid -> Conv, with the DEFAULT op selection ------------
WEIGHT = np.array([[[-1.0, -2.0], [1.0, 2.0]], [[-0.5, -1.5], [0.5, 1.5]]], np.float32)   # [2, 2, 2]
BIAS = np.array([0.0, 1.0], np.float32)


def sigmoid_conv():
    w = ", ".join(str(v) for v in WEIGHT.ravel())
    return parse(f"""
    g (float[1,2,3] INP) => (float[1,2,2] OUT) <float[2,2,2] WGT = {{{w}}}, float[2] BIAS = {{0.0, 1.0}}> {{
      [sig] SIG_OUT = Sigmoid (INP)
      [conv] OUT = Conv (SIG_OUT, WGT, BIAS)
    }}""", opset=13)


FEEDS = [{"INP": np.array([[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]], np.float32)}]
AS_ORT = {"weight_type": "uint8", "per_channel": False, "calibration": {"method": "minmax"}}


def ort_qparams(rmin, rmax, onnx_type, symmetric=False, reduce_range=False):
    qmin, qmax = get_qmin_qmax_for_qType(onnx_type, reduce_range=reduce_range, symmetric=symmetric)
    zp, scale = compute_scale_zp(np.float32(rmin), np.float32(rmax), qmin, qmax, symmetric=symmetric)
    return [float(np.float32(scale))], [int(zp)]


def test_overrides_scale_zero_point_on_sigmoid_output_and_weight_bias_types(tmp_path, capsys):
    config = {**AS_ORT, "tensor_overrides": {
        "SIG_OUT": [{"scale": 1.0, "zero_point": 127}],
        "WGT": [{"quant_type": "int8", "symmetric": True, "reduce_range": True}],
        "BIAS": [{"quant_type": "int8", "symmetric": True, "reduce_range": True}]}}
    code, err, out = cli(tmp_path, capsys, sigmoid_conv(), config, FEEDS)
    assert code == 0, err
    assert out.read("conv", 0) == ("uint8", [1.0], [127])          # the search may not take it back
    for name, index, values in (("WGT", 1, WEIGHT), ("BIAS", 2, BIAS)):   # an overridden bias is a weight
        scales, zps = ort_qparams(values.min(), values.max(), onnx.TensorProto.INT8, True, True)
        qt, got_scales, got_zps = out.read("conv", index)
        assert qt == "int8" and got_zps == zps and np.float32(got_scales[0]) == np.float32(scales[0]), name


def test_overrides_rmin_rmax_on_sigmoid_output(tmp_path, capsys):
    code, err, out = cli(tmp_path, capsys, sigmoid_conv(),
                         {**AS_ORT, "tensor_overrides": {"SIG_OUT": [{"rmin": 0.0, "rmax": 0.5}]}}, FEEDS)
    assert code == 0, err
    scales, zps = ort_qparams(0.0, 0.5, onnx.TensorProto.UINT8)
    qt, got_scales, got_zps = out.read("conv", 0)
    assert qt == "uint8" and got_zps == zps and np.float32(got_scales[0]) == np.float32(scales[0])


def test_overrides_rmin_rmax_and_scale_zero_point_on_weight(tmp_path, capsys):
    code, err, out = cli(tmp_path, capsys, sigmoid_conv(),
                         {**AS_ORT, "tensor_overrides": {"WGT": [{"rmin": 0.0, "rmax": 1.0}]}}, FEEDS)
    assert code == 0, err
    scales, zps = ort_qparams(0.0, 1.0, onnx.TensorProto.UINT8)
    assert out.read("conv", 1) == ("uint8", [pytest.approx(scales[0])], zps)
    code, err, out = cli(tmp_path, capsys, sigmoid_conv(),
                         {**AS_ORT, "tensor_overrides": {"WGT": [{"scale": 0.5, "zero_point": 4}]}}, FEEDS)
    assert code == 0, err
    assert out.read("conv", 1) == ("uint8", [0.5], [4])


def test_overrides_per_channel_scale_zero_point_on_weight_and_bias(tmp_path, capsys):
    per_channel = [{"axis": 0, "scale": 0.5, "zero_point": 2}, {"scale": 0.2, "zero_point": 4}]
    code, err, out = cli(tmp_path, capsys, sigmoid_conv(), {
        "weight_type": "int8", "tensor_overrides": {"WGT": per_channel, "BIAS": per_channel}}, FEEDS)
    assert code == 0, err
    assert out.read("conv", 1) == ("int8", [0.5, pytest.approx(0.2)], [2, 4])
    assert out.read("conv", 2) == ("int8", [0.5, pytest.approx(0.2)], [2, 4])


def test_overrides_per_channel_ranges_that_differ_are_refused(tmp_path, capsys):
    refused(tmp_path, capsys, sigmoid_conv(), {"tensor_overrides": {"WGT": [
        {"axis": 0, "quant_type": "uint8", "rmin": 0.0, "rmax": 1.0},
        {"quant_type": "uint8", "rmin": 0.2, "rmax": 0.8}]}}, FEEDS,
        "tensor_overrides['WGT']: channel 1: per-channel 'rmin' must be the same")


def test_16bit_overrides_on_input_and_sigmoid_output(tmp_path, capsys):
    config = {**AS_ORT, "tensor_overrides": {"INP": [{"quant_type": "uint16"}], "SIG_OUT": [{"quant_type": "uint16"}]}}
    code, err, out = cli(tmp_path, capsys, sigmoid_conv(), config, FEEDS)
    assert code == 0, err
    assert out.type_read("sig") == "uint16" and out.type_read("conv") == "uint16"
    assert out.written("conv")[0] == "uint8"
    qdq = [n for n in out.proto.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert qdq and all(n.domain == "" for n in qdq) and out.proto.opset_import[0].version >= 21


@pytest.mark.parametrize("overrides, fragment", [
    ({"NON_EXISTING": [{"rmin": 0.0, "rmax": 0.5}]}, "tensor_overrides['NON_EXISTING']: no such tensor"),
    ({"SIG_OUT": [{"scale": 0.1}]}, "'scale' given without 'zero_point'"),
    ({"SIG_OUT": [{"scale": 0.1, "zero_point": 0, "rmax": 10.0}]}, "'rmax' contradict(s) the fixed"),
    ({"SIG_OUT": [{"scale": 0.1, "zero_point": 0, "symmetric": True}]}, "'symmetric' contradict(s) the fixed"),
])
def test_override_validation(tmp_path, capsys, overrides, fragment):
    refused(tmp_path, capsys, sigmoid_conv(), {"tensor_overrides": overrides}, FEEDS, fragment)


# -- QNN's fixed Sigmoid/Tanh output qparams and 8-bit MatMul weights beside 16-bit inputs --------------
@pytest.mark.parametrize("op, scale, zp", [("Sigmoid", 1 / 65536, 0), ("Tanh", 1 / 32768, 32768)])
@pytest.mark.parametrize("how", ["default", "mixed_precision"])
def test_qnn_16bit_sigmoid_tanh_outputs_get_fixed_qparams(tmp_path, capsys, op, scale, zp, how):
    model = parse(f"""g (float[1,2,3] input_0) => (float[1,2,3] output_0) {{
      [Abs_0] abs_out = Abs (input_0)
      [{op}_0] output_0 = {op} (abs_out)
    }}""", opset=18)
    config = ({"target": "qnn", "activation_type": "uint16"} if how == "default"
              else {"target": "qnn", "activation_type": "uint8", "mixed_precision": {"output_0": "uint16"}})
    code, err, out = cli(tmp_path, capsys, model, config, [random_feed(model, seed=i) for i in range(4)])
    assert code == 0, err
    assert out.written(f"{op}_0") == ("uint16", [scale], [zp])


def test_qnn_matmul_weight_stays_8bit_beside_a_16bit_input(tmp_path, capsys):
    model = parse("""g (float[2,3] input_0) => (float[2,2] output_0) <float[3,2] weight = {0.1, 0.7, 0.3, 0.9, 0.5, 0.2}> {
      [Abs_0] abs_0_out = Abs (input_0)
      [MatMul_0] matmul_0_out = MatMul (abs_0_out, weight)
      [Abs_1] output_0 = Abs (matmul_0_out)
    }""", opset=18)
    config = {"target": "qnn", "activation_type": "uint8", "weight_type": "uint8",
              "mixed_precision": {"abs_0_out": "uint16"}}
    code, err, out = cli(tmp_path, capsys, model, config, [random_feed(model, seed=i) for i in range(4)])
    assert code == 0, err
    assert out.type_read("MatMul_0", 0) == "uint16" and out.type_read("MatMul_0", 1) == "uint8"


# -- named nodes and op types --------------------------------------------------------------------------
NODES = """
g (float[1,4] x, float[4,4] z) => (float[1,4] y, float[1,4] a2)
  <float[4,4] w = {0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6}, float lo = {-0.5}, float hi = {0.5}> {
  [mm] h = MatMul (x, w)
  [tanh] t = Tanh (h)
  [cos] c = Cos (t)
  [att] a = MatMul (c, z)
  [clip] y = Clip (a, lo, hi)
  [ex] a2 = Exp (t)
}"""


def _nodes_model():
    model = parse(NODES, opset=17)
    return model, [random_feed(model, seed=i) for i in range(8)]


def test_named_nodes_are_quantized_whatever_their_type(tmp_path, capsys):
    """A Tanh (element-wise: float by default) and a MatMul of two activations (float by default)."""
    model, feeds = _nodes_model()
    code, err, out = cli(tmp_path, capsys, model, {"nodes_to_quantize": ["tanh", "att"]}, feeds)
    assert code == 0, err
    assert out.type_read("tanh") == "uint8" and out.written("tanh")[0] == "uint8"
    assert out.type_read("att", 0) == out.type_read("att", 1) == "uint8"
    assert out.type_read("mm", 0) is None            # not named: nodes_to_quantize selects only those named


def test_override_on_a_tensor_only_a_default_float_op_reads_quantizes_that_op(tmp_path, capsys):
    model, feeds = _nodes_model()
    code, err, out = cli(tmp_path, capsys, model, {"tensor_overrides": {"c": [{"rmin": -1.0, "rmax": 1.0}]}}, feeds)
    assert code == 0, err
    qt, scales, zps = out.read("att", 0)
    expected_scales, expected_zps = ort_qparams(-1.0, 1.0, onnx.TensorProto.UINT8)
    assert qt == "uint8" and zps == expected_zps and np.float32(scales[0]) == np.float32(expected_scales[0])


@pytest.mark.parametrize("config, fragment", [
    ({"nodes_to_quantize": ["cos"]}, "nodes_to_quantize: 'cos' is a Cos, which qpasses has no quantization rule for"),
    ({"nodes_to_quantize": ["tanh"], "nodes_to_exclude": ["tanh"]}, "nodes_to_quantize: 'tanh' is also in nodes_to_exclude"),
    ({"nodes_to_quantize": ["tanh"], "op_types_to_quantize": ["MatMul"]},
     "nodes_to_quantize: 'tanh' is a Tanh, which op_types_to_quantize does not list"),
    ({"op_types_to_quantize": ["MatMul", "Exp"]}, "op_types_to_quantize: qpasses has no quantization rule for Exp (node 'ex')"),
    ({"tensor_overrides": {"lo": [{"quant_type": "uint8"}]}},
     "tensor_overrides['lo']: cannot be quantized: Clip 'clip' reads it as a float value"),
    ({"mixed_precision": {"a2": "uint16"}}, "mixed_precision['a2']: cannot be quantized: Exp 'ex' has no quantization rule"),
    ({"tensor_overrides": {"w": [{"quant_type": "int8"}]}, "nodes_to_exclude": ["mm"]},
     "tensor_overrides['w']: cannot be quantized: MatMul 'mm' is in nodes_to_exclude"),
])
def test_what_cannot_be_honoured_exits_2_naming_it(tmp_path, capsys, config, fragment):
    model, feeds = _nodes_model()
    refused(tmp_path, capsys, model, config, feeds, fragment)


def test_int_tensor_override_is_refused(tmp_path, capsys):
    model = parse("""g (float[2,3] x) => (float[3,2] y) <int64[2] shape = {3, 2}> {
      [rs] y = Reshape (x, shape)
    }""")
    refused(tmp_path, capsys, model, {"tensor_overrides": {"shape": [{"quant_type": "uint8"}]}},
            [random_feed(model)], "tensor_overrides['shape']: cannot be quantized: not a float tensor")


def test_named_data_movement_between_float_ops_keeps_its_qdq(tmp_path, capsys):
    """A Reshape between float ops is an island the default drops; a request keeps it."""
    model = parse("""g (float[2,3] x) => (float[3,2] y) <int64[2] shape = {3, 2}> {
      [e] a = Exp (x)
      [rs] r = Reshape (a, shape)
      [n] y = Neg (r)
    }""")
    code, err, out = cli(tmp_path, capsys, model, {"mixed_precision": {"r": "uint16"}},
                         [random_feed(model, seed=i) for i in range(4)])
    assert code == 0, err
    assert out.type_read("rs") == "uint16" and out.type_read("n") == "uint16"


# -- target: onnxruntime reproduces quantize_static's node selection -----------------------------------
def test_preset_lists_every_op_onnxruntime_quantizes_that_has_a_rule():
    ort_ops = set(QDQRegistry) | set(QLinearOpsRegistry)
    listed = set(load_target("onnxruntime").defaults["op_types_to_quantize"])
    assert listed == ort_ops & set(RULES)
    assert ort_ops - set(RULES) <= {"ArgMax", "CumSum", "EmbedLayerNormalization"}   # named in the preset


class _Reader(CalibrationDataReader):
    def __init__(self, feeds):
        self.it = iter(feeds)

    def get_next(self):
        return next(self.it, None)


def _placement(out: Out) -> dict:
    """Node -> (inputs read through a DQ, outputs read by a Q), for the model's own nodes."""
    placed = {}
    for name, node in out.nodes.items():
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        ins = tuple(out.read(name, i) is not None for i in range(len(node.input)) if node.input[i])
        outs = tuple(out.written(name, j) is not None for j in range(len(node.output)))
        placed[name] = (ins, outs)
    return placed


def _rich_model():
    rng = np.random.default_rng(0)

    def arr(n, scale=0.3):
        return "{" + ", ".join(f"{v:.4f}" for v in rng.standard_normal(n) * scale) + "}"
    return parse(f"""
    g (float[1,3,8,8] x, int64[1,4] ids) => (float[1,8,16] y, float[1,4,6] e, float[1,8,8,8] z) <
      float[8,3,3,3] w = {arr(216)}, float[8] b = {arr(8)}, float[10,6] table = {arr(60)},
      float[16,16] wm = {arr(256)}, float[16] lg = {arr(16, 1)}, float[16] lb = {arr(16)},
      int64[3] shp = {{1, 8, 16}}, float[4] sc = {{1.0, 1.0, 2.0, 2.0}}, float k = {{0.5}}> {{
      [conv] c = Conv <pads = [1,1,1,1]> (x, w, b)
      [relu] r = Relu (c)
      [pool] p = MaxPool <kernel_shape = [2,2], strides = [2,2]> (r)
      [rs] u = Resize <mode = "nearest"> (p, "", sc)
      [tanh] z0 = Tanh (u)
      [sub] z = Sub (z0, r)
      [flat] f = Reshape (p, shp)
      [mm] m = MatMul (f, wm)
      [tr] t = Transpose <perm = [0, 2, 1]> (m)
      [att] a = MatMul (m, t)
      [sm] s = Softmax <axis = -1> (a)
      [av] v = MatMul (s, m)
      [ln] l = LayerNormalization <axis = -1> (v, lg, lb)
      [mul] q = Mul (l, k)
      [sig] y = Sigmoid (q)
      [gat] e0 = Gather (table, ids)
      [div] e = Div (e0, k)
    }}""", opset=17)


@pytest.mark.parametrize("which", ["seed", "rich"])
def test_preset_gives_quantize_statics_qdq_placement(tmp_path, capsys, which):
    model = parse(ORT_PR_20028, opset=18) if which == "seed" else _rich_model()
    feeds = [random_feed(model, seed=i) for i in range(4)]
    code, err, ours = cli(tmp_path, capsys, model, {"target": "onnxruntime"}, feeds)
    assert code == 0, err
    quantize_static(str(tmp_path / "m.onnx"), str(tmp_path / "ort.onnx"), _Reader(feeds),
                    quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    theirs = Out(tmp_path / "ort.onnx")
    assert _placement(ours) == _placement(theirs)
    if which == "rich":   # and the same types: uint8 activations, int8 per-tensor symmetric weights
        assert ours.read("conv", 1)[0] == "int8" and len(ours.read("conv", 1)[1]) == 1 and ours.read("conv", 1)[2] == [0]


# -- policies that leave tensors float give way to a request -------------------------------------------
CONCAT = """g (float[1,4] x) => (float[1,8] y) <float s = {0.001}> {
  [small] a = Mul (x, s)
  [cat] y = Concat <axis = 1> (x, a)
}"""


@pytest.mark.parametrize("config, quantized", [
    ({"op_types_to_quantize": ["Concat"]}, False),                       # one grid would erase 'a': float
    ({"op_types_to_quantize": ["Concat"], "tensor_overrides": {"y": [{"quant_type": "uint8"}]}}, True),
    ({"mixed_precision": {"y": "uint16"}}, True),
    ({"target": "onnxruntime"}, True),                                    # quantize_static's graph
])
def test_mixed_range_concat_output_is_quantized_when_asked(tmp_path, capsys, config, quantized):
    model = parse(CONCAT)
    code, err, out = cli(tmp_path, capsys, model, config, [random_feed(model, seed=i) for i in range(4)])
    assert code == 0, err
    assert (out.written("cat") is not None) is quantized


def test_a_request_without_a_range_is_refused_not_dropped():
    from qpasses.errors import ConfigError
    from qpasses.passes.annotate_types import AnnotateTypes
    from qpasses.passes.compute_qparams import ComputeQParams
    from qpasses.testing import model_from_text, run_pass

    model = model_from_text("g (float[1,4] x) => (float[1,4] y) { [t] a = Tanh (x)  [n] y = Neg (a) }")
    config = {"tensor_overrides": {"a": [{"quant_type": "uint16"}]}}
    run_pass(AnnotateTypes(), model, config)
    assert model.quant["a"].qtype == "uint16"
    with pytest.raises(ConfigError, match=r"tensor_overrides\['a'\]: cannot be quantized: no calibrated range"):
        run_pass(ComputeQParams(), model, config)   # no calibration ran: nothing gives 'a' a range


def test_a_missed_target_says_the_requests_were_not_promoted(tmp_path, capsys):
    """A fixed scale of 1.0 on a Sigmoid output costs the target; the search may not undo it, and says so."""
    code, err, out = cli(tmp_path, capsys, sigmoid_conv(), {"tensor_overrides": {"SIG_OUT": [{"scale": 1.0, "zero_point": 127}]}},
                         FEEDS)
    assert code == 0, err
    assert out.read("conv", 0) == ("uint8", [1.0], [127]) and out.read("conv", 1) is not None
    (warning,) = [line for line in err.splitlines() if "warning: search-precision" in line]
    assert "kept as the config asks, never promoted: SIG_OUT, WGT" in warning


CORPUS = pathlib.Path.home() / ".cache" / "qp-corpus"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ppocr_v2_cls", "ppocr_v4_rec", "ppocr_v4_det", "ddddocr_det"])
def test_preset_gives_quantize_statics_qdq_placement_on_real_models(tmp_path, capsys, name):
    """On the shared corpus models, folded first as qpasses folds (quantize_static folds no BatchNorm)."""
    import qpasses

    if not (CORPUS / "models" / f"{name}.onnx").exists():
        pytest.skip("the shared corpus is not built")
    folded = qpasses.run_pipeline(str(CORPUS / "models" / f"{name}.onnx"),
                                  "fold-constants,fold-batchnorm,cleanup")[0].to_proto(metadata=False)
    data = np.load(CORPUS / "calib" / f"{name}.npz")
    feeds = [{k: data[k][i] for k in data.files} for i in range(4)]
    code, err, ours = cli(tmp_path, capsys, folded, {"target": "onnxruntime"}, feeds)
    assert code == 0, err
    quantize_static(str(tmp_path / "m.onnx"), str(tmp_path / "ort.onnx"), _Reader(feeds),
                    quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    assert _placement(ours) == _placement(Out(tmp_path / "ort.onnx"))
