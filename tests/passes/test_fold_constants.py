"""fold-constants: folds constant subgraphs into initializers, keeps names, never folds Q/DQ."""
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter
import pytest

import qpasses
from qpasses import PassManager
from qpasses.core.verify import check_onnx, check_structure
from qpasses.passes import fold_constants as fc
from qpasses.passes.fold_constants import FoldConstants
from qpasses.testing import assert_same_outputs, model_from_text, parse, random_feed, run, run_pass

LIGHT = Path(onnx.__file__).parent / "backend/test/data/light"


def _fold(model, **options):
    before = model.to_proto()
    result = run_pass(FoldConstants(**options), model)
    model.touch()
    check_structure(model)
    after = check_onnx(model)
    return before, after, result


def _ops(proto):
    return Counter(n.op_type for n in proto.graph.node)


def test_example_folds_to_one_initializer():
    m = model_from_text(FoldConstants.example)
    before, after, result = _fold(m)
    assert result.modified and result.stats["folded"] == 1
    assert _ops(after) == {"Add": 1}
    w3 = {t.name: onnx.numpy_helper.to_array(t) for t in after.graph.initializer}["w3"]
    np.testing.assert_allclose(w3, np.full(4, 0.25, np.float32))
    assert_same_outputs(before, after, random_feed(before))
    assert not run_pass(FoldConstants(), m).modified


def test_nothing_to_fold_is_a_no_op():
    m = model_from_text("""
    g (float[N,4] x, float[4] w) => (float[N,4] y) {
       s = Shape (x)
       r = Reshape (w, s)
       y = Add (x, r)
    }""")
    text = onnx.printer.to_text(m.to_proto().graph)
    result = run_pass(FoldConstants(), m)
    assert result.modified is False and result.stats["folded"] == 0
    assert onnx.printer.to_text(m.to_proto().graph) == text


def test_folded_graph_output_stays_an_output():
    m = model_from_text("""
    g (float[2] x) => (float[2] y, float[2] c) {
       k = Constant <value = float[2] {1, 2}> ()
       c = Neg (k)
       y = Add (x, c)
    }""")
    before, after, result = _fold(m)
    assert [o.name for o in after.graph.output] == ["y", "c"]
    assert {t.name for t in after.graph.initializer} == {"c"}
    assert _ops(after) == {"Add": 1}
    assert_same_outputs(before, after, random_feed(before))


def test_feedable_initializer_is_not_a_constant():
    # IR 10: an initializer also listed as an input is a default the user may override
    m = model_from_text("""
    g (float[2] x, float[2] w) => (float[2] y) <float[2] w = {1, 2}, float[2] k = {3, 4}> {
       a = Mul (w, k)
       b = Neg (k)
       y = Add (x, a)
       z = Add (y, b)
    }""".replace("=> (float[2] y)", "=> (float[2] y, float[2] z)"))
    before, after, result = _fold(m)
    assert result.stats["folded"] == 1            # only Neg(k)
    assert _ops(after) == {"Mul": 1, "Add": 2}
    assert [i.name for i in after.graph.input] == ["x", "w"]   # signature kept
    feed = {"x": np.ones(2, np.float32), "w": np.array([5, 6], np.float32)}
    np.testing.assert_array_equal(run(after, feed)[0], run(before, feed)[0])


def test_ir3_initializer_inputs_are_constants():
    proto = parse("""
    g (float[2] x, float[2] w) => (float[2] y) <float[2] w = {1, 2}> {
       a = Neg (w)
       y = Add (x, a)
    }""")
    proto.ir_version = 3
    m = qpasses.load(proto)
    before, after, result = _fold(m)
    assert result.stats["folded"] == 1
    assert [i.name for i in after.graph.input] == ["x"]
    assert_same_outputs(proto, after, random_feed(proto))


def test_never_folds_qdq_random_subgraph_or_custom_domain():
    m = model_from_text("""
    <ir_version: 10, opset_import: ["" : 17, "custom" : 1]>
    g (float[2] x, bool c) => (float[2] y, float[2] r, float[2] i, float[2] u) <int8[2] q = {1, 2}> {
       d = DequantizeLinear (q, s)
       s = Constant <value = float {0.5}> ()
       y = Add (x, d)
       r = RandomNormal <shape = [2]> ()
       i = If (c) <then_branch = g1 () => (float[2] t) { t = Neg (d) }, else_branch = g2 () => (float[2] e) { e = Abs (d) }>
       u = custom.Foo (d)
    }""")
    before, after, result = _fold(m)
    assert _ops(after) == {"DequantizeLinear": 1, "Add": 1, "RandomNormal": 1, "If": 1, "Foo": 1}
    assert result.stats["folded"] == 1           # the Constant scale only
    assert {t.name for t in after.graph.initializer} == {"q", "s"}


def test_shape_of_static_tensor_folds_dynamic_does_not():
    m = model_from_text("""
    g (float[2,3] x, float[N,3] z) => (int64[2] a, int64[2] b, int64 n) {
       a = Shape (x)
       b = Shape (z)
       n = Size (x)
    }""")
    before, after, result = _fold(m)
    assert result.stats["folded"] == 2
    values = {t.name: onnx.numpy_helper.to_array(t) for t in after.graph.initializer}
    np.testing.assert_array_equal(values["a"], [2, 3])
    assert values["n"].shape == () and values["n"] == 6
    assert _ops(after) == {"Shape": 1}


def test_multi_output_and_partial_use():
    m = model_from_text("""
    g (float[2] x) => (float[2] y) <float[4] k = {1, 2, 3, 4}> {
       p, q = Split (k)
       y = Add (x, q)
    }""")
    before, after, result = _fold(m)
    assert result.stats == {"folded": 1, "nodes_removed": 1}
    assert_same_outputs(before, after, random_feed(before))


