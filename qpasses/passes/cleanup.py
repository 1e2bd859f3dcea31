"""cleanup: remove dead nodes and unused initializers, merge duplicate initializers, sort the graph."""
from __future__ import annotations

import hashlib
from typing import ClassVar

import onnx_graphsurgeon as gs

from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..ir.graphutil import node_reads, overridable_initializers, remove_nodes, replace_all_uses, topological_order
from ..ir.model import QModel, is_sparse, model_tensor_map, raw_bytes


@register
class Cleanup(Pass):
    """Remove dead nodes and unused initializers, merge identical initializers, sort topologically.

    Reads: the graph; graph outputs define what is live (subgraph reads of outer tensors count).

    Writes: drops nodes that no graph output depends on (initializers only they read go too, and
    the table entries and ranges of the tensors removed);
    initializers with the same dtype, shape and bytes are merged into the first one in graph order
    (readers rewired; never initializers that are graph outputs or that the user may feed, nor two
    with different quantization-table entries); nodes are left in a stable topological order.

    Invariants: graph outputs and inputs are unchanged (except an initializer also listed as an input
    that no live node reads: it leaves the inputs, as on any load/save); a second run changes nothing.
    """

    name: ClassVar[str] = "cleanup"
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated", "qparams-computed", "qdq-inserted",
                                                "weights-quantized", "converts-inserted", "dynamic-quantized"})
    example: ClassVar[str] = """\
<ir_version: 10, opset_import: ["" : 17]>
g (float[2] x) => (float[2] y) <float[2] a = {1,2}, float[2] b = {1,2}, float[2] c = {3,4}> {
   t = Mul (x, a)
   unused = Sub (x, c)
   y = Add (t, b)
}"""
    example_prelude: ClassVar[str] = ""

    def run(self, model: QModel, ctx) -> PassResult:
        graph = model.graph
        order = topological_order(graph)
        live_names = {t.name for t in graph.outputs}
        live, dead = [], []
        for node in reversed(order):
            if any(t.name in live_names for t in node.outputs):
                live.append(node)
                live_names.update(node_reads(node))
            else:
                dead.append(node)
        live.reverse()
        before = _initializers(order, graph)
        present = set(model_tensor_map(graph)) if dead else set()   # body tensors too
        # a dead DQ of a value still quantized (its readers moved to DQs inside bodies) removes no value
        dequantized = {n.outputs[0].name: n.inputs[0].name for n in dead
                       if n.op == "DequantizeLinear" and n.inputs and n.outputs}
        remove_nodes(graph, dead)
        reordered = any(a is not b for a, b in zip(live, graph.nodes))
        graph.nodes = live
        if dead:
            after = set(model_tensor_map(graph))
            _forget_removed(model, {n for n in present - after if dequantized.get(n) not in after})
        merged = _merge_duplicates(model, live)
        removed = len(before) - len(_initializers(live, graph)) - merged
        stats = {"nodes_removed": len(dead), "initializers_removed": removed,
                 "initializers_merged": merged, "reordered": int(reordered)}
        return PassResult(model, bool(dead or merged or reordered or removed), stats)


def _forget_removed(model: QModel, removed: set[str]) -> None:
    """Drop the table entries and ranges of the tensors this cleanup removed, and the entries that
    share or derive from them (they were computed from a removed tensor, so they are gone too).
    Entries of tensors already absent stay: a weight insert-qdq replaced by its quantized copy."""
    gone = {name for name in model.quant if name in removed}
    while gone:
        for name in gone:
            del model.quant[name]
        gone = {name for name, tq in model.quant.items()
                if tq.shares in gone or (tq.derived_from and gone.intersection(tq.derived_from))}
    for table in (model.ranges, model.observed):
        for key in [k for k in table if k.split("::")[0] in removed]:
            del table[key]


def _initializers(nodes, graph: gs.Graph) -> set[str]:
    names = {t.name for node in nodes for t in node.inputs if isinstance(t, gs.Constant)}
    return names | {t.name for t in graph.outputs if isinstance(t, gs.Constant)}


def _fingerprint(data) -> bytes:
    """Hash of the bytes; of 3 x 4 KiB samples and the length for large ones (equal constants
    have equal fingerprints; candidates are then compared in full, so weights of a large model
    are not all hashed end to end)."""
    n = len(data)
    if n > 65536:
        data = b"".join(bytes(data[i:i + 4096]) for i in (0, n // 2, n - 4096)) + n.to_bytes(8, "little")
    return hashlib.blake2b(data, digest_size=16).digest()


def _merge_duplicates(model: QModel, nodes: list[gs.Node]) -> int:
    """Rewire readers of initializers equal to an earlier one; returns how many were merged."""
    graph = model.graph
    protected = overridable_initializers(model) | {t.name for t in graph.outputs} | {t.name for t in graph.inputs}
    by_shape: dict[tuple, list[gs.Constant]] = {}
    seen: set[int] = set()
    for node in nodes:
        for t in node.inputs:
            if isinstance(t, gs.Constant) and id(t) not in seen and t.name not in protected:
                seen.add(id(t))
                if is_sparse(t):
                    continue
                by_shape.setdefault((t.dtype, tuple(t.shape)), []).append(t)
    merged, renames = 0, {}
    for group in by_shape.values():
        if len(group) < 2:
            continue
        first: dict[bytes, gs.Constant] = {}
        for t in group:
            data = raw_bytes(t)
            exact = len(data) <= 64   # scales, zero points: the bytes are the key
            keep = first.setdefault(data if exact else _fingerprint(data), t)
            if keep is t or (not exact and raw_bytes(keep) != data) or not _same_quant(model, keep.name, t.name):
                continue
            if t.name in model.quant:
                renames[t.name] = keep.name
            replace_all_uses(t, keep)
            merged += 1
    model.quant.rename_many(renames)  # one pass over the table (a pass per merge was quadratic)
    return merged


def _same_quant(model: QModel, a: str, b: str) -> bool:
    qa, qb = model.quant.get(a), model.quant.get(b)
    return (qa is None and qb is None) or (qa is not None and qb is not None and qa.to_dict() == qb.to_dict())
