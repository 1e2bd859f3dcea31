"""Checks on a ModelProto before it becomes a QModel: each problem is one ModelError line."""
from __future__ import annotations

import functools
import math

import numpy as np
import onnx
from onnx import helper

from ..errors import ModelError
from .graphutil import DEFAULT_DOMAINS, default_opset, proto_subgraphs

MAX_ELEMENTS = 2**48   # 256 T elements: far beyond any model, far below an int64 byte count
MIN_OPSET = 7   # onnxruntime runs opset 7 and newer; quantizing pipelines upgrade below 10 (upgrade.py)
_FIXED_SIZE = {t: np.dtype(helper.tensor_dtype_to_np_dtype(t)).itemsize
               for t in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                         onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT8, onnx.TensorProto.UINT8,
                         onnx.TensorProto.INT16, onnx.TensorProto.UINT16, onnx.TensorProto.INT32,
                         onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
                         onnx.TensorProto.BOOL)}


def validate_proto(proto: onnx.ModelProto) -> None:
    """Graph present and non-empty, a supported opset, sane initializers, every input produced once."""
    if not proto.HasField("graph"):
        raise ModelError("model has no graph (not an ONNX model?)")
    graph = proto.graph
    if not graph.node:
        raise ModelError("model graph is empty (no nodes)")
    _check_opset(proto)
    for tensor in graph.initializer:
        _check_initializer(tensor)
    for sparse in graph.sparse_initializer:
        raise ModelError(f"initializer '{sparse.values.name}' is sparse: qpasses needs dense initializers")
    _check_unique("graph input", [i.name for i in graph.input])
    _check_unique("initializer", [t.name for t in graph.initializer])
    _check_ops(proto)
    produced = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    produced |= {t.name for t in graph.sparse_initializer}
    for node in graph.node:
        for name in node.output:
            if not name:
                continue
            if name in produced:
                raise ModelError(f"tensor '{name}' is produced twice (node '{node.name or node.op_type}' "
                                 f"and an earlier node, input or initializer)")
            produced.add(name)
    for node in graph.node:
        for name in node.input:
            if name and name not in produced:
                raise ModelError(f"node '{node.name or node.op_type}' reads '{name}', which no node, "
                                 f"graph input or initializer produces")
    for out in graph.output:
        if out.name not in produced:
            raise ModelError(f"graph output '{out.name}' is not produced by any node")
    _check_types(proto)
    for node in graph.node:
        _check_subgraphs(node, produced)


def _check_subgraphs(node: onnx.NodeProto, outer: set) -> None:
    """Every name a subgraph (If/Loop/Scan body) reads is its own or an outer scope's."""
    for attr, sub in proto_subgraphs(node):
        known = set(outer) | {i.name for i in sub.input} | {t.name for t in sub.initializer}
        known |= {o for n in sub.node for o in n.output if o}
        for inner in sub.node:
            for name in inner.input:
                if name and name not in known:
                    raise ModelError(f"node '{inner.name or inner.op_type}' in the '{attr}' graph of "
                                     f"'{node.name or node.op_type}' reads '{name}', which nothing produces")
            _check_subgraphs(inner, known)
        for out in sub.output:
            if out.name not in known:
                raise ModelError(f"the '{attr}' graph of '{node.name or node.op_type}' has output "
                                 f"'{out.name}', which nothing produces")


def _type_name(elem_type: int) -> str:
    return helper.tensor_dtype_to_string(elem_type).removeprefix("TensorProto.").lower()


def _check_types(proto: onnx.ModelProto) -> None:
    """Graph inputs have an element type; initializers have types their readers accept (a STRING
    Conv bias is refused here, not deep inside a pass)."""
    graph = proto.graph
    for vi in graph.input:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type == onnx.TensorProto.UNDEFINED:
            raise ModelError(f"graph input '{vi.name}' has no element type")
    opset = default_opset(proto)
    types = {t.name: t.data_type for t in graph.initializer}
    for node in graph.node:
        if node.domain not in DEFAULT_DOMAINS or not any(n in types for n in node.input):
            continue
        formals = _formal_types(node.op_type, opset)
        if formals is None:   # a model-local function: no schema
            continue
        for index, name in enumerate(node.input):
            if name not in types or not formals:
                continue
            allowed = formals[min(index, len(formals) - 1)]
            actual = f"tensor({_type_name(types[name])})"
            if actual not in allowed:
                raise ModelError(f"node '{node.name or node.op_type}' ({node.op_type}): input {index} "
                                 f"'{name}' is a {_type_name(types[name])} initializer, which "
                                 f"{node.op_type} does not accept")


