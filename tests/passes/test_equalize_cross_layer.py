"""equalize-cross-layer: Conv -> (ReLU) -> Conv weight ranges equalized per channel, exactly in float."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses.api import run_pipeline
from qpasses.core.context import RunContext
from qpasses.core.pipeline import QUANTIZE_PIPELINE
from qpasses.core.verify import check_onnx, check_structure
from qpasses.evaluation.evaluate import snr_db
from qpasses.ir.decisions import float_reasons
from qpasses.ir.model import from_proto
from qpasses.passes.equalize_cross_layer import (EqualizeCrossLayer, from_input_channel_view, input_channel_view,
                                                 pair_scale)
from qpasses.testing import run, run_pass

C = 6
RNG = np.random.default_rng(0)


def _spread(n):
    """Per-channel gains 0.02 .. 20: the ranges a BN fold leaves behind."""
    return np.geomspace(0.02, 20, n).astype(np.float32)


def _model(nodes, inits, x_shape=(1, 3, 8, 8), out="y"):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True).graph.output
    del m.graph.output[:]
    m.graph.output.extend(inferred)
    return m


def conv_act_conv(act="Relu", depthwise=False, act_attrs=None, act_inputs=()):
    w1 = RNG.normal(0, 1, (C, 3, 3, 3)).astype(np.float32) * _spread(C)[:, None, None, None]
    w2 = (RNG.normal(0, 1, (C, 1, 3, 3)) if depthwise else RNG.normal(0, 1, (4, C, 1, 1))).astype(np.float32)
    inits = {"w1": w1, "b1": RNG.normal(0, 1, C), "w2": w2, "b2": RNG.normal(0, 1, w2.shape[0])}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1])]
    src = "c"
    if act:
        for name, value in act_inputs:
            inits[name] = value
        nodes.append(helper.make_node(act, ["c"] + [n for n, _ in act_inputs], ["a"], **(act_attrs or {})))
        src = "a"
    attrs = {"group": C, "pads": [1, 1, 1, 1]} if depthwise else {}
    nodes.append(helper.make_node("Conv", [src, "w2", "b2"], ["y"], **attrs))
    return _model(nodes, inits), inits


def feeds(n=4, seed=0, shape=(1, 3, 8, 8)):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


def _equalize(proto, **options):
    m = from_proto(proto)
    ctx = RunContext(None, None)
    result = run_pass(EqualizeCrossLayer(**options), m, ctx=ctx)
    check_structure(m)
    check_onnx(m)
    return m, result, ctx


def _same_outputs(before, after, rtol=1e-5):
    for f in feeds():
        for ref, got in zip(run(before, f), run(after, f), strict=True):
            assert np.abs(got - ref).max() <= rtol * np.abs(ref).max()


def _consts(m):
    return {t.name: np.asarray(t.values) for t in m.tensors().values() if hasattr(t, "values")}


def _ranges(m, group=1):
    c = _consts(m)
    r1 = np.abs(c["w1"]).reshape(C, -1).max(axis=1)
    r2 = np.abs(input_channel_view(c["w2"], group)).max(axis=1)
    return r1, r2


@pytest.mark.parametrize("depthwise", [False, True])
def test_relu_chain_ranges_become_equal_and_outputs_do_not_move(depthwise):
    proto, inits = conv_act_conv(depthwise=depthwise)
    m, result, ctx = _equalize(proto)
    assert result.modified and result.stats["pairs"] == 1
    r1, r2 = _ranges(m, C if depthwise else 1)
    np.testing.assert_allclose(r1, r2, rtol=1e-5)
    s = np.abs(inits["w1"]).reshape(C, -1).max(axis=1) / r1
    np.testing.assert_allclose(_consts(m)["b1"], inits["b1"] / s, rtol=1e-5)
    np.testing.assert_array_equal(_consts(m)["b2"], inits["b2"].astype(np.float32))
    assert m.decisions["cross_layer_equalization"]["pairs"] == [["Conv_0", "Conv_2"]]
    assert ctx.findings.as_dict()["equalize-cross-layer"]["pairs"][0]["via"] == "Conv->Relu->Conv"
    _same_outputs(proto, m)


def test_second_run_changes_nothing():
    m, _, _ = _equalize(conv_act_conv()[0])
    before = m.to_proto().SerializeToString()
    assert not run_pass(EqualizeCrossLayer(), m).modified
    assert m.to_proto().SerializeToString() == before


def test_depthwise_first_then_pointwise_and_no_activation():
    """MobileNet's depthwise -> pointwise pair (no activation between them)."""
    w1 = RNG.normal(0, 1, (3, 1, 3, 3)).astype(np.float32) * np.asarray([0.01, 1, 30], np.float32)[:, None, None, None]
    inits = {"w1": w1, "w2": RNG.normal(0, 1, (5, 3, 1, 1))}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], group=3, pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c", "w2"], ["y"])]
    proto = _model(nodes, inits)
    m, result, _ = _equalize(proto)
    assert result.modified
    c = _consts(m)
    np.testing.assert_allclose(np.abs(c["w1"]).reshape(3, -1).max(1), np.abs(c["w2"]).max(axis=(0, 2, 3)), rtol=1e-5)
    _same_outputs(proto, m)


