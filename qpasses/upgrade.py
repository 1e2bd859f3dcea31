"""Opset upgrade before quantization, as onnxruntime's quantizer does it.

QuantizeLinear/DequantizeLinear exist from opset 10. onnxruntime's ``quantize_static`` converts a
model below opset 10 to opset 11 with ``onnx.version_converter`` before quantizing
(``quant_utils.update_opset_version``). qpasses does the same when a pipeline quantizes (it has a
pass that decides Q/DQ types or inserts Q/DQ) and says so in a one-line notice; other pipelines
(folding, cleanup) run on the model's own opset.
"""
from __future__ import annotations

from typing import Iterable

import onnx
from onnx import version_converter

from .errors import ModelError, first_line
from .ir import QModel, from_proto

QDQ_MIN_OPSET = 10    # QuantizeLinear/DequantizeLinear
TARGET_OPSET = 11     # where onnxruntime's quantizer takes older models
QDQ_PASSES = frozenset({"annotate-types", "insert-qdq"})


def quantizes(pass_names: Iterable[str]) -> bool:
    """True when a pipeline (its pass names) decides Q/DQ types or inserts Q/DQ."""
    return not QDQ_PASSES.isdisjoint(pass_names)


def upgrade_opset(model: QModel | onnx.ModelProto) -> tuple[QModel | onnx.ModelProto, str] | None:
    """(upgraded model, notice) for a model below opset 10, else None.

    A QModel is upgraded in place (its graph is replaced; the quantization table and other side
    tables are kept); a ModelProto is left alone and a converted copy is returned.
    """
    old = model.opset if isinstance(model, QModel) else _default_opset(model)
    if old >= QDQ_MIN_OPSET:
        return None
    if isinstance(model, QModel):
        new = from_proto(_convert(model.to_proto(metadata=False), old), base_dir=model.base_dir)
        model.graph, model.ir_version = new.graph, new.ir_version
        model.input_order, model.input_initializers = new.input_order, new.input_initializers
        model.touch()
    else:
        model = _convert(model, old)
    return model, (f"qpasses: note: model upgraded from opset {old} to {TARGET_OPSET} as onnxruntime's "
                   f"quantizer does (QuantizeLinear needs opset {QDQ_MIN_OPSET})")


def _default_opset(proto: onnx.ModelProto) -> int:
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def _convert(proto: onnx.ModelProto, old: int) -> onnx.ModelProto:
    try:
        return version_converter.convert_version(proto, TARGET_OPSET)
    except Exception as exc:  # the converter raises assorted types for ops it cannot adapt
        raise ModelError(f"cannot upgrade opset {old} to {TARGET_OPSET} for quantization "
                         f"(onnx.version_converter: {first_line(exc)})") from None