@functools.lru_cache(maxsize=1024)
def _formal_types(op_type: str, opset: int) -> tuple[frozenset, ...] | None:
    """The types each formal input of the op's schema accepts (None: no schema)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except Exception:
        return None
    constraints = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    return tuple(constraints.get(f.type_str, frozenset({f.type_str})) for f in schema.inputs)


def _check_unique(what: str, names: list[str]) -> None:
    if len(set(names)) != len(names):
        seen = set()
        dup = next(n for n in names if n in seen or seen.add(n))
        raise ModelError(f"{what} '{dup}' is listed twice")


def _check_ops(proto: onnx.ModelProto) -> None:
    """Every default-domain op of the top-level graph exists in the model's opset."""
    opset = default_opset(proto)
    local = {f.name for f in proto.functions if f.domain in DEFAULT_DOMAINS}
    checked = set(local)
    for node in proto.graph.node:
        if node.domain not in DEFAULT_DOMAINS or node.op_type in checked:
            continue
        if not onnx.defs.has(node.op_type, opset, ""):
            first = next((v for v in range(opset + 1, onnx.defs.onnx_opset_version() + 1)
                          if onnx.defs.has(node.op_type, v, "")), None)
            since = f" (it needs opset {first})" if first else ""
            raise ModelError(f"node '{node.name or node.op_type}': '{node.op_type}' is not an ONNX "
                             f"operator in opset {opset}{since}")
        checked.add(node.op_type)


def _check_opset(proto: onnx.ModelProto) -> None:
    default = default_opset(proto)
    if default is None:
        raise ModelError("model imports no default-domain opset")
    if default < MIN_OPSET:
        raise ModelError(f"opset {default} is too old: onnxruntime runs opset {MIN_OPSET} or newer "
                         f"(upgrade with onnx.version_converter)")
    newest = max_ort_opset()
    if default > newest:
        raise ModelError(f"opset {default} is newer than the installed onnxruntime runs (up to {newest})")


def _check_initializer(tensor: onnx.TensorProto) -> None:
    dims = list(tensor.dims)
    if any(d < 0 for d in dims):
        raise ModelError(f"initializer '{tensor.name}': negative dimension in shape {dims}")
    count = math.prod(dims)   # Python integers: numpy's int64 product wraps around (to 0, even)
    if count >= MAX_ELEMENTS:
        raise ModelError(f"initializer '{tensor.name}': shape {dims} holds {count} elements (more than "
                         f"any file can hold)")
    if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.data_type not in _FIXED_SIZE:
        return
    if tensor.HasField("raw_data"):
        size = len(tensor.raw_data)   # a copy of the bytes (protobuf has no length call): read once
        expected = count * _FIXED_SIZE[tensor.data_type]
        if size != expected:
            raise ModelError(f"initializer '{tensor.name}': {size} bytes of data for shape "
                             f"{list(tensor.dims)} (expected {expected})")
        return
    field = helper.tensor_dtype_to_field(tensor.data_type)
    have = len(getattr(tensor, field))
    if tensor.data_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16) or have == count:
        return
    raise ModelError(f"initializer '{tensor.name}': {have} values for shape {list(tensor.dims)} (expected {count})")


def _ort_accepts(ir_version: int, opset: int) -> bool:
    """Whether the installed onnxruntime opens a one-Identity model of this IR version and opset."""
    import onnxruntime as ort

    node = helper.make_node("Identity", ["x"], ["y"])
    vi = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1]) for n in "xy"]
    model = helper.make_model(helper.make_graph([node], "probe", vi[:1], vi[1:]),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return True
    except Exception:
        return False


@functools.lru_cache(maxsize=1)
def max_ort_ir_version() -> int:
    """Highest IR version the installed onnxruntime accepts (probed once with a tiny model)."""
    return next((v for v in range(onnx.IR_VERSION, 6, -1) if _ort_accepts(v, 13)), 7)


@functools.lru_cache(maxsize=1)
def max_ort_opset() -> int:
    """Newest default-domain opset the installed onnxruntime accepts (probed once)."""
    ir_version = max_ort_ir_version()
    return next((o for o in range(onnx.defs.onnx_opset_version(), 6, -1) if _ort_accepts(ir_version, o)),
                MIN_OPSET)
