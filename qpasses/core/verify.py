"""IR invariants checked between passes: structure, onnx.checker, and an onnxruntime session."""
from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

from ..errors import ModelError
from ..ir.model import QModel, tensor_map

LEVELS = ("structure", "checker", "ort", "reload")


def check_structure(model: QModel) -> None:
    """Sorted, uniquely named nodes and tensors; every node input produced before it is read; the
    same in every If/Loop/Scan body, which also reads what its enclosing graphs produced before
    the node holding it (and may not produce those names again)."""
    node_names: set[str] = set()

    def check(graph, available: set[str], where: str) -> None:
        available = available | {t.name for t in graph.inputs}
        available |= {t.name for t in tensor_map(graph).values() if t.__class__.__name__ == "Constant"}
        for node in graph.nodes:
            if node.name:
                if node.name in node_names:
                    raise ModelError(f"duplicate node name '{node.name}'{where}")
                node_names.add(node.name)
            for t in node.inputs:
                if t.name and t.name not in available:
                    raise ModelError(f"node '{node.name}' ({node.op}){where} reads '{t.name}', which nothing "
                                     f"produces before it (graph not sorted, or a dangling input)")
            for attr, value in node.attrs.items():
                for sub in [value] if isinstance(value, gs.Graph) else []:
                    check(sub, available, f" in the {attr} of {node.op} '{node.name}'")
            for t in node.outputs:
                if t.name in available:
                    raise ModelError(f"tensor '{t.name}'{where} is produced twice")
                available.add(t.name)
        for t in graph.outputs:
            if t.name not in available:
                raise ModelError(f"graph output '{t.name}'{where} is not produced by any node")

    check(model.graph, set(), "")


def check_onnx(model: QModel | onnx.ModelProto) -> onnx.ModelProto:
    """Run onnx.checker (full check) on the exported model; returns the proto."""
    proto = model.to_proto() if isinstance(model, QModel) else model
    try:
        if proto.ByteSize() < 2**31 - 1:
            onnx.checker.check_model(proto, full_check=False)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"onnx.checker: {str(exc).strip().splitlines()[0]}") from None
    return proto


def check_ort(model: QModel | onnx.ModelProto):
    """Create an onnxruntime CPU session for the model; returns the session."""
    from ..calibration.sessions import ort_session

    proto = model.to_proto() if isinstance(model, QModel) else model
    try:
        return ort_session(proto.SerializeToString())
    except Exception as exc:
        raise ModelError(f"onnxruntime cannot load the model: {str(exc).strip().splitlines()[0]}") from None


def verify(model: QModel, level: str) -> None:
    """Check the invariants up to ``level`` (structure < checker < ort)."""
    check_structure(model)
    if level in ("checker", "ort"):
        proto = check_onnx(model)
        if level == "ort":
            check_ort(proto)
