"""SiLU (x * Sigmoid(x)) between quantized tensors: the Sigmoid output ("gate") whose quantization
lets onnxruntime run the pair as QLinearSigmoid + QLinearMul instead of dequantizing x, computing in
float and quantizing the product again (quantize-silu measures whether that costs accuracy); and
SiLUs whose product only Concat/Add nodes between 8-bit tensors read (a YOLO's CSP blocks): with the
gate and the product 8-bit, onnxruntime runs those as QLinearConcat/QLinearAdd too."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..ir.annotations import TensorQuant
from ..ir.decisions import FLOAT
from ..ir.model import QModel
from ..quant.qtypes import EIGHT_BIT


def silu_gates(model: QModel) -> dict[str, str]:
    """Sigmoid output -> its input x, for each main-graph ``Mul(x, Sigmoid(x))`` whose x and product
    are int8/uint8 activations (no convert, not fixed: QLinearSigmoid and QLinearMul take them) and
    whose Sigmoid output, read by that Mul only, is left float."""
    table = model.quant
    return {gate.name: x.name for _, gate, x, mul in _silus(model)
            if gate.name not in table and x.name in model.ranges
            and all(_plain_8bit(table.get(t)) for t in (x.name, mul.outputs[0].name))}


JOINS = ("Concat", "Add")


def _silus(model: QModel):
    """(Sigmoid node, gate, x, Mul node) of each main-graph ``Mul(x, Sigmoid(x))``, the gate read by that Mul only."""
    for node in model.graph.nodes:
        if node.op != "Sigmoid" or len(node.outputs) != 1:
            continue
        gate, x = node.outputs[0], node.inputs[0]
        readers = gate.outputs
        if len(readers) == 1 and readers[0].op == "Mul" and len(readers[0].inputs) == 2 \
                and {t.name for t in readers[0].inputs} == {gate.name, x.name}:
            yield node, gate, x, readers[0]


@dataclass
class Chains:
    """SiLUs whose product only Concat/Add nodes read, and what those need to run 8-bit."""

    products: dict[str, tuple[str, str]] = field(default_factory=dict)   # product -> (gate, x)
    joins: dict[str, str] = field(default_factory=dict)   # float Add output -> the 8-bit Concat output reading it

    def __bool__(self) -> bool:
        return bool(self.products)

    def names(self) -> list[str]:
        return sorted({t for product, (gate, _) in self.products.items() for t in (gate, product)} | set(self.joins))


def silu_chains(model: QModel) -> Chains:
    """The SiLUs whose x is an 8-bit activation with a range, whose gate and product are left float,
    and whose product only Concat/Add nodes read, each joining 8-bit tensors, other such products
    or float Add outputs that only an 8-bit Concat reads (a CSP block's residual: it takes that
    Concat's range, which holds all its values) into an 8-bit output: with the chain 8-bit,
    onnxruntime runs every one of them as QLinearConcat/QLinearAdd."""
    table = model.quant
    products = {mul.outputs[0].name: (gate.name, x.name, mul.outputs[0]) for _, gate, x, mul in _silus(model)
                if gate.name not in table and mul.outputs[0].name not in table and _plain_8bit(table.get(x.name))
                and x.name in model.ranges and mul.outputs[0].outputs}
    joins = {}
    for node in model.graph.nodes:
        out = node.outputs[0] if node.op == "Add" and len(node.outputs) == 1 else None
        if out is not None and out.name not in table and len(out.outputs) == 1 and out.outputs[0].op == "Concat" \
                and _plain_8bit(table.get(out.outputs[0].outputs[0].name)):
            joins[out.name] = (out.outputs[0].outputs[0].name, out, node)

    def fine(t) -> bool:
        return t.name in products or t.name in joins or _plain_8bit(table.get(t.name))

    def joins_8bit(node) -> bool:
        return (node.op in JOINS and len(node.outputs) == 1 and fine(node.outputs[0])
                and all(fine(t) for t in node.inputs))

    changed = True
    while changed:   # drop what a neighbour cannot take 8-bit, until nothing is left to drop
        changed = False
        for name, (_, _, product) in list(products.items()):
            if not all(joins_8bit(r) for r in product.outputs):
                del products[name]
                changed = True
        for name, (_, out, add) in list(joins.items()):
            if not (joins_8bit(add) and all(joins_8bit(r) for r in out.outputs)
                    and any(t.name in products for t in add.inputs)):
                del joins[name]
                changed = True
    return Chains({name: (gate, x) for name, (gate, x, _) in products.items()},
                  {name: concat for name, (concat, _, _) in joins.items()})


def quantize_products(model: QModel, chains: Chains, reason: str) -> None:
    """Each chain's gate as quantize_gates gives it, its product an entry like x's with the range
    SiLU takes on x's range, and each join output an entry like its Concat output's, with its range."""
    quantize_gates(model, {gate: x for gate, x in chains.products.values()}, reason)
    floats = model.decisions.get(FLOAT, {})
    derived = [(p, x, _silu_range) for p, (_, x) in chains.products.items()]
    derived += [(j, concat, lambda lo, hi: (lo, hi)) for j, concat in chains.joins.items()]
    for name, source, take in derived:
        model.quant[name] = replace(model.quant[source], scale=None, zero_point=None, why=[reason])
        model.ranges[name] = take(*model.ranges[source])
        if source in model.observed:
            model.observed[name] = take(*model.observed[source])
        floats.pop(name, None)


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


SILU_MIN_AT = -1.2784645   # x * sigmoid(x) is smallest (-0.2784645) there


def _silu_range(lo: float, hi: float) -> tuple[float, float]:
    """The range x * sigmoid(x) takes for x in [lo, hi]."""
    ends = [v * _sigmoid(v) for v in (lo, hi)]
    low = SILU_MIN_AT * _sigmoid(SILU_MIN_AT) if lo < SILU_MIN_AT < hi else min(ends)
    return float(low), float(max(ends))


def _sigmoid(v: float) -> float:
    return float(1.0 / (1.0 + np.exp(-np.float64(v))))
