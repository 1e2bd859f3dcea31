"""SiLU (x * Sigmoid(x)) between quantized tensors: the Sigmoid output ("gate") whose quantization
lets onnxruntime run the pair as QLinearSigmoid + QLinearMul instead of dequantizing x, computing in
float and quantizing the product again (quantize-silu measures whether that costs accuracy)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..annotations import TensorQuant
from ..decisions import FLOAT
from ..ir import QModel
from ..qtypes import EIGHT_BIT


def silu_gates(model: QModel) -> dict[str, str]:
    """Sigmoid output -> its input x, for each main-graph ``Mul(x, Sigmoid(x))`` whose x and product
    are int8/uint8 activations (no convert, not fixed: QLinearSigmoid and QLinearMul take them) and
    whose Sigmoid output, read by that Mul only, is left float."""
    table, out = model.quant, {}
    for node in model.graph.nodes:
        if node.op != "Sigmoid" or len(node.outputs) != 1:
            continue
        gate, x = node.outputs[0], node.inputs[0]
        readers = gate.outputs
        if len(readers) != 1 or readers[0].op != "Mul" or len(readers[0].inputs) != 2:
            continue
        mul = readers[0]
        if {t.name for t in mul.inputs} != {gate.name, x.name} or gate.name in table:
            continue
        if all(_plain_8bit(table.get(t)) for t in (x.name, mul.outputs[0].name)) and x.name in model.ranges:
            out[gate.name] = x.name
    return out


def quantize_gates(model: QModel, gates: dict[str, str], reason: str) -> None:
    """Give each gate an entry like its input's, its range the Sigmoid of that input's range (what
    the Sigmoid reads, exactly), and drop its float reason."""
    floats = model.decisions.get(FLOAT, {})
    for gate, x in gates.items():
        source = model.quant[x]
        model.quant[gate] = replace(source, scale=None, zero_point=None, why=[reason])
        lo, hi = model.ranges[x]
        model.ranges[gate] = (_sigmoid(lo), _sigmoid(hi))
        if x in model.observed:
            lo, hi = model.observed[x]
            model.observed[gate] = (_sigmoid(lo), _sigmoid(hi))
        floats.pop(gate, None)


def _plain_8bit(tq: TensorQuant | None) -> bool:
    return (tq is not None and tq.role == "activation" and tq.convert is None and not tq.fixed
            and tq.shares is None and tq.rmin is None and tq.rmax is None and tq.qtype in EIGHT_BIT)


def _sigmoid(v: float) -> float:
    return float(1.0 / (1.0 + np.exp(-np.float64(v))))
