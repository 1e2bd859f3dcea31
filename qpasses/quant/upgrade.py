"""Opset upgrade before quantization, as onnxruntime's quantizer does it.

QuantizeLinear/DequantizeLinear exist from opset 10. onnxruntime's ``quantize_static`` converts a
model below opset 10 to opset 11 with ``onnx.version_converter`` before quantizing
(``quant_utils.update_opset_version``). qpasses does the same when a pipeline quantizes (it has a
pass that decides Q/DQ types or inserts Q/DQ) and says so in a one-line notice; other pipelines
(folding, cleanup) run on the model's own opset.

Per-channel weights need opset 13 (QuantizeLinear's ``axis``). A quantizing pipeline whose default
per-channel weights meet a model below 13 raises it to 13 before the first pass (so the op rules see
the opset the output will have), rewriting what changes meaning on the way (qpasses.ir.opset_convert);
where that cannot be expressed, the weights go per-tensor with a one-line notice, unless the user
asked for per-channel weights (then it is an error naming the node).
"""
from __future__ import annotations

from typing import Iterable

import onnx
import onnx_graphsurgeon as gs

from ..analysis.scopes import all_nodes
from ..errors import ConfigError, ModelError
from ..ir.model import QModel, from_proto
from ..ir.graphutil import default_opset
from ..ir.opset_convert import convert
from .oprules import WEIGHT, rule_for, weight_axis
from .qdq import ops_needing_rewrite, require_opset
from .qtypes import PER_AXIS_MIN_OPSET

QDQ_MIN_OPSET = 10    # QuantizeLinear/DequantizeLinear
TARGET_OPSET = 11     # where onnxruntime's quantizer takes older models
QDQ_PASSES = frozenset({"annotate-types", "insert-qdq"})
PER_TENSOR = "per_tensor_weights"   # model.decisions: why the weights are per-tensor (annotate-types reads it)


def quantizes(pass_names: Iterable[str]) -> bool:
    """True when a pipeline (its pass names) decides Q/DQ types or inserts Q/DQ."""
    return not QDQ_PASSES.isdisjoint(pass_names)


def upgrade_opset(model: QModel | onnx.ModelProto) -> tuple[QModel | onnx.ModelProto, str] | None:
    """(upgraded model, notice) for a model below opset 10, else None.

    A QModel is upgraded in place (its graph is replaced; the quantization table and other side
    tables are kept); a ModelProto is left alone and a converted copy is returned. A Resize or
    Upsample with no opset-11 form (qpasses.ir.opset_convert) takes the model to opset 10 instead.
    """
    old = model.opset if isinstance(model, QModel) else default_opset(model)
    if old >= QDQ_MIN_OPSET:
        return None
    proto = model.to_proto(metadata=False) if isinstance(model, QModel) else model
    try:
        converted, new, why = convert(proto, TARGET_OPSET), TARGET_OPSET, " as onnxruntime's quantizer does"
    except ModelError as exc:
        converted, new, why = _convert(proto, old, QDQ_MIN_OPSET), QDQ_MIN_OPSET, f" (not {TARGET_OPSET}: {exc})"
    if isinstance(model, QModel):
        upgraded = from_proto(converted, base_dir=model.base_dir)
        model.graph, model.ir_version = upgraded.graph, upgraded.ir_version
        model.input_order, model.input_initializers = upgraded.input_order, upgraded.input_initializers
        model.touch()
    else:
        model = converted
    return model, (f"qpasses: note: model upgraded from opset {old} to {new}{why} "
                   f"(QuantizeLinear needs opset {QDQ_MIN_OPSET})")


def _convert(proto: onnx.ModelProto, old: int, new: int) -> onnx.ModelProto:
    try:
        return convert(proto, new)
    except ModelError as exc:
        raise ModelError(f"cannot upgrade opset {old} to {new} for quantization: {exc}") from None


def per_axis_weights(model: QModel, config) -> bool:
    """Whether annotate-types would give some constant weight a per-channel axis under ``config``."""
    if not config.per_channel:
        return False
    for node in all_nodes(model):
        rule = rule_for(node.op, PER_AXIS_MIN_OPSET)
        if rule is None:
            continue
        for i, t in enumerate(node.inputs):
            if (rule.slot(i).kind == WEIGHT and isinstance(t, gs.Constant)
                    and weight_axis(rule.slot(i), node.attrs, len(t.shape), config.per_channel_axes.get(node.op))
                    is not None):
                return True
    return False


def _asked_per_channel(config) -> str | None:
    """The config key that asks for per-channel weights explicitly, if any."""
    if config.per_channel and "per_channel" in config.given:
        return "per_channel: true"
    for tensor, entries in sorted((config.tensor_overrides or {}).items()):
        if isinstance(entries, list) and entries and isinstance(entries[0], dict) and "axis" in entries[0]:
            return f"tensor_overrides['{tensor}'] axis"
    return None


def prepare_opset(model: QModel, config, pass_names: Iterable[str]) -> list[str]:
    """Bring a model a quantizing pipeline runs on to the opset its Q/DQ need; returns the notices.

    Below 10: :func:`upgrade_opset`. Below 13 with per-channel weights (static quantization): raised
    to 13 now, or, when that cannot be expressed, ``model.decisions[PER_TENSOR]`` says why the
    weights go per-tensor (a ConfigError instead when the user asked for per-channel weights).
    """
    if not quantizes(pass_names):
        return []
    notices = []
    upgraded = upgrade_opset(model)
    if upgraded is not None:
        notices.append(upgraded[1])
    old = model.opset
    asked = _asked_per_channel(config)
    if old >= PER_AXIS_MIN_OPSET or config.mode != "static" or not (asked or per_axis_weights(model, config)):
        return notices
    rewritten = ops_needing_rewrite(model, PER_AXIS_MIN_OPSET)
    try:
        require_opset(model, PER_AXIS_MIN_OPSET)
    except ModelError as exc:
        if asked:
            raise ConfigError(f"{asked}: per-channel weights need opset {PER_AXIS_MIN_OPSET}, and {exc}") from None
        model.decisions[PER_TENSOR] = str(exc)
        return notices + [f"qpasses: note: weights per-tensor (per-channel needs opset {PER_AXIS_MIN_OPSET}): {exc}"]
    how = f"; its {', '.join(sorted(rewritten))} nodes rewritten to keep their results" if rewritten else ""
    return notices + [f"qpasses: note: model raised from opset {old} to {PER_AXIS_MIN_OPSET} for per-channel "
                      f"weights{how}"]