def test_three_convs_iterate_to_a_fixed_point():
    inits = {"w1": RNG.normal(0, 1, (C, 3, 3, 3)) * _spread(C)[:, None, None, None],
             "w2": RNG.normal(0, 1, (C, C, 1, 1)) * _spread(C)[::-1, None, None, None],
             "w3": RNG.normal(0, 1, (2, C, 1, 1))}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["a1"]),
             helper.make_node("Conv", ["a1", "w2"], ["c2"]), helper.make_node("Relu", ["c2"], ["a2"]),
             helper.make_node("Conv", ["a2", "w3"], ["y"])]
    proto = _model(nodes, inits)
    m, result, _ = _equalize(proto, tolerance=1e-6, iterations=200)
    assert result.stats["pairs"] == 2 and 2 < result.stats["rounds"] < 200
    c = _consts(m)
    for a, b in (("w1", "w2"), ("w2", "w3")):
        np.testing.assert_allclose(np.abs(c[a]).reshape(C, -1).max(1), np.abs(c[b]).max(axis=(0, 2, 3)), rtol=1e-4)
    _same_outputs(proto, m)


@pytest.mark.parametrize("act,kw,inputs,equalized", [
    ("Clip", {}, [("lo", np.asarray(0, np.float32))], True),                                     # Clip(0, no max) = ReLU
    ("Clip", {}, [("lo", np.asarray(0, np.float32)), ("hi", np.asarray(6, np.float32))], False),  # ReLU6
    ("LeakyRelu", {"alpha": 0.1}, [], True),
    ("PRelu", {}, [("slope", np.linspace(0.1, 0.3, C, dtype=np.float32).reshape(C, 1, 1))], True),
    ("Sigmoid", {}, [], False),
])
def test_only_positively_homogeneous_activations(act, kw, inputs, equalized):
    proto, _ = conv_act_conv(act=act, act_attrs=kw, act_inputs=inputs)
    m, result, ctx = _equalize(proto)
    assert result.modified is equalized
    found = ctx.findings.as_dict().get("equalize-cross-layer", {})
    if act == "Clip" and not equalized:
        assert "upper bound (6)" in found["not_equalized"]["Conv_0"]
    if act == "Sigmoid":
        assert "not positively homogeneous" in found["not_equalized"]["Conv_0"]
    _same_outputs(proto, m)