def test_large_outputs_are_skipped_unless_weights():
    text = """
    g (float[1,1,8,8] x) => (float[1,1,8,8] y) <int64[4] wshape = {1, 1, 3, 3}, int64[4] big = {1, 1, 8, 8}> {
       w = ConstantOfShape <value = float[1] {0.5}> (wshape)
       c = Conv <pads = [1, 1, 1, 1]> (x, w)
       e = ConstantOfShape <value = float[1] {2}> (big)
       m = Mul (c, e)
       k = Constant <value = float[1,1,8,8] {1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,
                                            1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8,1,2,3,4,5,6,7,8}> ()
       y = Add (m, k)
    }"""
    m = model_from_text(text)
    before, after, result = _fold(m, max_output_mb=100 / 2**20)   # 100 bytes: w is 36, e and k 256
    assert result.stats["folded"] == 2 and result.stats["not_folded"] == 1   # w and the Constant k
    assert _ops(after) == {"Conv": 1, "ConstantOfShape": 1, "Mul": 1, "Add": 1}
    assert not run_pass(FoldConstants(max_output_mb=100 / 2**20), m).modified
    m2 = model_from_text(text)
    _, after2, _ = _fold(m2, max_output_mb=10 / 2**20)            # the Conv weight folds anyway
    assert "w" in {t.name for t in after2.graph.initializer}
    _, after3, _ = _fold(model_from_text(text), max_output_mb=0)   # 0 = no limit
    assert _ops(after3) == {"Conv": 1, "Mul": 1, "Add": 1}
    assert_same_outputs(before, after, random_feed(before))


def test_onnxruntime_refusal_falls_back(monkeypatch):
    m = model_from_text("""
    g (float[2] x) => (float[2] y) <float[2] k = {1, 2}> {
       a = Neg (k)
       b = Sin (a)
       c = Abs (b)
       y = Add (x, c)
    }""")
    real = fc._run
    calls = []

    def refuse_sin(proto, names):
        calls.append([n.op_type for n in proto.graph.node])
        return None if any(n.op_type == "Sin" for n in proto.graph.node) else real(proto, names)

    monkeypatch.setattr(fc, "_run", refuse_sin)
    before, after, result = _fold(m)
    assert _ops(after) == {"Sin": 1, "Abs": 1, "Add": 1}        # Sin cannot fold: its input does
    assert result.stats["not_folded"] == 1
    assert {t.name for t in after.graph.initializer} == {"a"}
    assert calls[0] == ["Neg", "Sin", "Abs"]                   # one session for the whole subgraph first
    assert_same_outputs(before, after, random_feed(before))


def test_evaluation_in_chunks(monkeypatch):
    m = model_from_text("""
    g (float[2] x) => (float[2] y, float[2] z) <float[2] k = {1, 2}> {
       a = Neg (k)
       b = Exp (a)
       c = Add (a, b)
       d = Sin (c)
       e = Mul (d, a)
       y = Add (x, e)
       f = Cos (b)
       g2 = Add (f, e)
       z = Mul (x, g2)
    }""")
    monkeypatch.setattr(fc, "CHUNK", 2)
    real, sizes = fc._run, []

    def counting(proto, names):
        sizes.append(len(proto.graph.node))
        return None if any(n.op_type == "Sin" for n in proto.graph.node) else real(proto, names)

    monkeypatch.setattr(fc, "_run", counting)
    before, after, result = _fold(m)
    assert max(sizes) <= 2
    assert _ops(after) == {"Sin": 1, "Mul": 2, "Add": 2}       # Sin refused: it and what reads it stay
    assert {t.name for t in after.graph.initializer} == {"a", "c", "f"}
    assert_same_outputs(before, after, random_feed(before))


def test_reference_evaluator_used_when_onnxruntime_fails(monkeypatch):
    import onnxruntime

    def broken(*args, **kwargs):
        raise RuntimeError("no session")

    m = model_from_text(FoldConstants.example)
    monkeypatch.setattr(onnxruntime, "InferenceSession", broken)
    result = run_pass(FoldConstants(), m)
    monkeypatch.undo()
    assert result.stats["folded"] == 1 and "not_folded" not in result.stats


def test_pass_manager_sets_fact():
    m = model_from_text(FoldConstants.example)
    m.facts |= {"types-annotated", "calibrated"}
    records = PassManager("fold-constants").run(m)
    # no "constants-folded" fact any more (no pass read it); folding rewrites the graph: no fact survives
    assert records[0].modified and m.facts == set() and not FoldConstants.establishes


def _light(name: str) -> onnx.ModelProto:
    return onnx.version_converter.convert_version(onnx.load(LIGHT / f"light_{name}.onnx"), 13)


def _check_light(name: str) -> None:
    proto = _light(name)
    m = qpasses.load(proto)
    result = run_pass(FoldConstants(), m)
    assert result.modified
    m.touch()
    after = check_onnx(m)
    assert _ops(after)["ConstantOfShape"] == 0
    feed = random_feed(proto)
    for ref, got in zip(run(proto, feed), run(after, feed), strict=True):
        assert np.max(np.abs(got - ref)) <= 1e-6 * max(1.0, float(np.max(np.abs(ref))))
    assert not run_pass(FoldConstants(), m).modified


@pytest.mark.parametrize("name", ["squeezenet", "inception_v1", "shufflenet"])
def test_light_models(name):
    _check_light(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bvlc_alexnet", "densenet121", "inception_v2", "resnet50", "vgg19", "zfnet512"])
def test_light_models_large(name):
    _check_light(name)
