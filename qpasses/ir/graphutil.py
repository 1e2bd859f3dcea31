"""Small O(graph) helpers over the gs graph shared by the passes.

Every function here is linear in the size of the graph (or of what it touches) and never
recurses over the node chain, so it works on very deep graphs. Node inputs read implicitly by
subgraphs (If/Loop/Scan bodies reading outer-scope tensors) count as reads of the outer node.
"""
from __future__ import annotations

import heapq
from typing import Iterable, Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..errors import ModelError


# -- reads and subgraphs ---------------------------------------------------------------------
DEFAULT_DOMAINS = ("", "ai.onnx")   # the default ONNX domain, as a ModelProto spells it


def in_default_domain(node: gs.Node) -> bool:
    """Whether a gs node is an ONNX operator (its domain unset, "" or "ai.onnx")."""
    return (node.domain or "") in DEFAULT_DOMAINS


def default_opset(proto, missing=None):
    """The default-domain opset a ModelProto imports (``missing`` when it imports none)."""
    return next((o.version for o in proto.opset_import if o.domain in DEFAULT_DOMAINS), missing)


def proto_subgraphs(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    """(attribute name, graph) of each subgraph a NodeProto holds (If branches, Loop/Scan bodies)."""
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
            yield attr.name, sub


def proto_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph``, then every If/Loop/Scan body in it, nested ones too (each body before those inside it)."""
    yield graph
    for node in graph.node:
        for _, sub in proto_subgraphs(node):
            yield from proto_graphs(sub)


def named_subgraphs(node: gs.Node) -> Iterator[tuple[str, gs.Graph]]:
    """(attribute name, graph) of each subgraph held in ``node``'s attributes (If branches, Loop/Scan bodies)."""
    for attr, value in node.attrs.items():
        if isinstance(value, gs.Graph):
            yield attr, value
        elif holds_graph(value):
            yield from ((attr, sub) for sub in value)


def subgraphs(node: gs.Node) -> Iterator[gs.Graph]:
    """The subgraphs held in ``node``'s attributes (If branches, Loop/Scan bodies)."""
    return (sub for _, sub in named_subgraphs(node))


def holds_graph(value) -> bool:
    """Whether an attribute value is a subgraph or a list of them (an ONNX attribute list holds one
    kind of value: its first element says which; pads and shapes are lists too)."""
    return isinstance(value, gs.Graph) or (isinstance(value, (list, tuple)) and bool(value)
                                           and isinstance(value[0], gs.Graph))


def outer_reads(graph: gs.Graph) -> list[str]:
    """Names a (sub)graph reads from enclosing scopes: read but neither produced nor bound inside."""
    bound = {t.name for t in graph.inputs}
    reads: dict[str, None] = {}
    for node in graph.nodes:
        for name in node_reads(node):
            if name not in bound:
                reads[name] = None
        bound.update(t.name for t in node.outputs)
    return [name for name in reads if name not in bound]


def node_reads(node: gs.Node) -> list[str]:
    """Tensor names ``node`` reads: its inputs, then what its subgraphs read from outside them.

    Constant tensors read inside a subgraph count too (they may be outer-scope initializers).
    """
    names = [t.name for t in node.inputs if t.name]
    if any(holds_graph(v) for v in node.attrs.values()):   # most nodes have none
        for sub in subgraphs(node):
            names.extend(outer_reads(sub))
    return names


def has_subgraph(node: gs.Node) -> bool:
    return next(subgraphs(node), None) is not None


# -- indexes ---------------------------------------------------------------------------------
def producers(graph: gs.Graph) -> dict[str, gs.Node]:
    """Tensor name -> the node producing it (top-level nodes only)."""
    return {t.name: node for node in graph.nodes for t in node.outputs if t.name}


def consumers(graph: gs.Graph) -> dict[str, list[gs.Node]]:
    """Tensor name -> the top-level nodes reading it (each node once, in graph order)."""
    index: dict[str, list[gs.Node]] = {}
    for node in graph.nodes:
        for name in dict.fromkeys(node_reads(node)):
            index.setdefault(name, []).append(node)
    return index


def graph_output_names(graph: gs.Graph) -> set[str]:
    return {t.name for t in graph.outputs}


def overridable_initializers(model) -> set[str]:
    """Initializers the model also lists as graph inputs: the user may feed them, so they are
    not constants (qpasses.ir.model records them only for IR >= 4, where ONNX gives them that meaning)."""
    return set(model.input_initializers)


def used_names(graph: gs.Graph) -> set[str]:
    """Every node and tensor name in the graph and its subgraphs (for unique_name)."""
    names = {t.name for t in graph.inputs} | {t.name for t in graph.outputs}
    stack = [graph]
    while stack:
        g = stack.pop()
        for node in g.nodes:
            names.add(node.name)
            names.update(t.name for t in node.inputs)
            names.update(t.name for t in node.outputs)
            stack.extend(subgraphs(node))
    names.discard("")
    return names


def unique_name(base: str, taken: set[str]) -> str:
    """``base`` if free, else ``base_1``, ``base_2``...; the result is added to ``taken``."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


# -- ordering --------------------------------------------------------------------------------
def topological_order(graph: gs.Graph) -> list[gs.Node]:
    """Nodes in a stable topological order (Kahn; among ready nodes the earliest in the current
    order goes first, so a sorted graph keeps its order). Iterative: safe on deep graphs.

    Raises ModelError naming a node on a cycle.
    """
    nodes = list(graph.nodes)
    position = {t.name: i for i, node in enumerate(nodes) for t in node.outputs if t.name}
    reads = [node_reads(node) for node in nodes]
    if all(position.get(name, -1) < i for i, names in enumerate(reads) for name in names):
        return nodes  # already sorted
    indegree = [0] * len(nodes)
    successors: list[list[int]] = [[] for _ in nodes]
    for i, names in enumerate(reads):
        deps = {position[n] for n in names if n in position}
        indegree[i] = len(deps)
        for j in deps:
            successors[j].append(i)
    ready = [i for i, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in successors[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):
        stuck = next(nodes[i] for i, d in enumerate(indegree) if d > 0)
        raise ModelError(f"graph has a cycle through node '{stuck.name}' ({stuck.op})")
    return [nodes[i] for i in order]


def toposort(graph: gs.Graph) -> bool:
    """Sort ``graph.nodes`` topologically in place (stable); returns True if the order changed."""
    order = topological_order(graph)
    if all(a is b for a, b in zip(order, graph.nodes)):
        return False
    graph.nodes = order
    return True


# -- editing ---------------------------------------------------------------------------------
def replace_all_uses(old: gs.Tensor, new: gs.Tensor, graph: gs.Graph | None = None) -> int:
    """Make every reader of ``old`` read ``new`` (and, given ``graph``, its outputs list too).

    Returns the number of inputs/outputs rewired. Linear in the readers of ``old``.
    """
    if old is new:
        return 0
    count = 0
    for node in list(old.outputs):
        for i, tensor in enumerate(node.inputs):
            if tensor is old:
                list.__setitem__(node.inputs, i, new)
                list.append(new.outputs, node)
                count += 1
    list.clear(old.outputs)
    if graph is not None:
        for i, tensor in enumerate(graph.outputs):
            if tensor is old:
                graph.outputs[i] = new
                count += 1
    return count


def remove_nodes(graph: gs.Graph, nodes: Iterable[gs.Node]) -> int:
    """Remove ``nodes`` from ``graph`` in one rebuild of the node list and detach them from
    their tensors (producer/reader lists). Returns how many were removed."""
    dead = {id(n): n for n in nodes}
    if not dead:
        return 0
    touched: dict[int, gs.Tensor] = {}
    for node in dead.values():
        for t in list(node.inputs) + list(node.outputs):
            touched[id(t)] = t
        list.clear(node.inputs)
        list.clear(node.outputs)
    for t in touched.values():
        for links in (t.inputs, t.outputs):
            if any(id(n) in dead for n in links):
                list.__setitem__(links, slice(None), [n for n in links if id(n) not in dead])
    before = len(graph.nodes)
    graph.nodes = [n for n in graph.nodes if id(n) not in dead]
    return before - len(graph.nodes)


def weight_positions(node: gs.Node) -> float | None:
    """How many times a weighted op applies its weight per run: a Conv's output positions, a
    ConvTranspose's input positions, a MatMul's or Gemm's output rows; None when that shape is unknown."""
    tensor = node.inputs[0] if node.op == "ConvTranspose" else node.outputs[0]
    dims = list(tensor.shape) if tensor.shape is not None else []
    if not dims or not all(isinstance(d, int) and d > 0 for d in dims):
        return None
    if node.op in ("Conv", "ConvTranspose"):
        return float(dims[0] * np.prod(dims[2:]))
    return float(np.prod(dims[:-1]))
