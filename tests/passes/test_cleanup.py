"""cleanup: dead nodes, unused and duplicate initializers, topological order."""
import numpy as np
import onnx
from onnx import TensorProto, helper

from qpasses import PassManager, TensorQuant
from qpasses.core.verify import check_onnx, check_structure
from qpasses.ir.model import from_proto
from qpasses.passes.cleanup import Cleanup
from qpasses.testing import assert_same_outputs, model_from_text, random_feed, run_pass


def _clean(m):
    before = m.to_proto()
    result = run_pass(Cleanup(), m)
    m.touch()
    check_structure(m)
    after = check_onnx(m)
    assert not run_pass(Cleanup(), m).modified
    return before, after, result


def _inits(proto):
    return {t.name for t in proto.graph.initializer}


def test_example():
    m = model_from_text(Cleanup.example)
    m.graph.nodes.reverse()  # from_proto sorts on load: unsort it again
    before, after, result = _clean(m)
    assert result.modified
    assert result.stats == {"nodes_removed": 1, "initializers_removed": 1, "initializers_merged": 1,
                            "reordered": 1}
    assert [n.op_type for n in after.graph.node] == ["Mul", "Add"]
    assert _inits(after) == {"a"}
    assert_same_outputs(before, after, random_feed(before))


def test_clean_graph_is_a_no_op():
    m = model_from_text("""
    g (float[2] x, float[2] unused_input) => (float[2] y) <float[2] a = {1, 2}, float[3] b = {1, 2, 0}> {
       t = Mul (x, a)
       st = Constant <value = int64[1] {0}> ()
       en = Constant <value = int64[1] {2}> ()
       s = Slice (b, st, en)
       y = Add (t, s)
    }""")
    text = onnx.printer.to_text(m.to_proto().graph)
    result = run_pass(Cleanup(), m)
    assert result.modified is False
    assert onnx.printer.to_text(m.to_proto().graph) == text
    assert [i.name for i in m.to_proto().graph.input] == ["x", "unused_input"]


def test_outputs_inputs_and_feedable_initializers_are_not_merged():
    m = model_from_text("""
    g (float[2] x, float[2] f) => (float[2] y, float[2] k) <float[2] f = {1, 2}, float[2] k = {1, 2},
                                                          float[2] a = {1, 2}, float[2] b = {1, 2}> {
       t = Mul (x, f)
       u = Mul (t, k)
       v = Add (u, a)
       y = Add (v, b)
    }""")
    before, after, result = _clean(m)
    assert result.stats["initializers_merged"] == 1           # b -> a only
    assert _inits(after) == {"f", "k", "a"}
    assert [i.name for i in after.graph.input] == ["x", "f"]
    assert [o.name for o in after.graph.output] == ["y", "k"]
    assert_same_outputs(before, after, random_feed(before))


def test_different_dtype_shape_or_bytes_are_not_merged():
    m = model_from_text("""
    g (float[2] x) => (float[2] y) <float[2] a = {1, 2}, float[1,2] b = {1, 2}, float[2] c = {1, 3},
                                   double[2] d = {1, 2}> {
       t = Add (x, a)
       u = Add (t, b)
       v = Add (u, c)
       dd = Cast <to = 1> (d)
       y = Add (v, dd)
    }""".replace("=> (float[2] y)", "=> (float[1,2] y)"))
    result = run_pass(Cleanup(), m)
    assert result.modified is False and result.stats["initializers_merged"] == 0


def test_quant_table_entries_decide_merging():
    text = """
    g (float[2] x) => (float[2] y) <float[2] a = {1, 2}, float[2] b = {1, 2}> {
       t = Add (x, a)
       y = Mul (t, b)
    }"""
    m = model_from_text(text)
    m.quant["a"] = TensorQuant("int8", role="weight")
    m.quant["b"] = TensorQuant("uint8", role="weight")
    assert run_pass(Cleanup(), m).stats["initializers_merged"] == 0
    m = model_from_text(text)
    m.quant["a"] = TensorQuant("int8", role="weight")
    m.quant["b"] = TensorQuant("int8", role="weight")
    m.quant["t"] = TensorQuant("int8", derived_from=["x", "b"])
    assert run_pass(Cleanup(), m).stats["initializers_merged"] == 1
    assert "b" not in m.quant and m.quant["t"].derived_from == ["x", "a"]


def test_dead_branch_and_its_initializers_go():
    m = model_from_text("""
    g (float[2] x) => (float[2] y) <float[2] a = {1, 2}, float[2] c = {5, 6}> {
       y = Mul (x, a)
       d1 = Sub (x, c)
       d2 = Relu (d1)
    }""")
    before, after, result = _clean(m)
    assert result.stats["nodes_removed"] == 2 and result.stats["initializers_removed"] == 1
    assert _inits(after) == {"a"} and [n.op_type for n in after.graph.node] == ["Mul"]


def test_subgraph_reads_keep_producers_alive():
    m = model_from_text("""
    g (float[2] x, bool c) => (float[2] y) {
       a = Relu (x)
       dead = Neg (x)
       y = If (c) <then_branch = g1 () => (float[2] t) { t = Neg (a) }, else_branch = g2 () => (float[2] e) { e = Abs (a) }>
    }""")
    before, after, result = _clean(m)
    assert [n.op_type for n in after.graph.node] == ["Relu", "If"]
    feed = {"x": np.array([1, -2], np.float32), "c": np.array(True)}
    assert_same_outputs(before, after, feed)


def test_deep_unsorted_chain():
    n = 3000
    nodes = [helper.make_node("Neg", [f"t{i}" if i else "x"], [f"t{i + 1}" if i < n - 1 else "y"], name=f"n{i}")
             for i in range(n)][::-1]
    vi = [helper.make_tensor_value_info(k, TensorProto.FLOAT, [2]) for k in "xy"]
    proto = helper.make_model(helper.make_graph(nodes, "chain", vi[:1], vi[1:]), opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 10
    m = from_proto(proto)
    m.graph.nodes.reverse()  # from_proto sorts on load: unsort it again
    before, after, result = _clean(m)
    assert result.stats["reordered"] == 1 and result.stats["nodes_removed"] == 0
    assert [n.name for n in after.graph.node] == [f"n{i}" for i in range(n)]


def test_fact():
    # no "clean" fact any more (no pass read it); a cleanup that changes the model keeps every fact
    m = model_from_text(Cleanup.example)
    facts = {"types-annotated", "calibrated", "qparams-computed", "qdq-inserted"}
    m.facts |= facts
    records = PassManager("cleanup").run(m)
    assert records[0].modified and m.facts == facts and not Cleanup.establishes
