"""qpasses.analysis.saturation: which weight pairs onnxruntime's U8S8 kernels sum in int16 without
VNNI, on crafted codes (numpy only); and, under ``qemu-x86_64 -cpu Haswell`` (slow), that the
kernels pair exactly those."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses.analysis.saturation import (PairLayer, PairSums, clip_pairs, from_k_rows, k_rows, pair_limits, pair_safe_scale,
                                         qdq_layers, risks, risky_pairs, row_channels, table_layers)
from qpasses.evaluation.evaluate import session
from qpasses.ir.model import from_proto
from qpasses.testing import run_passes


def _conv_codes(c_out, c_in, k, hits, value=100):
    w = np.zeros((c_out, c_in, k, k), np.int32)
    for index in hits:
        w[index] = value
    return w


@pytest.mark.parametrize("op,shape,transposed", [("Conv", (6, 3, 3, 3), False), ("Conv", (4, 5, 1, 1), False),
                                                 ("MatMul", (7, 5), False), ("MatMul", (2, 7, 5), False),
                                                 ("Gemm", (7, 5), False), ("Gemm", (5, 7), True)])
def test_k_rows_round_trip(op, shape, transposed):
    codes = np.arange(np.prod(shape)).reshape(shape)
    rows = k_rows(codes, op, transposed)
    assert np.array_equal(from_k_rows(rows, shape, op, transposed), codes)
    assert rows.shape[0] == len(row_channels(shape, op, transposed))


@pytest.mark.parametrize("hits,risky", [
    ([(0, 0, 0, 0), (0, 1, 0, 0)], True),    # input channels 0 and 1 at one kernel position: k = 0, 1
    ([(0, 1, 0, 0), (0, 2, 0, 0)], False),   # k = 1, 2: two pairs
    ([(0, 0, 0, 0), (0, 0, 0, 1)], False),   # one channel at two positions: k = 0, 4
    ([(0, 3, 0, 0), (0, 0, 0, 1)], False),   # k = 3, 4
    ([(0, 2, 1, 1), (0, 3, 1, 1)], True),    # k = 18, 19
])
def test_conv_pairs_follow_nhwc_im2col(hits, risky):
    rows = k_rows(_conv_codes(2, 4, 3, hits), "Conv")
    assert risky_pairs(rows).any() == risky
    assert not risky_pairs(rows)[1].any()


def test_odd_input_channels_pair_across_kernel_positions():
    # C_in = 3: k = position * 3 + c, so channel 2 at position 0 (k = 2) pairs with channel 0 at position 1 (k = 3)
    assert risky_pairs(k_rows(_conv_codes(1, 3, 3, [(0, 2, 0, 0), (0, 0, 0, 1)]), "Conv")).any()
    assert not risky_pairs(k_rows(_conv_codes(1, 3, 3, [(0, 1, 0, 0), (0, 2, 0, 0)]), "Conv")).any()


def test_matmul_pairs_along_k_and_odd_k_pairs_the_last_with_zero():
    w = np.zeros((7, 2), np.int32)
    w[[5, 6], 0] = 127
    assert not risky_pairs(k_rows(w, "MatMul")).any()   # (4, 5), (6, -)
    w[4, 0] = 127
    assert risky_pairs(k_rows(w, "MatMul"))[0].tolist() == [False, False, True, False]


def test_bounds_of_same_sign_pairs():
    assert pair_limits() == (128, -128)
    rows = np.array([[64, 64, 65, 64, -64, -64, -65, -64, 127, -128, -128, 0]])
    assert risky_pairs(rows)[0].tolist() == [False, True, False, True, False, False]
    assert not risky_pairs(rows, top=254).any()   # 254 * 129 = 32766


@pytest.mark.parametrize("op,shape,attrs", [("Conv", (8, 6, 3, 3), {}), ("MatMul", (12, 8), {}),
                                            ("Gemm", (8, 12), {"transB": 1})])
def test_pair_safe_scale_widens_only_the_channels_at_risk_just_enough(op, shape, attrs):
    import onnx_graphsurgeon as gs

    rng = np.random.default_rng(5)
    w = rng.laplace(0, 0.2, shape)
    node = gs.Node(op, attrs=attrs)
    axis = 0 if op == "Conv" or attrs else 1
    scale = np.abs(np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)).max(1) / 127
    codes = lambda s: np.rint(w / np.expand_dims(s, tuple(i for i in range(w.ndim) if i != axis)))  # noqa: E731
    rows = lambda c: k_rows(c.astype(np.int32), op, bool(attrs))                                    # noqa: E731
    at_risk = np.zeros(scale.size, bool)
    np.logical_or.at(at_risk, row_channels(shape, op, bool(attrs)), risky_pairs(rows(codes(scale))).any(1))
    safe = pair_safe_scale(w, node, scale)
    assert at_risk.any() and not risky_pairs(rows(codes(safe))).any()
    assert (safe[~at_risk] == scale[~at_risk]).all() and (safe[at_risk] > scale[at_risk]).all()
    assert (safe <= 2 * scale).all()
    tighter = np.where(at_risk, safe * 0.97, safe)   # a little less and some pair saturates again
    assert risky_pairs(rows(codes(tighter))).any()


def test_clip_pairs_moves_only_risky_pairs_to_the_nearest_safe_codes():
    exact = np.array([[100.2, 60.4, 30.0, 20.0, -90.0, -70.6, 127.0, 3.4]])
    codes = np.rint(exact).astype(np.int32)
    out = clip_pairs(codes, exact, -127, 127)
    assert out[0].tolist() == [84, 44, 30, 20, -74, -54, 126, 2]
    assert not risky_pairs(out).any()
    # the nearest pair on a + b = 128 to (100.2, 60.4) moves both by 16.3: 84, 44
    assert abs((out[0, 0] - exact[0, 0]) - (out[0, 1] - exact[0, 1])) <= 1


def _conv_layer(codes, **attrs):
    import onnx_graphsurgeon as gs

    node = gs.Node("Conv", "conv", attrs=attrs, inputs=[gs.Variable("x"), gs.Constant("w", codes.astype(np.float32))],
                   outputs=[gs.Variable("y")])
    return PairLayer(node, "w", codes.astype(np.int32))


def _im2col_pair_sums(codes, x, zero_point, group, strides, dilations, pads):
    """[N, C_out, K/2 (padded), H_out, W_out]: every pair sum of a 2-D Conv, from an explicit NHWC im2col."""
    c_out, per_group, kh, kw = codes.shape
    xp = np.pad(x.astype(np.int64), [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])], constant_values=zero_point)
    ho = (xp.shape[2] - (kh - 1) * dilations[0] - 1) // strides[0] + 1
    wo = (xp.shape[3] - (kw - 1) * dilations[1] - 1) // strides[1] + 1
    out = []
    for o in range(c_out):
        g = o // (c_out // group)
        cols = np.stack([xp[:, g * per_group + c, i * dilations[0]::strides[0], j * dilations[1]::strides[1]][:, :ho, :wo]
                         for i in range(kh) for j in range(kw) for c in range(per_group)], 1)
        products = k_rows(codes, "Conv")[o][None, :, None, None] * cols
        if products.shape[1] % 2:
            products = np.pad(products, [(0, 0), (0, 1), (0, 0), (0, 0)])
        out.append(products[:, 0::2] + products[:, 1::2])
    return np.stack(out, 1)


@pytest.mark.parametrize("seed", range(6))
def test_pair_sums_on_data_are_those_of_an_nhwc_im2col(seed):
    """PairSums against an explicit im2col: each risky pair's largest |sum|, and each output's clipped
    parts with the sums saturating at 80 % of int16 (groups, strides, dilations, pads, odd C_in/group)."""
    from qpasses.quant.qdq import QParams, quantized_values

    rng = np.random.default_rng(seed)
    group, per_group = [(1, 3), (2, 2), (1, 5), (2, 1), (1, 4), (3, 3)][seed]
    codes = rng.integers(-127, 128, (2 * group, per_group, 3, 3))
    attrs = {"group": group, "strides": [1 + seed % 2, 1], "dilations": [1, 1 + seed % 3 // 2], "pads": [1, 0, 2, 1]}
    qp = QParams.make("x", "uint8", [0.01], [int(rng.integers(0, 256))])
    x = rng.normal(0.5, 1.5, (2, group * per_group, 7, 8)).astype(np.float32)
    found = PairSums(_conv_layer(codes, **attrs), qp, rng.uniform(0.5, 2, 2 * group), [0], limit=0.8)
    found.update(x)
    sums = _im2col_pair_sums(codes, quantized_values(x, qp), qp.zero_point[0], group, attrs["strides"],
                             attrs["dilations"], attrs["pads"])
    risky = risky_pairs(k_rows(codes, "Conv"))
    rows, pairs = np.nonzero(risky)
    want = [sums[:, r, j].max() if k_rows(codes, "Conv")[r, 2 * j] > 0 else sums[:, r, j].min() for r, j in zip(rows, pairs)]
    cap = (np.where(k_rows(codes, "Conv")[rows, 2 * pairs] > 0, 32767, 32768) * 0.8).astype(int)
    summed = found.extreme > 0   # the others' codes cannot reach their cap on this input: not summed
    assert rows.size and summed.any() and found.extreme[summed].tolist() == [abs(int(v)) for v in np.array(want)[summed]]
    assert (np.abs(want)[~summed] <= cap[~summed]).all()
    clipped = (sums - np.clip(sums, -int(32768 * 0.8), int(32767 * 0.8))) * risky[None, :, :, None, None]
    for row in range(codes.shape[0]):
        np.testing.assert_array_equal(found.last_error.get(row, 0) + np.zeros(clipped[:, row, 0].size, np.int64),
                                      clipped[:, row].sum(1).ravel())


def test_pair_sums_do_not_depend_on_how_the_work_is_cut(monkeypatch):
    """The same numbers, bit for bit, whatever the chunk size (integer sums, exactly summed powers)."""
    from qpasses.analysis import saturation
    from qpasses.quant.qdq import QParams

    rng = np.random.default_rng(7)
    codes = rng.integers(-127, 128, (8, 6, 3, 3))
    x = rng.normal(0.5, 1.5, (3, 6, 9, 9)).astype(np.float32)
    qp = QParams.make("x", "uint8", [0.01], [40])
    results = []
    for chunk in (1 << 22, 97):
        monkeypatch.setattr(saturation, "CHUNK", chunk)
        found = PairSums(_conv_layer(codes, pads=[1, 1, 1, 1]), qp, [0.3], [0], limit=0.9)
        for sample in x:
            found.update(sample[None])
        results.append((found.extreme.tolist(), found.saturated, found.noise, found.noise_db, found.largest, found.exact))
    assert results[0] == results[1] and results[0][1] > 0


@pytest.mark.parametrize("op", ["Conv", "MatMul"])
@pytest.mark.parametrize("qtype, zero_point", [("uint8", 100), ("int8", -3)])
def test_pair_sums_from_the_largest_values_are_those_from_every_code(op, qtype, zero_point):
    """Each input's largest code from its largest value (then only the inputs worth it quantized), or
    from all its codes (a NaN, other qparams): the same numbers, bit for bit."""
    import onnx_graphsurgeon as gs

    from qpasses.quant.qdq import QParams

    rng = np.random.default_rng(3)
    spread = rng.uniform(0.2, 1.0, 12)   # inputs of unlike ranges (their largest codes below 255)
    if op == "Conv":
        layer = _conv_layer(rng.integers(-127, 128, (8, 6, 3, 3)), pads=[1, 1, 1, 1])
        x = rng.normal(0.5, 1.5, (3, 1, 6, 9, 9)) * spread[:6, None, None]
    else:
        codes = rng.integers(-127, 128, (12, 5))
        node = gs.Node("MatMul", "mm", inputs=[gs.Variable("x"), gs.Constant("w", codes.astype(np.float32))],
                       outputs=[gs.Variable("y")])
        layer, x = PairLayer(node, "w", codes.astype(np.int32)), rng.normal(0.5, 1.5, (3, 40, 12)) * spread
    qp = QParams.make("x", qtype, [0.03], [zero_point])
    results = []
    for monotonic in (True, False):
        found = PairSums(layer, qp, [0.3], [0], limit=0.9)
        found.monotonic = monotonic
        for sample in x.astype(np.float32):
            found.update(sample)
        results.append((found.extreme.tolist(), found.saturated, found.sums, found.errors, found.ceiling, found.exact))
    assert results[0] == results[1] and results[0][2] > 0 and results[0][4] > 0   # some pairs summed, some not


OUT_SCALE = 0.05   # wide enough for the exact sums: a saturated one lands ~36 steps lower


def _qdq_model(group=1, c_in=4, c_out=2, weights=None):
    """x -> Q/DQ (uint8) -> Conv (DQ int8 weight) -> Q/DQ: what insert-qdq writes for a Conv."""
    w = weights if weights is not None else _conv_codes(c_out, c_in // group, 3, [(0, 0, 0, 0), (0, 0, 0, 1)])
    inits = [numpy_helper.from_array(np.array(0.01, np.float32), "s"), numpy_helper.from_array(np.array(128, np.uint8), "z"),
             numpy_helper.from_array(np.array(OUT_SCALE, np.float32), "os"),
             numpy_helper.from_array(w.astype(np.int8), "wq"), numpy_helper.from_array(np.array(0.01, np.float32), "ws"),
             numpy_helper.from_array(np.array(0, np.int8), "wz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"]),
             helper.make_node("Conv", ["xd", "wd"], ["c"], name="conv", pads=[1] * 4, group=group),
             helper.make_node("QuantizeLinear", ["c", "os", "z"], ["cq"]),
             helper.make_node("DequantizeLinear", ["cq", "os", "z"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c_in, 5, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c_out, 5, 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_depthwise_has_no_pair_sums_but_one_input_channel_with_several_outputs_has():
    taps = _conv_codes(4, 1, 3, [(0, 0, 0, 0), (0, 0, 0, 1)])   # two kernel positions: k = 0, 1
    assert qdq_layers(from_proto(_qdq_model(group=4, c_in=4, c_out=4, weights=taps))) == []
    layers = qdq_layers(from_proto(_qdq_model(group=2, c_in=2, c_out=4, weights=taps)))
    assert [r.channels for r in risks(layers)] == [(0,)]


def test_table_and_qdq_views_agree_on_the_layer_of_issue_35():
    """Before insert-qdq (the table's codes) and in the QDQ model (the stored codes): the same risks."""
    from qpasses.testing import bn_conv_data, bn_conv_layer

    model = from_proto(bn_conv_layer())
    run_passes("annotate-types,calibrate,compute-qparams", model, data=[{"x": x} for x in bn_conv_data(4, 1)])
    before = risks(table_layers(model))
    assert len(before) == 1 and 10 < len(before[0].channels) < 64   # some channels, not all
    run_passes("insert-qdq", model)
    key = lambda found: [(r.node, r.channels, r.pairs) for r in found]   # noqa: E731
    assert key(risks(qdq_layers(model))) == key(before)


# -- what onnxruntime does (qemu) ---------------------------------------------------------------
PROBE = r"""
import sys, numpy as np, onnxruntime as ort
opts = ort.SessionOptions()
opts.log_severity_level = 3
for path in sys.argv[1:]:
    s = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    np.save(path + ".out.npy", np.stack([s.run(None, {"x": x})[0] for x in np.load(path + ".x.npy")]))
"""


OPENVINO_PROBE = r"""
import sys, numpy as np, openvino as ov
core = ov.Core()
for path in sys.argv[1:]:
    compiled = core.compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    np.save(path + ".out.npy", np.stack([compiled(x)[0] for x in np.load(path + ".x.npy")]))
"""


def _haswell(feeds: dict[str, np.ndarray], probe: str = PROBE) -> dict[str, np.ndarray]:
    """Model path -> its first output on each of its inputs ``x`` (stacked), in onnxruntime's
    kernels (or ``probe``'s runtime) under ``qemu-x86_64 -cpu Haswell``."""
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.skip("qemu-x86_64 is not installed: cannot emulate an x86-64 CPU without VNNI")
    for path, x in feeds.items():
        np.save(path + ".x.npy", x)
    done = subprocess.run([qemu, "-cpu", "Haswell", sys.executable, "-c", probe, *feeds],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return {path: np.load(path + ".out.npy") for path in feeds}


@pytest.mark.slow
def test_onnxruntime_on_avx2_pairs_exactly_what_the_analysis_says(tmp_path):
    cases = {"c0c1": [(0, 0, 0, 0), (0, 1, 0, 0)], "c1c2": [(0, 1, 0, 0), (0, 2, 0, 0)],
             "p0p1": [(0, 0, 0, 0), (0, 0, 0, 1)], "c3p0_c0p1": [(0, 3, 0, 0), (0, 0, 0, 1)],
             "c2c3p4": [(0, 2, 1, 1), (0, 3, 1, 1)]}
    cases = {name: _conv_codes(2, 4, 3, hits) for name, hits in cases.items()}
    cases["odd_c2p0_c0p1"] = _conv_codes(2, 3, 3, [(0, 2, 0, 0), (0, 0, 0, 1)])
    feeds, expected, simulated = {}, {}, {}
    for name, w in cases.items():
        path = str(tmp_path / f"{name}.onnx")
        model = _qdq_model(c_in=w.shape[1], weights=w)
        onnx.save(model, path)
        expected[path] = bool(risks(qdq_layers(from_proto(model))))
        x = np.full((1, w.shape[1], 5, 5), 1.27, np.float32)   # code 255 with zero point 128
        feeds[path] = x[None]
        simulated[path] = session(model, optimize=False).run(None, {"x": x})[0]   # exact sums, on any CPU
    emulated = _haswell(feeds)
    saturated = {p: bool(np.abs(emulated[p][0] - simulated[p]).max() > 2 * OUT_SCALE) for p in feeds}
    assert saturated == expected and any(expected.values()) and not all(expected.values())


@pytest.mark.slow
def test_emulated_pair_sums_are_what_the_avx2_kernel_computes(tmp_path):
    """A QDQ MatMul (onnxruntime fuses it into MatMulIntegerToFloat: float output, nothing
    requantized) with crafted risky pairs, on random uint8 codes under qemu Haswell: the kernel's
    error against the exact product is, per output, minus what PairSums says saturating clips."""
    import onnx_graphsurgeon as gs

    from qpasses.quant.qdq import QParams

    rng = np.random.default_rng(11)
    k, n, sx, sw = 9, 5, 0.01, 0.02
    w = rng.integers(-40, 41, (k, n))
    w[0:2, 0], w[2:4, 1], w[4:6, 2], w[6:8, 3] = 100, -120, (127, 60), (-90, -70)   # risky pairs along K
    x = (rng.integers(0, 256, (64, k)) * sx).astype(np.float32)
    x[:8] = 2.55   # every code at 255
    inits = [numpy_helper.from_array(np.array(sx, np.float32), "s"), numpy_helper.from_array(np.array(0, np.uint8), "z"),
             numpy_helper.from_array(w.astype(np.int8), "wq"), numpy_helper.from_array(np.array(sw, np.float32), "ws"),
             numpy_helper.from_array(np.array(0, np.int8), "wz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"]),
             helper.make_node("MatMul", ["xd", "wd"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = str(tmp_path / "mm.onnx")
    onnx.save(model, path)
    kernel = _haswell({path: x[None]})[path][0].astype(np.float64)
    exact = (np.rint(x / sx).astype(np.int64) @ w) * sx * sw
    node = gs.Node("MatMul", "mm", inputs=[gs.Variable("x"), gs.Constant("w", w.astype(np.float32))], outputs=[gs.Variable("y")])
    found = PairSums(PairLayer(node, "w", w.astype(np.int32)), QParams.make("x", "uint8", [sx], [0]), [sw], [0])
    found.update(x)
    clipped = np.stack([found.last_error.get(c, np.zeros(64, np.int64)) for c in range(n)], 1)
    assert found.saturated > 8 and set(found.last_error) == {0, 1, 2, 3}
    np.testing.assert_array_equal(np.rint((exact - kernel) / (sx * sw)).astype(np.int64), clipped)


def _issue_35_layer_three_ways(folder, probe: str = PROBE):
    """Issue 35's layer quantized for cpu x86-64 (``grid``: the default, ``uint8``: protect-pair-sums
    {fix=uint8}) and x86-64-vnni: {variant: SNR dB} in the QDQ simulation and under qemu Haswell
    (``probe``'s runtime)."""
    import qpasses
    from qpasses.core.pipeline import QUANTIZE_PIPELINE
    from qpasses.testing import bn_conv_data, bn_conv_layer

    calib, evals = [{"x": x} for x in bn_conv_data(8, 1)], bn_conv_data(8, 7)
    reference = session(bn_conv_layer(), optimize=False)
    want = np.stack([reference.run(None, {"x": x})[0] for x in evals]).astype(np.float64)
    snr = lambda got: 10 * np.log10((want ** 2).sum() / ((got - want) ** 2).sum())  # noqa: E731
    variants = {"grid": ("x86-64", None), "vnni": ("x86-64-vnni", None),
                "uint8": ("x86-64", QUANTIZE_PIPELINE.replace("protect-pair-sums", "protect-pair-sums{fix=uint8}"))}
    paths, simulated = {}, {}
    for name, (cpu, passes) in variants.items():
        model = qpasses.quantize(from_proto(bn_conv_layer()), calib, config={"cpu": cpu}, passes=passes)
        path = str(folder / f"{name}.onnx")
        qpasses.save(model, path)
        sim = session(path, optimize=False)
        simulated[name] = snr(np.stack([sim.run(None, {"x": x})[0] for x in evals]))
        paths[name] = path
    outputs = _haswell({path: evals for path in paths.values()}, probe)
    return simulated, {name: snr(outputs[path]) for name, path in paths.items()}


@pytest.mark.slow
def test_protected_layer_keeps_its_simulated_snr_in_the_avx2_kernels(tmp_path):
    """Issue 35's layer quantized by the default pipeline (cpu x86-64: int8 weights on a grid no
    pair can saturate on) or with uint8 weights scores in onnxruntime's kernels under qemu Haswell
    what it scores in the QDQ simulation (the grid within 1 dB of the unprotected layer's); quantized
    for VNNI only, it loses more than 3 dB there."""
    simulated, emulated = _issue_35_layer_three_ways(tmp_path)
    assert simulated["uint8"] == simulated["vnni"] > 30 and simulated["vnni"] - 1 < simulated["grid"]
    assert abs(emulated["grid"] - simulated["grid"]) < 0.1 and abs(emulated["uint8"] - simulated["uint8"]) < 0.1
    assert emulated["vnni"] < simulated["vnni"] - 3


@pytest.mark.slow
def test_openvino_on_avx2_saturates_int8_weights_as_onnxruntime_does(tmp_path):
    """OpenVINO's int8 convolution sums pairs in int16 without VNNI too (measured: 28.8 dB against
    34.1 simulated); the pair-safe grid keeps its SNR there in int8, uint8 weights in float."""
    pytest.importorskip("openvino")
    simulated, emulated = _issue_35_layer_three_ways(tmp_path, OPENVINO_PROBE)
    assert abs(emulated["grid"] - simulated["grid"]) < 0.5 and abs(emulated["uint8"] - simulated["uint8"]) < 0.5
    assert emulated["vnni"] < simulated["vnni"] - 3


def test_the_report_shows_which_cpus_a_layer_saturates_on():
    from qpasses.report.html import _pair_sums

    risky = _conv_codes(2, 4, 3, [(0, 0, 0, 0), (0, 1, 0, 0)])
    found = risks(qdq_layers(from_proto(_qdq_model(weights=risky))))
    text = "".join(_pair_sums({"checked": 1, "risks": found, "record": None}))
    assert "saturates: 1 of 2 output channels (1 weight pairs)</td>" in text and text.count(">safe<") == 2
    assert "No layer can saturate" in "".join(_pair_sums({"checked": 1, "risks": [], "record": None}))
