"""Which inputs and outputs of each op type are quantized, and how: a data table, not code.

Each op type maps to an :class:`OpRule`. Its input slots say what the tensor at that position is:

- ``activation``: quantized with the activation type. A *constant* found here (``Add(x, c)``,
  ``Concat(x, c)``) is quantized like an activation too, so both inputs of the op match.
- ``weight``: a constant here is a weight (weight type, optional per-channel axis); a computed
  tensor here is quantized as an activation (as onnxruntime does for dynamic weights).
- ``bias``: an int32 bias whose scale is ``scale(first activation) * scale(first weight)``.
- ``float``: never quantized (shapes, indices, pads, roi/scales/sizes, axes, Clip bounds, the
  Where condition).

``shares`` rules are for ops that only move or select values (Reshape, Transpose, MaxPool, ...):
their outputs take the qparams of input 0, so no re-quantization happens. ``needs`` lists inputs
that must already be quantized by someone else for the op to be quantized at all (onnxruntime's
rule for these data-movement ops: they never start a quantized region). ``removable_if`` names the
condition under which a Relu/Clip can be folded into its producer's range. Ops not in the table
stay float.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np

WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})   # ops with a weight input
# onnxruntime's WeightBiasQuantization gives a float initializer weight of these ops a per-tensor
# int8 grid when their input comes from a DequantizeLinear: a weight kept float (by the search, an
# override, an excluded node) would run 8-bit on a coarser grid than its own, so insert-qdq lets such
# a reader read the float tensor instead.
FLOAT_WEIGHT_OPS = frozenset({"Conv", "ConvTranspose", "Gemm"})
# weighted ops onnxruntime's CPU provider runs as integer kernels only with a QuantizeLinear after
# them (QLinearConv); a MatMul or Gemm with a float output still runs MatMulIntegerToFloat or QGemm
OUTPUT_QUANTIZED_OPS = frozenset({"Conv", "ConvTranspose"})
Q_OP, DQ_OP = "QuantizeLinear", "DequantizeLinear"
# ops onnxruntime's QDQ propagation moves a DequantizeLinear past when their output is float
# (measured on 1.32: qpasses/quant/int8_movers.py, core/prechecks.py)
QDQ_PROPAGATED = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice"})
QDQ_OPS = frozenset({Q_OP, DQ_OP})

ACTIVATION, WEIGHT, BIAS, FLOAT = "activation", "weight", "bias", "float"


@dataclass(frozen=True)
class Slot:
    """One input position of an op."""

    kind: str = FLOAT
    axis: int | None = None          # weight: per-channel axis (negative counts from the end)
    axis_attr: tuple | None = None   # weight: (attribute, axis when set, axis when not set)
    min_rank: int = 1                # weight: per-channel only for weights of at least this rank


@dataclass(frozen=True)
class OpRule:
    inputs: tuple[Slot, ...]
    rest: Slot = Slot()                       # slots past ``inputs`` (variadic ops like Concat)
    outputs: tuple[int, ...] | None = (0,)    # quantized outputs; None = every output
    shares: bool = False                      # outputs share input 0's qparams
    share_if: str | None = None               # name of a condition in CONDITIONS (else always)
    needs: tuple[int, ...] = ()               # inputs that must already be quantized
    constant_meets_needs: bool = False        # a constant in a ``needs`` slot counts (Gather tables)
    removable_if: str | None = None           # Relu/Clip: condition to merge into the producer
    min_opset: int = 0                        # below this opset the op stays float

    def slot(self, index: int) -> Slot:
        return self.inputs[index] if index < len(self.inputs) else self.rest

    def first(self, kind: str) -> int | None:
        """Index of the first input slot of ``kind`` (None if there is none)."""
        return _first(self, kind)


@functools.lru_cache(maxsize=None)
def _first(rule: OpRule, kind: str) -> int | None:
    return next((i for i, s in enumerate(rule.inputs) if s.kind == kind), None)


A, F, B = Slot(ACTIVATION), Slot(FLOAT), Slot(BIAS)


def W(axis: int | None = None, *, attr: tuple | None = None, min_rank: int = 1) -> Slot:  # noqa: N802
    return Slot(WEIGHT, axis, attr, min_rank)


def _moves(*inputs: Slot, outputs=(0,), needs=(0,), **kw) -> OpRule:
    """A data-movement op: input 0 is data, outputs share its qparams."""
    return OpRule(inputs, outputs=outputs, shares=True, needs=needs, **kw)


RULES: dict[str, OpRule] = {
    # weighted ops: activation x weight (+ int32 bias)
    "Conv": OpRule((A, W(0), B)),
    "ConvTranspose": OpRule((A, W(1), B)),
    "Gemm": OpRule((A, W(attr=("transB", 0, 1)), B)),
    "MatMul": OpRule((W(), W(-1, min_rank=2))),   # a constant on either side is a weight
    "LayerNormalization": OpRule((A, W(), B)),     # scale per-tensor; bias from input x scale
    "InstanceNormalization": OpRule((A, W(), B)),
    "BatchNormalization": OpRule((A, W(0), B, F, F)),   # one fold-batchnorm cannot fold; mean/var stay float
    # element-wise and n-ary ops: every data input is an activation
    "Add": OpRule((A, A)),
    "Sum": OpRule((), rest=A),    # n-ary Add (residuals of opset-9 ResNets): every input, like Add's
    "Sub": OpRule((A, A)),
    "Mul": OpRule((A, A)),
    "Div": OpRule((A, A)),
    "PRelu": OpRule((A, A)),
    "Concat": OpRule((), rest=A),
    "Where": OpRule((F, A, A), needs=(1, 2)),
    # activations and normalisers with their own output range
    "Sigmoid": OpRule((A,)),
    "Tanh": OpRule((A,)),
    "LeakyRelu": OpRule((A,)),
    "HardSigmoid": OpRule((A,)),
    "HardSwish": OpRule((A,)),
    "Softmax": OpRule((A,)),
    "GlobalAveragePool": OpRule((A,)),
    # removable activations: quantized only inside a quantized region, merged when exact
    "Relu": OpRule((A,), needs=(0,), removable_if="always"),
    "Clip": OpRule((A, F, F), needs=(0,), removable_if="clip_bounds_contain_zero"),
    # data movement / selection: outputs share the input's qparams
    "Reshape": _moves(A, F),
    "Transpose": _moves(A),
    "Squeeze": _moves(A, F),
    "Unsqueeze": _moves(A, F),
    "Flatten": _moves(A),
    "Slice": _moves(A, F, F, F, F),
    "Gather": _moves(A, F, constant_meets_needs=True),
    "GatherElements": _moves(A, F, constant_meets_needs=True),
    "Split": _moves(A, F, outputs=None, needs=()),
    "Pad": _moves(A, F, F, F, needs=(), share_if="pad_keeps_values"),
    "Resize": _moves(A, F, F, F, min_opset=11),
    "MaxPool": _moves(A, min_opset=12),
    "GlobalMaxPool": _moves(A),
    "AveragePool": _moves(A),   # the average stays inside the input's range (onnxruntime shares)
    "DepthToSpace": _moves(A),
    "SpaceToDepth": _moves(A),
    "Identity": _moves(A),
    "Expand": _moves(A, F),
    "Tile": _moves(A, F),
    "TopK": _moves(A, F),
}


def rule_for(op_type: str, opset: int | None = None) -> OpRule | None:
    """The rule for ``op_type`` (None: the op stays float, also when the opset is too old)."""
    rule = RULES.get(op_type)
    if rule is None or (opset is not None and opset < rule.min_opset):
        return None
    return rule


# Quantized by default: the weighted ops and the ops that only move, select or pool their input
# (they keep an int8 chain going between weighted ops). Element-wise arithmetic, normalisations,
# Concat and activations with their own range stay float unless the config asks for them
# (op_types_to_quantize: all, or a list): on the benchmark models they cost accuracy (an
# attention mask or boxes sharing a grid with scores, decomposed LayerNorm and GELU) for little
# speed on CPU (tools/README.md, "Default op selection").
NOT_BY_DEFAULT = frozenset({
    "Add", "Sum", "Sub", "Mul", "Div", "PRelu", "Where", "Concat", "Sigmoid", "Tanh", "LeakyRelu",
    "HardSigmoid", "HardSwish", "Softmax", "LayerNormalization", "InstanceNormalization", "BatchNormalization"})
DEFAULT_OP_TYPES = frozenset(RULES) - NOT_BY_DEFAULT


def multiplies_activations(node) -> bool:
    """A MatMul of two computed tensors (attention scores, softmax x V): float by default. Int8 there
    cost bert_encoder 1.1-1.5 dB (cosine 0.994-0.996 -> 0.996-0.997, every weight MatMul still an
    integer kernel) for 2-7 % of its latency, and nothing on ppocr_v4_rec (tools/README.md)."""
    def computed(t) -> bool:
        return getattr(t, "values", None) is None and not (t.inputs and t.inputs[0].op == "Constant")

    return node.op == "MatMul" and len(node.inputs) >= 2 and all(computed(t) for t in node.inputs[:2])


def float_output_bias(node) -> tuple[bool, object]:
    """For a MatMul (or Gemm) with a constant 2-D weight and 8-bit DequantizeLinear inputs whose output
    gets no QuantizeLinear: ``(runs as an integer kernel, the constant to quantize as its int32 bias)``.
    A Gemm with an int32 bias or none is QGemm with a float output.

    onnxruntime's CPU provider runs such a MatMul as MatMulIntegerToFloat, unless an Add is its only
    reader: MatMulAddFusion (level 1, before the QDQ selectors) fuses the two into a Gemm, and the QDQ
    Gemm selector takes that Gemm (QGemm, float output) only when its bias too comes from a
    DequantizeLinear, of an int32 tensor. So the Add's other input must be a constant, given an
    int32 entry; an Add of two computed tensors (a residual) would run as a float Gemm.
    """
    readers = {id(n): n for n in node.outputs[0].outputs}
    if node.op == "Gemm" or len(readers) != 1:   # QGemm takes a float output as it is
        return True, None
    (reader,) = readers.values()
    if reader.op != "Add":
        return True, None
    others = [t for t in reader.inputs if t is not node.outputs[0]]
    if len(others) == 1 and getattr(others[0], "values", None) is not None:
        return True, others[0]
    return False, None


def selected_op_types(selection) -> frozenset:
    """The op types a config's ``op_types_to_quantize`` selects (None: the default set; "all")."""
    if selection is None:
        return DEFAULT_OP_TYPES
    if selection == "all":
        return frozenset(RULES)
    return frozenset(selection)


