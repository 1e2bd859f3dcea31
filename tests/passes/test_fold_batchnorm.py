"""fold-batchnorm: BatchNormalization folded into Conv / ConvTranspose / Gemm."""
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses import PassManager
from qpasses.core.context import RunContext
from qpasses.core.verify import check_onnx, check_structure
from qpasses.ir.model import from_proto
from qpasses.passes.fold_batchnorm import FoldBatchnorm
from qpasses.testing import assert_same_outputs, model_from_text, random_feed, run_pass

RNG = np.random.default_rng(0)


def _bn_params(prefix, channels):
    return [numpy_helper.from_array(a.astype(np.float32), f"{prefix}_{k}") for k, a in (
        ("scale", RNG.uniform(0.5, 1.5, channels)), ("bias", RNG.normal(0, 0.5, channels)),
        ("mean", RNG.normal(0, 0.5, channels)), ("var", RNG.uniform(0.5, 2.0, channels)))]


def _model(op, x_shape, w_shape, y_shape, bias=True, attrs=None, extra_inputs=(), n_bn=1, outputs=None):
    """x -> op(x, w[, b]) -> BN [-> BN] -> y."""
    inits = [numpy_helper.from_array(RNG.normal(0, 0.5, w_shape).astype(np.float32), "w")]
    op_inputs = ["x", "w"]
    channels = y_shape[1]
    if bias is not None and bias is not False:
        shape = bias if isinstance(bias, tuple) else (channels,)
        inits.append(numpy_helper.from_array(RNG.normal(0, 0.5, shape).astype(np.float32), "b"))
        op_inputs.append("b")
    nodes = [helper.make_node(op, op_inputs, ["p"], name="producer", **(attrs or {}))]
    src = "p"
    for i in range(n_bn):
        params = _bn_params(f"bn{i}", channels)
        inits += params
        out = "y" if i == n_bn - 1 else f"bn{i}_out"
        nodes.append(helper.make_node("BatchNormalization", [src] + [p.name for p in params], [out],
                                      name=f"bn{i}", epsilon=1e-3))
        src = out
    nodes.extend(extra_inputs)
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        outputs or [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _fold_and_check(proto, folded=1, rtol=1e-5):
    m = from_proto(proto)
    result = run_pass(FoldBatchnorm(), m)
    assert result.stats["folded"] == folded and result.modified == bool(folded)
    m.touch()
    check_structure(m)
    after = check_onnx(m)
    assert_same_outputs(proto, after, random_feed(proto), rtol=rtol, atol=1e-5)
    assert not run_pass(FoldBatchnorm(), m).modified
    return m, after


CASES = {
    "conv": ("Conv", [1, 3, 6, 6], [4, 3, 3, 3], [1, 4, 4, 4], True, {}),
    "conv-no-bias": ("Conv", [1, 3, 6, 6], [4, 3, 3, 3], [1, 4, 4, 4], False, {}),
    "conv-grouped": ("Conv", [1, 4, 6, 6], [6, 2, 3, 3], [1, 6, 4, 4], True, {"group": 2}),
    "conv-depthwise": ("Conv", [1, 4, 6, 6], [4, 1, 3, 3], [1, 4, 4, 4], False, {"group": 4}),
    "conv1d": ("Conv", [1, 3, 8], [5, 3, 3], [1, 5, 6], True, {}),
    "convtranspose": ("ConvTranspose", [1, 3, 4, 4], [3, 5, 3, 3], [1, 5, 6, 6], True, {}),
    "convtranspose-grouped": ("ConvTranspose", [1, 4, 4, 4], [4, 3, 3, 3], [1, 6, 6, 6], False, {"group": 2}),
    "gemm": ("Gemm", [2, 5], [5, 3], [2, 3], True, {}),
    "gemm-transB-no-C": ("Gemm", [2, 5], [3, 5], [2, 3], False, {"transB": 1}),
    "gemm-beta-C-row": ("Gemm", [2, 5], [3, 5], [2, 3], (1, 3), {"transB": 1, "beta": 0.5, "alpha": 2.0}),
    "gemm-C-scalar": ("Gemm", [2, 5], [5, 3], [2, 3], (1,), {"beta": 3.0}),
}


@pytest.mark.parametrize("case", CASES)
def test_folds(case):
    op, x, w, y, bias, attrs = CASES[case]
    m, after = _fold_and_check(_model(op, x, w, y, bias=bias, attrs=attrs))
    assert Counter(n.op_type for n in after.graph.node) == {op: 1}
    node = after.graph.node[0]
    assert list(node.output) == ["y"] and len(node.input) == 3
    assert node.input[1] == "w"  # only this node read it: the folded weight keeps its name


def test_chained_batchnorms_fold_in_one_run():
    _, after = _fold_and_check(_model("Conv", [1, 3, 6, 6], [4, 3, 3, 3], [1, 4, 4, 4], n_bn=2), folded=2)
    assert [n.op_type for n in after.graph.node] == ["Conv"]


def test_original_arrays_untouched_and_shared_weight_kept():
    other = helper.make_node("Conv", ["x", "w"], ["z"], name="other")
    proto = _model("Conv", [1, 3, 6, 6], [4, 3, 3, 3], [1, 4, 4, 4], bias=False, extra_inputs=[other],
                   outputs=[helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4, 4, 4]) for n in "yz"])
    w_before = numpy_helper.to_array(proto.graph.initializer[0]).copy()
    m = from_proto(proto)
    w_gs = next(t for t in m.tensors().values() if t.name == "w").values.copy()
    _, after = _fold_and_check(proto)
    inits = {t.name: numpy_helper.to_array(t) for t in after.graph.initializer}
    np.testing.assert_array_equal(inits["w"], w_before)
    np.testing.assert_array_equal(w_gs, w_before)
    assert {"w", "w_bn", "producer_bias"} <= set(inits)


