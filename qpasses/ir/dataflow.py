"""Read-only view of a QModel's dataflow (maps, and a networkx graph on demand), a cached analysis
of the graph.

Nodes are integers: one per op node (attribute ``kind="op"``), graph input (``"input"``),
constant tensor (``"initializer"``) and graph output (``"output"``). Every edge carries the tensor
name as its key and ``slots``, the input positions at which the reader reads it (a tensor read
twice by one node is one edge with two slots).
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from .analyses import GRAPH, analysis
from .model import QModel


class Dataflow:
    """The dataflow of one state of the graph: ``node_id`` (op node name -> id), ``producer`` (tensor
    name -> id of the node or source producing it), ``consumers`` (tensor name -> ids of the op
    nodes and outputs reading it), and ``graph``, the frozen networkx view, built on first use (most
    passes read only the maps: networkx is imported when a graph algorithm needs it)."""

    _on_demand = ("_graph",)   # built from the others (ir.analyses compares the rest)

    def __init__(self, nodes: list[dict], edges: dict, node_id: dict[str, int], producer: dict[str, int],
                 consumers: dict[str, list[int]]):
        self._nodes, self._edges = nodes, edges          # per id its attributes; (src, dst, tensor) -> slots
        self.node_id, self.producer, self.consumers = node_id, producer, consumers
        self._graph = None

    @property
    def graph(self):
        """The frozen ``networkx.MultiDiGraph`` (nodes: ids with ``kind``, ``name``, ``op``; edges
        keyed by tensor name with their ``slots``)."""
        if self._graph is None:
            import networkx as nx

            g = nx.MultiDiGraph()
            g.add_nodes_from(enumerate(self._nodes))
            g.add_edges_from((src, dst, key, {"slots": slots}) for (src, dst, key), slots in self._edges.items())
            self._graph = nx.freeze(g)
        return self._graph

    def name(self, node: int) -> str:
        return self._nodes[node]["name"]

    def op(self, node: int) -> str | None:
        return self._nodes[node].get("op")

    def kind(self, node: int) -> str:
        return self._nodes[node]["kind"]

    def readers(self, tensor: str) -> list[str]:
        """Names of the op nodes that read ``tensor`` (each once, in graph order)."""
        seen = dict.fromkeys(self.name(n) for n in self.consumers.get(tensor, ()) if self.kind(n) == "op")
        return list(seen)

    def writer(self, tensor: str) -> str | None:
        """Name of the op node producing ``tensor``, or None for inputs and constants."""
        node = self.producer.get(tensor)
        return self.name(node) if node is not None and self.kind(node) == "op" else None


@analysis(GRAPH)
def dataflow(model: QModel) -> Dataflow:
    """The dataflow view of ``model``."""
    nodes: list[dict] = []
    edges: dict[tuple, list[int]] = {}
    node_id: dict[str, int] = {}
    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}

    def source(tensor: gs.Tensor) -> int:
        kind = "initializer" if isinstance(tensor, gs.Constant) else "input"
        nodes.append({"kind": kind, "name": tensor.name})
        producer[tensor.name] = len(nodes) - 1
        return len(nodes) - 1

    for tensor in model.graph.inputs:
        source(tensor)
    for node in model.graph.nodes:
        nid = len(nodes)
        nodes.append({"kind": "op", "name": node.name, "op": node.op})
        node_id[node.name] = nid
        for slot, tensor in enumerate(node.inputs):
            if not tensor.name:  # omitted optional input
                continue
            if tensor.name not in producer:
                source(tensor)
            edge = (producer[tensor.name], nid, tensor.name)
            if edge in edges:
                edges[edge].append(slot)
                continue
            edges[edge] = [slot]
            consumers.setdefault(tensor.name, []).append(nid)
        for tensor in node.outputs:
            if tensor.name:
                producer[tensor.name] = nid
    for tensor in model.graph.outputs:
        nodes.append({"kind": "output", "name": tensor.name})
        if tensor.name in producer:
            edges[(producer[tensor.name], len(nodes) - 1, tensor.name)] = [0]
        consumers.setdefault(tensor.name, []).append(len(nodes) - 1)
    return Dataflow(nodes, edges, node_id, producer, consumers)