def quantizable_op_types() -> list[str]:
    return sorted(RULES)


def weight_axis(slot: Slot, attrs: dict, rank: int, override: int | None = None) -> int | None:
    """The per-channel axis for a weight of ``rank`` in ``slot`` (None: per-tensor).

    ``override`` is a user axis for the op type (onnxruntime's QDQOpTypePerChannelSupportToAxis).
    """
    if slot.kind != WEIGHT or rank < slot.min_rank:
        return None
    axis = override
    if axis is None:
        if slot.axis_attr is not None:
            attr, if_set, if_not = slot.axis_attr
            axis = if_set if attrs.get(attr, 0) else if_not
        else:
            axis = slot.axis
    if axis is None or not -rank <= axis < rank:
        return None
    return axis % rank


# -- named conditions (they read node attributes and constant inputs) ---------------------------
def _constant_value(node, index: int):
    """The value of input ``index`` if it is a constant (None when absent or computed)."""
    if index >= len(node.inputs) or not node.inputs[index].name:
        return None
    values = getattr(node.inputs[index], "values", None)
    return None if values is None else np.asarray(values)


def _absent(node, index: int) -> bool:
    return index >= len(node.inputs) or not node.inputs[index].name


def pad_keeps_values(node) -> bool:
    """Pad writes only values already in the input (reflect/edge/wrap, or a constant 0)."""
    mode = node.attrs.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode in ("reflect", "edge", "wrap"):
        return True
    if "value" in node.attrs:      # opset < 11
        return float(node.attrs["value"]) == 0.0
    if _absent(node, 2):
        return True
    value = _constant_value(node, 2)
    return value is not None and value.size == 1 and float(value.reshape(())) == 0.0


def clip_bounds_contain_zero(node) -> bool:
    """Clip's bounds are constants (or absent) with min <= 0 <= max.

    Then quantizing the Clip input with the Clip output's range (which always contains 0) clips
    exactly as the Clip did, so the Clip can be dropped.
    """
    bounds = []
    for index, attr, default in ((1, "min", -np.inf), (2, "max", np.inf)):
        if attr in node.attrs:
            bounds.append(float(node.attrs[attr]))
        elif _absent(node, index):
            bounds.append(default)
        else:
            value = _constant_value(node, index)
            if value is None or value.size != 1:
                return False
            bounds.append(float(value.reshape(())))
    return bounds[0] <= 0.0 <= bounds[1]


CONDITIONS: dict[str, Callable] = {
    "always": lambda node: True,
    "pad_keeps_values": pad_keeps_values,
    "clip_bounds_contain_zero": clip_bounds_contain_zero,
}


def holds(condition: str | None, node) -> bool:
    """Whether the named condition holds for ``node`` (no condition: True)."""
    return True if condition is None else bool(CONDITIONS[condition](node))