@pytest.mark.parametrize("variant", ["producer-read-twice", "producer-is-output", "weight-is-input",
                                     "bn-param-feedable", "not-after-conv"])
def test_left_alone(variant):
    text = {
        "producer-read-twice": """
        g (float[1,2,3,3] x) => (float[1,2,3,3] y, float[1,2,3,3] r) <float[2,2,1,1] w = {1,0,0,1}, {params}> {
           c = Conv (x, w)
           y = BatchNormalization (c, s, b, m, v)
           r = Relu (c)
        }""",
        "producer-is-output": """
        g (float[1,2,3,3] x) => (float[1,2,3,3] y, float[1,2,3,3] c) <float[2,2,1,1] w = {1,0,0,1}, {params}> {
           c = Conv (x, w)
           y = BatchNormalization (c, s, b, m, v)
        }""",
        "weight-is-input": """
        g (float[1,2,3,3] x, float[2,2,1,1] w) => (float[1,2,3,3] y) <{params}> {
           c = Conv (x, w)
           y = BatchNormalization (c, s, b, m, v)
        }""",
        "bn-param-feedable": """
        g (float[1,2,3,3] x, float[2] s) => (float[1,2,3,3] y) <float[2,2,1,1] w = {1,0,0,1}, {params}> {
           c = Conv (x, w)
           y = BatchNormalization (c, s, b, m, v)
        }""",
        "not-after-conv": """
        g (float[1,2,3,3] x) => (float[1,2,3,3] y) <{params}> {
           c = Relu (x)
           y = BatchNormalization (c, s, b, m, v)
        }""",
    }[variant].replace("{params}", "float[2] s = {1,2}, float[2] b = {0,1}, float[2] m = {0,0}, float[2] v = {1,1}")
    m = model_from_text(text)
    printed = onnx.printer.to_text(m.to_proto().graph)
    ctx = RunContext()
    result = FoldBatchnorm().run(m, ctx)
    assert result.modified is False and result.stats["folded"] == 0
    assert onnx.printer.to_text(m.to_proto().graph) == printed
    if variant in ("weight-is-input", "bn-param-feedable"):
        assert result.stats["not_folded"] == 1
        [reason] = ctx.findings.as_dict()["fold-batchnorm"]["not_folded"].values()
        assert "not a constant" in reason or "not constants" in reason


def test_example_and_fact():
    m = model_from_text(FoldBatchnorm.example)
    before = m.to_proto()
    m.facts |= {"types-annotated", "calibrated"}
    records = PassManager("fold-batchnorm").run(m)
    # no "batchnorm-folded" fact any more (no pass read it); folding changes weights: no fact survives
    assert records[0].modified and m.facts == set() and not FoldBatchnorm.establishes
    assert [n.op for n in m.graph.nodes] == ["Conv"]
    assert_same_outputs(before, m.to_proto(), random_feed(before), rtol=1e-6)


def _light_pipeline(name):
    from pathlib import Path

    import onnx.version_converter

    import qpasses
    from qpasses.testing import run

    path = Path(onnx.__file__).parent / f"backend/test/data/light/light_{name}.onnx"
    proto = onnx.version_converter.convert_version(onnx.load(path), 13)
    m = qpasses.load(proto)
    producer = {o: n.op_type for n in proto.graph.node for o in n.output}
    after_conv = sum(n.op_type == "BatchNormalization" and producer.get(n.input[0]) == "Conv"
                     for n in proto.graph.node)   # densenet's others follow a Concat
    records = PassManager("fold-constants,fold-batchnorm,cleanup").run(m)
    assert records[1].stats["folded"] == after_conv > 0
    after = check_onnx(m)
    assert not any(n.op_type == "ConstantOfShape" for n in after.graph.node)
    feed = random_feed(proto)
    for ref, got in zip(run(proto, feed), run(after, feed), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(ref))))


def test_light_shufflenet_all_batchnorms_fold():
    _light_pipeline("shufflenet")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "densenet121", "inception_v2"])
def test_light_models_batchnorms_fold(name):
    _light_pipeline(name)
