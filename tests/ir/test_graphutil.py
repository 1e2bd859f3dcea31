"""Graph helpers: iterative stable toposort, indexes, rewiring, removal, unique names."""
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from qpasses.core.verify import check_onnx, check_structure
from qpasses.errors import ModelError
from qpasses.ir.graphutil import (consumers, node_reads, producers, remove_nodes, replace_all_uses, topological_order,
                                  toposort, unique_name, used_names)
from qpasses.ir.model import from_proto, make_constant
from qpasses.testing import model_from_text

DIAMOND = """
g (float[2] x) => (float[2] y) {
   a = Relu (x)
   b = Neg (a)
   c = Abs (a)
   y = Add (b, c)
}"""


def _chain(n: int, reverse: bool) -> onnx.ModelProto:
    nodes = [helper.make_node("Neg", [f"t{i}" if i else "x"], [f"t{i + 1}" if i < n - 1 else "y"], name=f"n{i}")
             for i in range(n)]
    if reverse:
        nodes.reverse()
    vi = [helper.make_tensor_value_info(k, TensorProto.FLOAT, [2]) for k in "xy"]
    model = helper.make_model(helper.make_graph(nodes, "chain", vi[:1], vi[1:]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_sorted_graph_keeps_its_order():
    m = model_from_text(DIAMOND)
    names = [n.name for n in m.graph.nodes]
    assert toposort(m.graph) is False
    assert [n.name for n in m.graph.nodes] == names


def test_deep_reversed_chain_sorts_without_recursion():
    m = from_proto(_chain(3000, reverse=True))  # from_proto sorts on load: unsort it again
    assert [n.name for n in m.graph.nodes] == [f"n{i}" for i in range(3000)]
    m.graph.nodes.reverse()
    assert toposort(m.graph) is True
    assert [n.name for n in m.graph.nodes] == [f"n{i}" for i in range(3000)]
    m.touch()
    check_structure(m)
    check_onnx(m)


def test_sort_is_stable_among_independent_nodes():
    m = model_from_text("""
    g (float[2] x) => (float[2] y) {
       y = Add (p, q)
       q = Abs (x)
       p = Neg (x)
    }""")
    toposort(m.graph)
    assert [n.op for n in m.graph.nodes] == ["Abs", "Neg", "Add"]


def test_cycle_is_reported():
    m = model_from_text(DIAMOND)
    a, b = m.graph.nodes[0], m.graph.nodes[1]
    a.inputs[0] = b.outputs[0]
    with pytest.raises(ModelError, match="cycle"):
        topological_order(m.graph)


def test_subgraph_reads_order_the_outer_node():
    m = model_from_text("""
    g (float[2] x, bool c) => (float[2] y) {
       y = If (c) <then_branch = g1 () => (float[2] t) { t = Neg (a) },
                   else_branch = g2 () => (float[2] e) { e = Abs (a) }>
       a = Relu (x)
    }""")
    m.graph.nodes.reverse()  # from_proto sorted it: unsort it again
    assert "a" in node_reads(m.graph.nodes[0])
    assert [n.op for n in topological_order(m.graph)] == ["Relu", "If"]
    assert [n.op for n in consumers(m.graph)["a"]] == ["If"]


def test_indexes():
    m = model_from_text(DIAMOND)
    assert producers(m.graph)["b"].op == "Neg"
    assert [n.op for n in consumers(m.graph)["a"]] == ["Neg", "Abs"]
    assert "x" not in producers(m.graph)


def test_replace_all_uses_rewires_readers_and_outputs():
    m = model_from_text(DIAMOND)
    graph = m.graph
    a = graph.nodes[0].outputs[0]
    new = make_constant("k", np.ones(2, np.float32))
    assert replace_all_uses(a, new, graph) == 2
    assert a.outputs == [] and [n.op for n in new.outputs] == ["Neg", "Abs"]
    y = graph.outputs[0]
    replace_all_uses(y, graph.nodes[1].outputs[0], graph)
    assert graph.outputs[0].name == "b"


def test_remove_nodes_detaches_links():
    m = model_from_text(DIAMOND)
    graph = m.graph
    a, b, c, add = graph.nodes
    assert remove_nodes(graph, [c, add]) == 2
    assert [n.op for n in graph.nodes] == ["Relu", "Neg"]
    assert a.outputs[0].outputs == [b]
    assert c.inputs == [] and add.inputs == [] and b.outputs[0].outputs == []
    assert remove_nodes(graph, []) == 0


def test_unique_name_is_deterministic():
    m = model_from_text(DIAMOND)
    taken = used_names(m.graph)
    assert {"x", "a", "y"} <= taken
    assert unique_name("a", taken) == "a_1"
    assert unique_name("a", taken) == "a_2"
    assert unique_name("fresh", taken) == "fresh"
    assert unique_name("fresh", taken) == "fresh_1"


def test_empty_optional_inputs_are_ignored():
    graph = gs.Graph(nodes=[gs.Node("Clip", inputs=[gs.Variable("x"), gs.Variable.empty()],
                                    outputs=[gs.Variable("y")])])
    assert node_reads(graph.nodes[0]) == ["x"]
    assert toposort(graph) is False
