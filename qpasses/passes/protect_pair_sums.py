"""protect-pair-sums: no int16 pair sum of onnxruntime's x86-64 uint8 x int8 kernels can saturate."""
from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from ..analysis.saturation import risks, table_layers
from ..config.quant_config import PAIR_SATURATING_CPUS
from ..config.targets import chosen, user_keys
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..ir.analyses import GRAPH, RANGES, WEIGHTS
from ..ir.decisions import PAIR_SUMS
from ..ir.model import QModel

NAME = "protect-pair-sums"
SHIFT = 128   # int8 code + 128 = uint8 code, on the same grid


@register
class ProtectPairSums(Pass):
    """Keep onnxruntime's uint8 x int8 kernels exact on every x86-64 CPU.

    Without VNNI (AVX2, AVX-512 without VNNI) those kernels sum the products of adjacent weight
    codes in int16 (qpasses.analysis.saturation): a same-sign pair with |a + b| > 128 saturates
    when both activations are near 255. Issue 35's 3x3 Conv over 64 channels: 33.2 dB in
    onnxruntime's QDQ simulation, 27.1 dB in its kernels under ``qemu-x86_64 -cpu Haswell``.
    The weights of the layers with such a pair are stored as uint8 on the same grid (codes + 128,
    zero point + 128): onnxruntime runs those layers in its uint8 x uint8 kernels, which widen to
    int16 before multiplying and cannot saturate. The model computes exactly what it computed
    before (same simulation, same accuracy: 33.2 dB in the kernels under qemu too); the cost is
    speed on CPUs with VNNI, where uint8 x uint8 has no one-instruction dot product (issue 35's
    Conv: 58 us int8, 138 us uint8, 267 us float; tools/bench_saturation.py). Moving the risky
    pairs onto the int16 bound instead keeps int8 speed but cost that Conv 8.3 dB, more than
    saturating does. Hence ``cpu`` (config): x86-64-vnni or arm when the model runs only there.
    A layer reading int8 activations, or whose weight has unequal zero points, stays as it is
    (onnxruntime has no such uint8 kernel), as does a weight whose type the config or a preset names
    (``weight_type``, a tensor override's ``quant_type``: a back end may need int8): the decision
    names them, as ``check`` and ``explain`` do.
    Reads: the config's ``cpu`` (x86-64, the default, protects every x86-64 CPU; x86-64-vnni and
    arm change nothing), the table's int8 weights of Conv/Gemm/MatMul reading 8-bit activations.
    Writes: those weights' entries (uint8), why-lines, ``model.decisions["pair_sums"]``.
    Invariants: the values every layer computes are unchanged; no layer reading uint8
    activations keeps an int8 pair that can leave int16.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"qparams-computed"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated", "qparams-computed"})
    unchanged: ClassVar[frozenset] = frozenset({GRAPH, WEIGHTS, RANGES})   # it changes the table only
    example: ClassVar[str] = """
g (float[1,4,4,4] x) => (float[1,2,4,4] y)
  <float[2,4,1,1] w = {1.0, 0.9, -0.2, 0.1, 0.5, -0.5, 0.25, 1.0}>
{
  y = Conv(x, w)
}
"""
    example_prelude: ClassVar[str] = "annotate-types,calibrate,compute-qparams"

    def run(self, model: QModel, ctx) -> PassResult:
        cpu = ctx.config.cpu
        layers = table_layers(model)
        readers: dict[str, list] = {}
        for layer in layers:
            readers.setdefault(layer.weight, []).append(layer)
        rows = {r.weight: {"node": r.node, "op": r.op, "channels": list(r.channels), "of": r.of, "pairs": r.pairs}
                for r in risks(layers)}
        protect = cpu in PAIR_SATURATING_CPUS
        asked = "weight_type" in chosen(ctx.config)
        widened = 0
        for weight, row in rows.items() if protect else ():
            tq = model.quant[weight]
            if asked or "quant_type" in user_keys(ctx.config, weight):
                row["fix"] = f"none: {tq.qtype} weights were asked for"
                continue
            if not all(model.quant[r.node.inputs[0].name].qtype_read_by(r.node.name) == "uint8" for r in readers[weight]):
                row["fix"] = "none: int8 activations (onnxruntime fuses no int8 x uint8 layer)"
                continue
            if len(set(tq.zero_point)) > 1:
                row["fix"] = "none: unequal zero points per channel (onnxruntime's uint8 kernels take one)"
                continue
            model.quant[weight] = replace(tq, qtype="uint8", zero_point=[z + SHIFT for z in tq.zero_point],
                                          why=list(tq.why)).because(
                f"{NAME}: stored as uint8 on the same grid (zero point +{SHIFT}): its int8 pair sums could "
                f"saturate int16 on x86-64 without VNNI; onnxruntime's uint8 x uint8 kernels cannot")
            row["fix"] = "uint8"
            widened += 1
        if rows:
            model.decisions[PAIR_SUMS] = {"cpu": cpu, "protected": protect, "layers": rows}
        stats = {"layers_checked": len(layers), "layers_at_risk": len(rows), "weights_widened": widened}
        return PassResult(model, widened > 0, stats)