def test_per_channel_add_between_is_scaled_too():
    """A BatchNorm exported as Mul + Add of per-channel constants (paddle) sits between the convs."""
    inits = {"w1": RNG.normal(0, 1, (C, 3, 3, 3)) * _spread(C)[:, None, None, None],
             "g": RNG.uniform(0.5, 2, (C, 1, 1)), "t": RNG.normal(0, 1, (1, C, 1, 1)), "w2": RNG.normal(0, 1, (4, C, 1, 1))}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Mul", ["c", "g"], ["m"]),
             helper.make_node("Add", ["m", "t"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"])]
    proto = _model(nodes, inits)
    m, result, ctx = _equalize(proto)
    assert result.modified and ctx.findings.as_dict()["equalize-cross-layer"]["pairs"][0]["via"] == "Conv->Mul->Add->Relu->Conv"
    c = _consts(m)
    assert c["t"].shape == (1, C, 1, 1)
    np.testing.assert_array_equal(c["g"], inits["g"].astype(np.float32))
    _same_outputs(proto, m)


def test_branching_output_and_shared_weight():
    """A conv output read twice is not a chain; a weight shared with another conv gets a copy."""
    proto, _ = conv_act_conv()
    proto.graph.node.append(helper.make_node("Relu", ["c"], ["z"]))
    proto.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, C, 8, 8]))
    m, result, _ = _equalize(proto)
    assert not result.modified and "cross_layer_equalization" not in m.decisions

    proto, _ = conv_act_conv()
    proto.graph.node.append(helper.make_node("Conv", ["a", "w2"], ["z"]))   # a second reader of a: no chain
    m, result, _ = _equalize(proto)
    assert not result.modified

    proto, inits = conv_act_conv()
    proto.graph.node.append(helper.make_node("Conv", ["x", "w1"], ["z"], pads=[1, 1, 1, 1]))   # shares w1
    proto.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, C, 8, 8]))
    m, result, _ = _equalize(proto)
    assert result.modified
    c = _consts(m)
    np.testing.assert_array_equal(c["w1"], inits["w1"])   # the other reader keeps the original
    assert "w1_cle" in c
    _same_outputs(proto, m)


def test_pair_scale_and_input_channel_view():
    w2 = RNG.normal(0, 1, (8, 2, 3, 3))   # group 2: 4 input channels, 4 outputs per group
    view = input_channel_view(w2, 2)
    assert view.shape == (4, 4 * 9)
    np.testing.assert_array_equal(view[3], w2[4:8, 1].reshape(-1))   # channel 3 = group 1, local 1
    np.testing.assert_array_equal(from_input_channel_view(view, w2.shape, 2), w2)
    w1 = np.stack([np.full((2, 3, 3), v) for v in (1.0, 4.0, 0.0, 9.0)])
    s = pair_scale(w1, np.stack([np.full(36, v) for v in (4.0, 1.0, 2.0, 0.0)]))
    np.testing.assert_allclose(s, [0.5, 2.0, 1.0, 1.0])   # a zero range keeps scale 1


def test_per_tensor_weights_gain_from_equalization():
    """With per-tensor int8 weights (the case CLE was made for): conv1's output channels span three
    decades and conv2 compensates (as after folding BatchNorms), so every channel matters and
    per-tensor grids lose the small ones unless the pair is equalized."""
    inits = {"w1": RNG.normal(0, 1, (C, 3, 3, 3)) * _spread(C)[:, None, None, None],
             "w2": RNG.normal(0, 1, (4, C, 1, 1)) / _spread(C)[None, :, None, None]}
    proto = _model([helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
                    helper.make_node("Conv", ["r", "w2"], ["y"])], inits)
    data, evals = feeds(16), feeds(8, seed=9)
    no_search = QUANTIZE_PIPELINE.replace("search-precision,", "")

    def quantize(passes, cle):
        passes = passes.replace("cleanup,", "cleanup,equalize-cross-layer,", 1) if cle else passes
        q, _ = run_pipeline(from_proto(proto), passes, ctx=RunContext({"per_channel": False}, data))
        q_proto = check_onnx(q)
        ref = np.concatenate([run(proto, f)[0].ravel() for f in evals])
        got = np.concatenate([run(q_proto, f)[0].ravel() for f in evals])
        return snr_db(ref, got), float_reasons(q)

    (base, _), (equalized, _) = quantize(no_search, False), quantize(no_search, True)
    assert base < 10 and equalized > base + 15, (base, equalized)   # measured: 2.7 -> 27.4 dB, all 8-bit
    # the default pipeline's search keeps w1, w2 and r float to reach its target; equalized, nothing
    assert len(quantize(QUANTIZE_PIPELINE, False)[1]) >= 2 and quantize(QUANTIZE_PIPELINE, True)[1] == {}
