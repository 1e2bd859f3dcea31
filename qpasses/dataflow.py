"""Read-only networkx view of a QModel's dataflow, cached per model generation.

Nodes are integers: one per op node (attribute ``kind="op"``), graph input (``"input"``),
constant tensor (``"initializer"``) and graph output (``"output"``). Every edge carries the tensor
name as its key and ``slots``, the input positions at which the reader reads it (a tensor read
twice by one node is one edge with two slots).
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import onnx_graphsurgeon as gs

from .ir import QModel


@dataclass(frozen=True)
class Dataflow:
    graph: nx.MultiDiGraph            # frozen
    node_id: dict[str, int]           # op node name -> id
    producer: dict[str, int]          # tensor name -> id of the node (or source) producing it
    consumers: dict[str, list[int]]   # tensor name -> ids of the op nodes (and outputs) reading it

    def name(self, node: int) -> str:
        return self.graph.nodes[node]["name"]

    def op(self, node: int) -> str | None:
        return self.graph.nodes[node].get("op")

    def readers(self, tensor: str) -> list[str]:
        """Names of the op nodes that read ``tensor`` (each once, in graph order)."""
        seen = dict.fromkeys(self.name(n) for n in self.consumers.get(tensor, ())
                             if self.graph.nodes[n]["kind"] == "op")
        return list(seen)

    def writer(self, tensor: str) -> str | None:
        """Name of the op node producing ``tensor``, or None for inputs and constants."""
        node = self.producer.get(tensor)
        return self.name(node) if node is not None and self.graph.nodes[node]["kind"] == "op" else None


def dataflow(model: QModel) -> Dataflow:
    """The dataflow view of ``model``; rebuilt after each ``model.touch()``."""
    return model.cached("dataflow", _build)


def _build(model: QModel) -> Dataflow:
    g = nx.MultiDiGraph()
    node_id: dict[str, int] = {}
    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    next_id = 0

    def source(tensor: gs.Tensor) -> int:
        nonlocal next_id
        kind = "initializer" if isinstance(tensor, gs.Constant) else "input"
        g.add_node(next_id, kind=kind, name=tensor.name)
        producer[tensor.name] = next_id
        next_id += 1
        return next_id - 1

    for tensor in model.graph.inputs:
        source(tensor)
    for node in model.graph.nodes:
        nid = next_id
        next_id += 1
        g.add_node(nid, kind="op", name=node.name, op=node.op)
        node_id[node.name] = nid
        for slot, tensor in enumerate(node.inputs):
            if not tensor.name:  # omitted optional input
                continue
            if tensor.name not in producer:
                source(tensor)
            src = producer[tensor.name]
            if g.has_edge(src, nid, key=tensor.name):
                g.edges[src, nid, tensor.name]["slots"].append(slot)
                continue
            g.add_edge(src, nid, key=tensor.name, slots=[slot])
            consumers.setdefault(tensor.name, []).append(nid)
        for tensor in node.outputs:
            if tensor.name:
                producer[tensor.name] = nid
    for tensor in model.graph.outputs:
        g.add_node(next_id, kind="output", name=tensor.name)
        if tensor.name in producer:
            g.add_edge(producer[tensor.name], next_id, key=tensor.name, slots=[0])
        consumers.setdefault(tensor.name, []).append(next_id)
        next_id += 1
    return Dataflow(nx.freeze(g), node_id, producer, consumers)
