"""Which weights weight-only quantization rewrites: constant 2-D float B of MatMul, and of Gemm
(alpha = beta = 1, transA = 0, bias absent or constant [N]) read by no other kind of node."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..ir.model import constant_dtype, read_values

FLOAT_KINDS = ("float32", "float16")


@dataclass
class Target:
    node: gs.Node
    weight: gs.Constant
    transposed: bool          # the weight is W^T [N, K] (Gemm transB = 1)
    dtype: np.dtype           # the weight's float type (float32 or float16)

    @property
    def matrix(self) -> np.ndarray:
        """W [K, N] as float32."""
        w = read_values(self.weight)   # read only: the float weight is replaced once quantized
        return (w.T if self.transposed else w).astype(np.float32, copy=False)

    @property
    def activation(self) -> gs.Tensor:
        return self.node.inputs[0]


def _eligible(node: gs.Node) -> Target | None:
    if node.op not in ("MatMul", "Gemm") or len(node.inputs) < 2:
        return None
    a, b = node.inputs[0], node.inputs[1]
    if isinstance(a, gs.Constant) or not isinstance(b, gs.Constant):
        return None
    kind = constant_dtype(b)
    if kind not in FLOAT_KINDS or len(b.shape) != 2 or 0 in b.shape:
        return None
    if node.op == "MatMul":
        rank = None if a.shape is None else len(a.shape)
        return Target(node, b, False, np.dtype(kind)) if rank is None or rank >= 2 else None
    attrs = node.attrs
    if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
        return None
    transposed = bool(attrs.get("transB", 0))
    n = b.shape[0] if transposed else b.shape[1]
    if len(node.inputs) > 2 and node.inputs[2].name:
        c = node.inputs[2]
        if not isinstance(c, gs.Constant) or int(np.prod(c.shape)) != n or c.shape[-1] != n:
            return None
    return Target(node, b, transposed, np.dtype(kind))


def find_targets(graph: gs.Graph, exclude=()) -> tuple[list[Target], dict[str, str]]:
    """(targets in graph order, {weight or node: why it is left float}). ``exclude`` holds node
    or weight names or fnmatch patterns."""
    readers: dict[str, list[gs.Node]] = {}
    for node in graph.nodes:
        for t in node.inputs:
            if isinstance(t, gs.Constant):
                readers.setdefault(t.name, []).append(node)
    out, skipped, seen = [], {}, set()
    for node in graph.nodes:
        target = _eligible(node)
        if target is None:
            continue
        name = target.weight.name
        if any(fnmatch.fnmatchcase(node.name, p) or fnmatch.fnmatchcase(name, p) for p in exclude):
            skipped[name] = f"excluded by weight_only.exclude (node '{node.name}')"
            continue
        others = [r for r in readers.get(name, []) if _eligible(r) is None or r.inputs.index(target.weight) != 1]
        if others or any(t.weight.name == name for t in out) or name in seen:
            seen.add(name)
            skipped[name] = "read by several nodes" if not others else f"also read by '{others[0].name}' ({others[0].op})"
            out = [t for t in out if t.weight.name != name]
            continue
        out.append(target)
    return out, skipped
