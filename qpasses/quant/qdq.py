"""Building blocks shared by insert-qdq and insert-converts.

Quantization parameters of one Q/DQ (``QParams``), unique readable names (``new_namer``), scale and
zero-point initializers, Q and DQ nodes, quantized initializers, rewiring readers, placing new
nodes in a sorted graph, and raising the opset safely (``require_opset``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np
import onnx
import onnx.defs
import onnx_graphsurgeon as gs

from ..analysis.dtypes import float_type_name
from ..errors import ModelError
from ..ir.graphutil import in_default_domain, unique_name
from ..ir.model import QModel, from_proto, model_tensor_map
from ..ir.opset_convert import convert
from .oprules import DQ_OP, FLOAT_WEIGHT_OPS, Q_OP
from .qparams import quantize
from .qtypes import PER_AXIS_MIN_OPSET, QType, qtype

FLOAT_SCALE_MIN_OPSET = 19   # float16/bfloat16 scales (and DQ outputs)
_SUBBYTE = {"int4": ml_dtypes.int4, "uint4": ml_dtypes.uint4}


# -- quantization parameters -----------------------------------------------------------------
@dataclass(frozen=True)
class QParams:
    """What one Q or DQ node needs: type, scale and zero point (one value, or one per ``axis`` index)."""

    qtype: QType
    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    axis: int | None = None

    @classmethod
    def make(cls, tensor: str, qtype_name: str, scale, zero_point, axis=None, rank=None) -> "QParams":
        """Validated QParams; one value means per-tensor (``axis`` dropped)."""
        qt = qtype(qtype_name)
        if not scale or not zero_point:
            raise ModelError(f"tensor '{tensor}': no scale/zero point in the table (run compute-qparams)")
        scale = tuple(float(s) for s in scale)
        zero_point = tuple(int(z) for z in zero_point)
        if len(zero_point) != len(scale):
            raise ModelError(f"tensor '{tensor}': {len(scale)} scales but {len(zero_point)} zero points")
        if not all(math.isfinite(s) and s > 0 for s in scale):
            raise ModelError(f"tensor '{tensor}': scale must be finite and positive, got {list(scale)}")
        if not all(qt.qmin <= z <= qt.qmax for z in zero_point):
            raise ModelError(f"tensor '{tensor}': zero point outside the {qt.name} range")
        if len(scale) == 1:
            return cls(qt, scale, zero_point, None)
        if axis is None:
            raise ModelError(f"tensor '{tensor}': {len(scale)} scales but no axis")
        if rank is not None:
            if not -rank <= axis < rank:
                raise ModelError(f"tensor '{tensor}': axis {axis} is out of range for rank {rank}")
            axis %= rank
        return cls(qt, scale, zero_point, int(axis))

    @classmethod
    def of(cls, tensor: str, entry, rank=None) -> "QParams":
        """From a TensorQuant table entry."""
        return cls.make(tensor, entry.qtype, entry.scale, entry.zero_point, entry.axis, rank)

    def scale_array(self, dtype) -> np.ndarray:
        values = np.asarray(self.scale, dtype=np.float64).astype(dtype)
        return values.reshape(()) if self.axis is None else values

    def zero_point_array(self) -> np.ndarray:
        values = np.asarray(self.zero_point, dtype=self.qtype.storage)
        values = values.reshape(()) if self.axis is None else values
        return to_onnx_storage(values, self.qtype)


def to_onnx_storage(values: np.ndarray, qt: QType) -> np.ndarray:
    """Integer values in the numpy dtype gs exports as ``qt`` (ml_dtypes int4/uint4 for 4-bit types)."""
    return values.astype(_SUBBYTE.get(qt.name, qt.storage))


def quantized_values(values, qp: QParams) -> np.ndarray:
    """A float array quantized with ``qp`` (qpasses.quant.qparams.quantize), in its ONNX storage dtype."""
    values = np.asarray(values)
    if qp.axis is not None and values.shape[qp.axis] != len(qp.scale):
        raise ModelError(f"shape {list(values.shape)} has {values.shape[qp.axis]} channels on axis "
                         f"{qp.axis}, but {len(qp.scale)} scales")
    return to_onnx_storage(quantize(values, qp.scale, qp.zero_point, qp.qtype, qp.axis), qp.qtype)


def float_dtype(tensor: gs.Tensor) -> np.dtype:
    """The float type of a tensor (float32 when gs does not know it)."""
    return scale_dtype(float_type_name(getattr(tensor, "dtype", None)) or "float32")


def scale_dtype(float_type: str) -> np.dtype:
    """Scales have the quantized tensor's float type: ONNX Q needs it (opset < 23), ORT CPU always.

    ``scale_type = "float16"`` on a float32 model therefore keeps float32 storage; compute-qparams
    already rounded the values to float16, so they are exactly the float16 scales.
    """
    return np.dtype(ml_dtypes.bfloat16) if float_type == "bfloat16" else np.dtype(float_type)


def min_opset(qp: QParams, scale_type: np.dtype) -> int:
    """Oldest default-domain opset whose Q/DQ accept these parameters."""
    need = qp.qtype.min_opset
    if qp.axis is not None:
        need = max(need, PER_AXIS_MIN_OPSET)
    if np.dtype(scale_type) != np.float32:
        need = max(need, FLOAT_SCALE_MIN_OPSET)
    return need


# -- names -----------------------------------------------------------------------------------
Namer = Callable[[str], str]


def new_namer(model: QModel) -> Namer:
    """Unique names for new tensors and nodes: ``base``, else ``base_1``, ``base_2``, ...
    (graphutil.unique_name over the model's tensor and node names)."""
    graphs = [model.graph, *model.bodies()]
    nodes = {n.name for g in graphs for n in g.nodes if n.name}
    return functools.partial(unique_name, taken=set(model.tensors()) | nodes)


# -- nodes and initializers ------------------------------------------------------------------
def qparam_constants(namer: Namer, base: str, qp: QParams, dtype) -> tuple[gs.Constant, gs.Constant]:
    """``<base>_scale`` and ``<base>_zero_point`` initializers (0-d when per-tensor)."""
    return (gs.Constant(namer(f"{base}_scale"), qp.scale_array(dtype)),
            gs.Constant(namer(f"{base}_zero_point"), qp.zero_point_array()))


def _axis_attrs(qp: QParams) -> dict:
    return {} if qp.axis is None else {"axis": qp.axis}


def make_q(namer: Namer, base: str, x: gs.Tensor, params, qp: QParams) -> gs.Node:
    """QuantizeLinear ``<base>_q``: x -> ``<base>_quantized``; ``params`` = (scale, zero point)."""
    out = gs.Variable(namer(f"{base}_quantized"), dtype=_SUBBYTE.get(qp.qtype.name, qp.qtype.storage),
                      shape=getattr(x, "shape", None))
    return gs.Node(Q_OP, namer(f"{base}_q"), attrs=_axis_attrs(qp), inputs=[x, *params], outputs=[out])


def make_dq(namer: Namer, base: str, q: gs.Tensor, params, qp: QParams, dtype,
            out: gs.Tensor | None = None, shape=None) -> gs.Node:
    """DequantizeLinear ``<base>_dq``: q -> ``out`` (default: a new ``<base>_dequantized``)."""
    if out is None:
        out = gs.Variable(namer(f"{base}_dequantized"), dtype=np.dtype(dtype), shape=shape)
    return gs.Node(DQ_OP, namer(f"{base}_dq"), attrs=_axis_attrs(qp), inputs=[q, *params], outputs=[out])


def redirect(tensor: gs.Tensor, new: gs.Tensor, *, only: set[str] | None = None, skip=()) -> int:
    """Make readers of ``tensor`` (all, or the nodes named in ``only``) read ``new``; returns how many."""
    count = 0
    for node in list(tensor.outputs):
        if any(node is s for s in skip) or (only is not None and node.name not in only):
            continue
        for i, inp in enumerate(node.inputs):
            if inp is tensor:
                node.inputs[i] = new
                count += 1
    return count


class Placement:
    """Collects new nodes by anchor, then rebuilds ``graph.nodes`` once, keeping it sorted."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self.index = {id(n): i for i, n in enumerate(graph.nodes)}
        self.head: list[gs.Node] = []
        self._before: dict[int, list[gs.Node]] = {}
        self._after: dict[int, list[gs.Node]] = {}
        self._dropped: set[int] = set()

    def after(self, node: gs.Node | None, new: list[gs.Node]) -> None:
        """Right after ``node`` (at the head of the graph when None or not a top-level node)."""
        i = self.index.get(id(node)) if node is not None else None
        (self.head if i is None else self._after.setdefault(i, [])).extend(new)

    def before_first_reader(self, tensor: gs.Tensor, new: list[gs.Node]) -> None:
        positions = [self.index[id(n)] for n in tensor.outputs if id(n) in self.index]
        (self._before.setdefault(min(positions), []) if positions else self.head).extend(new)

    def drop(self, node: gs.Node) -> None:
        """Remove ``node`` (disconnect it first)."""
        self._dropped.add(self.index[id(node)])

    def apply(self) -> None:
        nodes = list(self.head)
        for i, node in enumerate(self.graph.nodes):
            nodes.extend(self._before.get(i, ()))
            if i not in self._dropped:
                nodes.append(node)
            nodes.extend(self._after.get(i, ()))
        self.graph.nodes = nodes


class ScopedPlacement:
    """One ``Placement`` per graph of the model (``scopes``: the main graph and its If/Loop/Scan
    bodies, qpasses.analysis.scopes), made when first used; ``apply`` applies them all."""

    def __init__(self, scopes):
        self.scopes = scopes
        self._made: dict[int, Placement] = {}

    def __getitem__(self, index: int) -> Placement:
        if index not in self._made:
            self._made[index] = Placement(self.scopes.scopes[index].graph)
        return self._made[index]

    def apply(self) -> None:
        for place in self._made.values():
            place.apply()


def dequantize_in_bodies(dequantized, places: ScopedPlacement, namer: Namer) -> int:
    """Give each If/Loop/Scan body that reads the output of a DequantizeLinear of an enclosing
    graph its own DQ (the same quantized input, scale and zero point, read from the outer scope):
    onnxruntime fuses a DQ only with readers in its own graph. ``dequantized``: (DQ node, index of
    its scope). Returns the DQ nodes added."""
    sc, added = places.scopes, 0
    for dq, home in dequantized:
        out = dq.outputs[0]
        inner: dict[int, dict[int, gs.Node]] = {}
        for reader in out.outputs:
            index = sc.scope_of(reader)
            if index != home:
                inner.setdefault(index, {})[id(reader)] = reader
        for index, readers in inner.items():
            attr = sc.scopes[index].attr
            copy = gs.Node(DQ_OP, namer(f"{dq.name}_{attr}"), attrs=dict(dq.attrs), inputs=list(dq.inputs),
                           outputs=[gs.Variable(namer(f"{out.name}_{attr}"), dtype=out.dtype, shape=out.shape)])
            redirect(out, copy.outputs[0], only={r.name for r in readers.values()})
            places[index].before_first_reader(copy.outputs[0], [copy])
            added += 1
    return added


def producer(tensor: gs.Tensor) -> gs.Node | None:
    return tensor.inputs[0] if isinstance(tensor, gs.Variable) and tensor.inputs else None


def dequantizer(tensor: gs.Tensor) -> gs.Node | None:
    """The DequantizeLinear whose output carries ``tensor``'s value to its readers, if any.

    Either ``tensor`` is itself a DQ output (graph outputs, merged activations), or it feeds a
    QuantizeLinear whose output a DQ reads.
    """
    node = producer(tensor)
    if node is not None and node.op == DQ_OP:
        return node
    for reader in tensor.outputs:
        if reader.op == Q_OP and reader.inputs and reader.inputs[0] is tensor:
            for dq in reader.outputs[0].outputs:
                if dq.op == DQ_OP:
                    return dq
    return None


def is_quantized(tensor: gs.Tensor) -> bool:
    """Already has Q/DQ: produced by a DequantizeLinear or read by a QuantizeLinear."""
    node = producer(tensor)
    return (node is not None and node.op == DQ_OP) or any(
        r.op == Q_OP and r.inputs and r.inputs[0] is tensor for r in tensor.outputs)


# -- opset -----------------------------------------------------------------------------------
# Ops whose meaning changed at this opset while their signature stayed (nearly) the same: a plain
# bump would silently change results, so onnx.version_converter must rewrite them.
MEANING_CHANGED = {"Softmax": 13, "LogSoftmax": 13, "Hardmax": 13, "Resize": 11,
                   "GroupNormalization": 21, "RoiAlign": 16, "GridSample": 20}
# Forms of a node that a bump across this opset breaks although the op's signature is kept:
# from 18 an equal Split (no 'split' input) needs the num_outputs attribute.
BROKEN_FORMS = {"Split": (18, lambda node: len(node.inputs) < 2 or not node.inputs[1].name)}


def _schema(op: str, version: int):
    try:
        return onnx.defs.get_schema(op, version, "")
    except onnx.defs.SchemaError:
        return None


def _params_kept(old, new) -> bool:
    """Every old input/output keeps its name and place (a Single one may become Optional)."""
    if len(new) < len(old):
        return False
    kind = onnx.defs.OpSchema.FormalParameterOption
    for a, b in zip(old, new):
        if a.name != b.name or not (a.option == b.option or (a.option == kind.Single and b.option == kind.Optional)):
            return False
    return all(b.option == kind.Optional for b in new[len(old):])


def signature_kept(op: str, old_opset: int, new_opset: int) -> bool:
    """True when a node valid at ``old_opset`` means the same at ``new_opset`` without rewriting."""
    old, new = _schema(op, old_opset), _schema(op, new_opset)
    if old is None or new is None or new.deprecated:
        return False
    if old.since_version == new.since_version:
        return True
    if old.since_version < MEANING_CHANGED.get(op, 0) <= new.since_version:
        return False
    if not (_params_kept(old.inputs, new.inputs) and _params_kept(old.outputs, new.outputs)
            and len(old.outputs) == len(new.outputs)):
        return False
    for name, attr in old.attributes.items():
        if name not in new.attributes or new.attributes[name].type != attr.type:
            return False
    return not any(a.required for n, a in new.attributes.items() if n not in old.attributes)


def _default_domain_nodes(graph: gs.Graph):
    yield from (n for n in graph.nodes if in_default_domain(n))
    for sub in graph.subgraphs(recursive=True):
        yield from (n for n in sub.nodes if in_default_domain(n))


def ops_needing_rewrite(model: QModel, opset: int) -> dict[str, str]:
    """op type -> first node name, for the ops that a plain opset bump to ``opset`` would break."""
    old = model.opset
    found: dict[str, str] = {}
    verdict: dict[str, bool] = {}
    for node in _default_domain_nodes(model.graph):
        if node.op not in verdict:
            verdict[node.op] = signature_kept(node.op, old, opset)
        since, broken = BROKEN_FORMS.get(node.op, (0, None))
        if not verdict[node.op] or (old < since <= opset and broken(node)):
            found.setdefault(node.op, node.name)
    return found


def _absent_resize_inputs(model: QModel) -> None:
    """Resize before opset 13 marks roi/scales as absent with empty tensors; from 13 on an absent
    input has an empty name (onnxruntime refuses 'scales' next to 'sizes' unless it is a constant
    it can see is empty, e.g. not when the empty tensor is also a graph input)."""
    for node in _default_domain_nodes(model.graph):
        if node.op != "Resize":
            continue
        sizes = len(node.inputs) > 3 and bool(node.inputs[3].name)
        for index in (1, 2) if sizes else (1,):
            t = node.inputs[index] if index < len(node.inputs) else None
            if isinstance(t, gs.Constant) and t.name and np.asarray(t.values).size == 0:
                node.inputs[index] = gs.Variable.empty()


def keeps_float_input(node: gs.Node, t: gs.Tensor) -> bool:
    """``node`` reads ``t`` as its data input with a float constant weight and is one of
    FLOAT_WEIGHT_OPS: insert-qdq leaves it the float value of ``t`` (oprules.FLOAT_WEIGHT_OPS)."""
    if node.op not in FLOAT_WEIGHT_OPS or len(node.inputs) < 2 or node.inputs[0] is not t:
        return False
    w = node.inputs[1]
    return isinstance(w, gs.Constant) and np.issubdtype(w.values.dtype, np.floating)


def require_opset(model: QModel, opset: int) -> bool:
    """Raise the model's default opset to ``opset`` without changing what its nodes compute.

    A plain bump when every op keeps its signature and meaning; otherwise the graph is rewritten
    (qpasses.ir.opset_convert: onnx.version_converter turns Split/Squeeze/Reduce* attributes into inputs,
    ...; qpasses keeps Resize-10's coordinates and Hardmax's axis). Either way, Resize's empty
    roi/scales become absent inputs when crossing opset 13.
    Raises ModelError naming the op when that is impossible. Returns True if the opset changed.
    """
    old = model.opset
    if old >= opset:
        return False
    risky = ops_needing_rewrite(model, opset)
    if not risky:
        model.raise_opset(opset)
        if old < 13 <= opset:
            _absent_resize_inputs(model)
        return True
    where = ", ".join(f"'{n}' ({op})" for op, n in sorted(risky.items()))
    try:
        converted = convert(model.to_proto(), opset)
    except ModelError as exc:
        raise ModelError(f"cannot raise opset {old} -> {opset} for quantization (rewriting {where}): {exc}") from None
    graph = from_proto(converted).graph
    names = model_tensor_map(graph)
    lost = [t for t in model.quant if t in model.tensors() and t not in names]
    if lost:
        raise ModelError(f"cannot raise opset {old} -> {opset}: converting {where} lost tensor '{lost[0]}'")
    model.graph = graph
    if old < 13 <= opset:
        _absent_resize_inputs(model)
    model.touch()
    return True
