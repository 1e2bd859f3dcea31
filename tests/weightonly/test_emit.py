"""drop_dead_nodes (the quantize-weights pass's cleanup) leaves what gs's cleanup leaves, skipping it
only when a scan by name proves no node is dead."""
import onnx_graphsurgeon as gs
import pytest

from qpasses.testing import model_from_text
from qpasses.weightonly.emit import drop_dead_nodes

GRAPHS = {
    "all used": """
        g (float[2,4] x) => (float[2,4] y) {
          a = Relu(x)
          b = Neg(a)
          y = Add(a, b)
        }""",
    "dead chain": """
        g (float[2,4] x) => (float[2,4] y) {
          a = Relu(x)
          d1 = Neg(a)
          d2 = Abs(d1)
          y = Sigmoid(a)
        }""",
    "one output of two used": """
        g (float[2,4] x) => (float[2,4] y) {
          v, i = TopK(x, k)
          y = Relu(v)
        }""",
    "dead node with two outputs": """
        g (float[2,4] x) => (float[2,4] y) {
          v, i = TopK(x, k)
          y = Relu(x)
        }""",
    "body": """
        g (float[2,4] x, bool c) => (float[2,4] y) {
          a = Relu(x)
          d = Neg(x)
          y = If(c) <then_branch = t () => (float[2,4] o) { o = Identity(a) },
                     else_branch = e () => (float[2,4] o) { o = Neg(a) }>
        }""",
}


def _nodes(graph):
    return [(n.op, [t.name for t in n.inputs], [t.name for t in n.outputs]) for n in graph.nodes]


@pytest.mark.parametrize("name", list(GRAPHS))
def test_drop_dead_nodes_is_gs_cleanup(name, monkeypatch):
    text = GRAPHS[name].replace("{\n          v, i", "<int64[1] k = {2}>\n        {\n          v, i", 1)
    expected = model_from_text(text).graph.cleanup(remove_unused_graph_inputs=False)
    graph = model_from_text(text).graph
    calls = []
    real = gs.Graph.cleanup
    monkeypatch.setattr(gs.Graph, "cleanup", lambda self, **kw: calls.append(1) or real(self, **kw))
    drop_dead_nodes(graph)
    assert _nodes(graph) == _nodes(expected)
    assert bool(calls) == (name != "all used" and name != "one output of two used")
