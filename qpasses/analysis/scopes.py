"""Where each tensor of a model with If/Loop/Scan bodies lives (a cached analysis of the graph).

The quantization table (qpasses.ir.annotations) is keyed by tensor name, in bodies as in the main
graph. ONNX keeps names unique within a graph (SSA) and forbids a body to redefine a name of an
enclosing graph, but sibling bodies (the two branches of an If, two Loops) may each define the
same name. Hence the key scheme:

- a tensor defined (graph input, node output or own initializer) in exactly one graph of the
  model is keyed by its plain name, wherever it lives (``home`` says which graph);
- a name defined in several graphs is *ambiguous*: it gets no entry and stays float, with a reason
  naming the graphs (``ambiguous_reason``); equal constants of one name (a copy of an outer
  initializer that an exporter wrote into each body reading it) are one tensor, not ambiguous;
- a tensor a body reads from an enclosing graph (outer scope) is that graph's tensor: it is
  quantized where it is produced, and each body reading it gets its own DequantizeLinear
  (insert-qdq), so the body's weighted ops see a DQ in their own graph, as onnxruntime's QDQ
  fusions need.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from ..ir.graphutil import holds_graph, named_subgraphs
from ..ir.analyses import GRAPH, analysis
from ..ir.model import QModel


@dataclass(frozen=True)
class Scope:
    """One graph of the model: the main graph (index 0) or a body held by ``owner``'s ``attr``."""

    graph: gs.Graph
    owner: gs.Node | None = None
    attr: str = ""
    parent: int | None = None

    def where(self) -> str:
        """'the main graph' or "the then_branch of If 'if'"."""
        if self.owner is None:
            return "the main graph"
        return f"the {self.attr} of {self.owner.op} '{self.owner.name}'"


@dataclass
class Scopes:
    scopes: list[Scope]
    home: dict[str, int]                    # unambiguous tensor name -> index of the defining scope
    ambiguous: dict[str, list[int]]         # name -> indices of the scopes defining it (2 or more)
    node_scope: dict[int, int] = field(default_factory=dict)   # id(node) -> scope index

    @property
    def has_bodies(self) -> bool:
        return len(self.scopes) > 1

    def in_body(self, name: str) -> bool:
        """Whether ``name`` is defined inside an If/Loop/Scan body (ambiguous names too)."""
        return self.home.get(name, 0) != 0 or name in self.ambiguous

    def scope_of(self, node: gs.Node) -> int:
        return self.node_scope.get(id(node), 0)

    def where(self, name: str) -> str:
        """Where ``name`` is defined ('' for the main graph)."""
        index = self.home.get(name, 0)
        return "" if index == 0 else self.scopes[index].where()

    def ambiguous_reason(self, name: str) -> str:
        places = " and ".join(self.scopes[i].where() for i in self.ambiguous[name][:2])
        more = f" (and {len(self.ambiguous[name]) - 2} more)" if len(self.ambiguous[name]) > 2 else ""
        return (f"the name '{name}' is defined in {places}{more}: the quantization table is keyed by "
                f"tensor name, so qpasses cannot tell them apart (rename one to quantize it)")

    def body_nodes(self):
        """(node, scope index) of every node inside a body, bodies in preorder."""
        for index, scope in enumerate(self.scopes[1:], 1):
            for node in scope.graph.nodes:
                yield node, index

    def readers_in(self, tensor: gs.Tensor, index: int) -> list[gs.Node]:
        """The nodes of scope ``index`` reading ``tensor`` (each once)."""
        return list({id(n): n for n in tensor.outputs if self.node_scope.get(id(n), 0) == index}.values())


@analysis(GRAPH)
def scopes(model: QModel) -> Scopes:
    """The scopes of ``model`` (see the module docstring). A model without bodies has one scope
    and empty indexes (every name lives in the main graph)."""
    return build_scopes(model.graph) if model.bodies() else Scopes([Scope(model.graph)], {}, {})


def build_scopes(graph: gs.Graph) -> Scopes:
    found = [Scope(graph)]
    node_scope: dict[int, int] = {}
    defined: dict[str, list[tuple[int, gs.Tensor]]] = {}
    visible: dict[int, int] = {}   # id(tensor) -> scope defining it (an enclosing one, for a body)

    def walk(index: int) -> None:
        g = found[index].graph
        local: dict[str, gs.Tensor] = {t.name: t for t in g.inputs if t.name}
        for node in g.nodes:
            node_scope[id(node)] = index
            for t in node.inputs:
                if t.name and isinstance(t, gs.Constant) and id(t) not in visible:
                    local.setdefault(t.name, t)
            for t in node.outputs:
                if t.name:
                    local[t.name] = t
        for name, t in local.items():
            visible.setdefault(id(t), index)
            defined.setdefault(name, []).append((index, t))
        for node in g.nodes:
            for attr, sub in named_subgraphs(node):
                found.append(Scope(sub, node, attr, index))
                walk(len(found) - 1)

    walk(0)
    home: dict[str, int] = {}
    ambiguous: dict[str, list[int]] = {}
    for name, places in defined.items():
        distinct = _distinct(places)
        if len(distinct) == 1:
            home[name] = places[0][0]
        else:
            ambiguous[name] = [index for index, _ in distinct]
    return Scopes(found, home, ambiguous, node_scope)


def _distinct(places: list[tuple[int, gs.Tensor]]) -> list[tuple[int, gs.Tensor]]:
    """The definitions that are different tensors (equal constants of one name count once)."""
    out: list[tuple[int, gs.Tensor]] = []
    for index, t in places:
        if not any(t is u or _same_constant(t, u) for _, u in out):
            out.append((index, t))
    return out


def _same_constant(a: gs.Tensor, b: gs.Tensor) -> bool:
    if not (isinstance(a, gs.Constant) and isinstance(b, gs.Constant)):
        return False
    try:
        x, y = np.asarray(a.values), np.asarray(b.values)
    except Exception:   # values gs cannot load as numpy
        return False
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)


def has_bodies(graph: gs.Graph) -> bool:
    """Whether any node of ``graph`` holds a subgraph (cheap: no scope analysis)."""
    return any(holds_graph(v) for node in graph.nodes for v in node.attrs.values())



UNOBSERVED = ("calibration never observed it: the If/Loop/Scan body holding it did not run on the calibration "
              "data (or its values vary in length from one Scan iteration to the next)")


def unobserved(model: QModel, names, ranges: dict) -> list[str]:
    """Body activations among ``names`` (None: every float tensor) that calibration gave no range."""
    sc = scopes(model)
    if not sc.has_bodies:
        return []
    if names is None:
        from .dtypes import float_tensors
        names = float_tensors(model)
    tensors = model.tensors()
    return sorted(n for n in names if sc.home.get(n, 0) and n not in ranges
                  and isinstance(tensors.get(n), gs.Variable))


def all_nodes(model: QModel) -> list[gs.Node]:
    """The main graph's nodes, then those of its If/Loop/Scan bodies (each body after its
    enclosing graph, so tensors a body reads from outside come first)."""
    sc = scopes(model)
    return [*model.graph.nodes, *(n for n, _ in sc.body_nodes())] if sc.has_bodies else list(model.graph.nodes)
