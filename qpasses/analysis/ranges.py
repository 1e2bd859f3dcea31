"""Which tensors need a calibrated range, and the MaxPool outputs that hold a tensor's top values."""
from __future__ import annotations

from ..ir import QModel

MAX_POOLS = frozenset({"MaxPool", "GlobalMaxPool"})


def max_pooled(model: QModel) -> dict[str, list[str]]:
    """Tensor -> the MaxPool outputs computed from it: they hold the top of its values, so a clipped
    range of the tensor clips them far more (compute-qparams widens the tensor's range to theirs)."""
    def build(m: QModel) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for node in m.graph.nodes:
            if node.op in MAX_POOLS and node.inputs and node.outputs:
                out.setdefault(node.inputs[0].name, []).append(node.outputs[0].name)
        return out
    return model.cached("max_pooled", build)


def tensors_needing_ranges(model: QModel) -> set[str] | None:
    """Activations whose qparams are computed from a calibrated range, and MaxPool outputs of
    quantized tensors (None: not annotated yet)."""
    if "types-annotated" not in model.facts:
        return None
    return {name for name, tq in model.quant.items()
            if tq.role == "activation" and tq.shares is None and not tq.fixed
            and (tq.rmin is None or tq.rmax is None or tq.convert is not None)} | {
        pooled for name, outputs in max_pooled(model).items() if name in model.quant for pooled in outputs}
