"""protect-pair-sums: the layers whose int16 pair sums in onnxruntime's x86-64 uint8 x int8 kernels would
saturate on the calibration data get int8 grids on which no pair of codes can (or uint8 weights)."""
from __future__ import annotations

from dataclasses import field, replace
from typing import ClassVar

import numpy as np

from ..analysis.derivations import rederive
from ..analysis.saturation import GRID, pair_safe_scale, reached, risks, table_layers
from ..config.quant_config import PAIR_SATURATING_CPUS
from ..config.targets import chosen, user_keys
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..errors import CalibrationDataError, first_line
from ..ir.analyses import GRAPH, RANGES, WEIGHTS
from ..ir.decisions import PAIR_SUMS
from ..ir.model import QModel

NAME = "protect-pair-sums"
SHIFT = 128   # int8 code + 128 = uint8 code, on the same grid
UINT8 = "uint8"


@register
class ProtectPairSums(Pass):
    """Keep onnxruntime's uint8 x int8 kernels from saturating on x86-64 CPUs without VNNI.

    Without VNNI (AVX2, AVX-512 without VNNI) those kernels sum the products of adjacent weight
    codes in int16 (qpasses.analysis.saturation): a same-sign pair with |a + b| > 128 saturates
    when both activations are near 255. Issue 35's 3x3 Conv over 64 channels: 33.2 dB in
    onnxruntime's QDQ simulation, 27.2 dB in its kernels under ``qemu-x86_64 -cpu Haswell``.
    A protected layer (``fix``):
    - ``grid`` (default): each output channel at risk gets the smallest scale on which no pair of
      its codes can leave int16 (analysis.saturation.pair_safe_scale: at most 2x, 1.3x typically);
      the weights stay int8 and run in the int8 kernels on every CPU. round-weights then chooses
      those layers' codes (GPTQ, whatever their input's bits) and keeps every pair within the bound.
      Issue 35's Conv: 32.8 dB, the same in the AVX2 kernels; crnn_lstm (128 held-out samples): text
      0.992 at onnxruntime's latency (uint8: 0.984 at 1.3x; unprotected 0.578 on AVX2);
    - ``uint8``: the codes stored as uint8 on the same grid (codes + 128, zero point + 128), run
      by onnxruntime's uint8 x uint8 kernels, which widen to int16 before multiplying: the model
      computes exactly what it did, but those kernels are slower on CPUs with VNNI (issue 35's Conv:
      58 us int8, 138 us uint8; ddddocr_det, every layer at risk: 2.2x onnxruntime's latency).
    A layer that cannot take one takes the other: the grid needs zero points 0 and a scale no one
    gave; uint8 needs uint8 activations (onnxruntime has no int8 x uint8 layer), one zero point, and
    a weight whose type neither the config (``weight_type``) nor an override (``quant_type``) names.
    A layer that can take neither stays as it is, and the decision says why.
    Real data rarely drives both codes of a risky pair to the top at once, so (``data``) each layer
    at risk is emulated on ``samples`` calibration feeds first (analysis.saturation.PairSums: the
    layer's float input from one run of the model, quantized with its input's qparams, each risky
    pair's sums of its round-to-nearest codes in numpy integers: the same decision on every
    machine). A layer is protected when, with the sums saturating at ``bound`` times the int16 bound
    (headroom for unseen data), the error power its outputs would carry reaches ``noise_db`` against
    the power of the noise quantizing its input adds to them (each output's clipped parts times its
    weight scale, against step^2 / 12 times its weights' squares); the others stay int8. On 32
    held-out samples of crnn_lstm, yolo_detector, ddddocr_det and ppocr_v4_det, the layers so left
    int8 saturated at most -12 dB against that noise (tools/RESULTS.md has the task metrics). Cost:
    one float run over ``samples`` feeds fetching only those layers' inputs, then per feed the sums
    of the risky pairs whose inputs' largest codes could pass the cap (ddddocr_det: 3 million per
    feed, about a second in all). The risk left: data unlike the calibration set may saturate a layer left int8;
    ``data=false`` protects every layer at risk, and so does a run without calibration data. Hence
    also ``cpu`` (config): x86-64-vnni or arm when the model runs only there.
    Reads: the config's ``cpu`` (x86-64, the default, protects every x86-64 CPU; x86-64-vnni and
    arm change nothing), the table's int8 weights of Conv/Gemm/MatMul reading 8-bit activations and
    their inputs' qparams, the weights' values, the calibration data.
    Writes: the protected weights' entries (wider scales, with the biases derived from them; or
    uint8), why-lines (for the layers left int8 too, with what the data showed),
    ``model.decisions["pair_sums"]`` (per layer: ``fix``, ``widened``, ``largest``, ``noise_db``,
    ``why``; ``data``: samples, bound, noise_db); the number of pair sums emulated in the pass stats
    (its time is the pass's: ``--time-passes``).
    Invariants: no layer reading 8-bit activations keeps a pair of round-to-nearest codes that can
    leave int16 unless its calibration data says the saturation stays below ``noise_db``, or the
    decision says why it could not be protected; ``uint8`` changes no value any layer computes.
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

    data: bool = field(default=True, metadata={
        "help": "protect only the layers whose pair sums on the calibration data would cost them measurable "
                "error (false: every layer at risk, whatever the data)"})
    samples: int = field(default=16, metadata={"help": "calibration feeds the pair sums are emulated on"})
    max_sums: float = field(default=1e9, metadata={
        "help": "most pair sums emulated (risky pairs x output positions x samples: a bound on those summed, "
                "about 1 s per 1e8), layers in graph order; the layers past it are protected unmeasured "
                "(ddddocr_det needs 4.8e8, of which it sums 4.7e7)"})
    fix: str = field(default=GRID, metadata={
        "choices": (GRID, UINT8),
        "help": "how a layer is protected: 'grid' widens the scale of its channels at risk so no pair of codes "
                "can saturate (int8 kernels on every CPU), 'uint8' stores the same codes as uint8 (exact; onnxruntime's "
                "slower uint8 x uint8 kernels); a layer that cannot take one takes the other"})
    bound: float = field(default=0.9, metadata={
        "help": "the sums are taken to saturate at this share of the int16 bound: headroom for data the "
                "calibration set does not hold", "above": 0.0})
    noise_db: float = field(default=-10.0, metadata={
        "help": "protect a layer whose saturation error power on the calibration data reaches this many dB against "
                "the noise power quantizing its input adds to its outputs"})

    def run(self, model: QModel, ctx) -> PassResult:
        cpu = ctx.config.cpu
        layers = table_layers(model)
        readers: dict[str, list] = {}
        for layer in layers:
            readers.setdefault(layer.weight, []).append(layer)
        rows = {r.weight: {"node": r.node, "op": r.op, "channels": list(r.channels), "of": r.of, "pairs": r.pairs}
                for r in risks(layers)}
        protect = cpu in PAIR_SATURATING_CPUS
        fixes = {}
        for weight, row in rows.items() if protect else ():
            fixes[weight], reason = self._fix(model, ctx.config, weight, readers[weight])
            if fixes[weight] is None:
                row["fix"] = f"none: {reason}"
        candidates = [w for w, fix in fixes.items() if fix is not None]
        measured, how = self._measure(model, ctx, [r for w in candidates for r in readers[w]])
        widened = kept = 0
        raised = set()
        for weight in candidates:
            row, found = rows[weight], [measured.get(r.node.name) for r in readers[weight]]
            if all(found):
                row["largest"] = round(max(f.largest for f in found), 2)
                levels = [f.noise_db for f in found if f.noise_db is not None]
                row["noise_db"] = max(levels) if levels else None
                seen = self._seen(how["samples"], row["largest"], all(f.exact for f in found), row["noise_db"])
            else:
                seen = how.get("skipped") or ("not measured: its input layout is not emulated, or the "
                                              f"emulation reached max_sums ({self.max_sums:g})")
            tq = model.quant[weight]
            if all(found) and (row["noise_db"] is None or row["noise_db"] < self.noise_db):
                row["fix"], row["why"] = "int8", seen
                tq.because(f"{NAME}: {seen}: left int8")
                kept += 1
                continue
            row["fix"], row["why"] = fixes[weight], seen
            widened += 1
            if fixes[weight] == GRID:
                node = readers[weight][0].node
                scale = pair_safe_scale(node.inputs[1].values, node, tq.scale)
                row["widened"] = round(float((scale / np.asarray(tq.scale)).max()), 3)
                model.quant[weight] = tq.with_qparams(scale, tq.zero_point, (
                    f"{NAME}: scale x{row['widened']:.3g} at most, on the channels whose int8 pair sums could saturate "
                    f"int16 on x86-64 without VNNI, so no pair of codes can ({seen})"))
                raised.add(weight)
                continue
            model.quant[weight] = replace(tq, qtype="uint8", zero_point=[z + SHIFT for z in tq.zero_point],
                                          why=list(tq.why)).because(
                f"{NAME}: stored as uint8 on the same grid (zero point +{SHIFT}), as its int8 pair sums could "
                f"saturate int16 on x86-64 without VNNI and onnxruntime's uint8 x uint8 kernels cannot ({seen})")
        for name, new in rederive(model, ctx.config, raised, NAME).items():   # the biases read the new scales
            model.quant[name] = new
        if rows:
            model.decisions[PAIR_SUMS] = {"cpu": cpu, "protected": protect, "data": how, "layers": rows}
        stats = {"layers_checked": len(layers), "layers_at_risk": len(rows), "weights_widened": widened,
                 "left_int8": kept, **({"samples": how["samples"], **self.cost} if how.get("samples") else {})}
        return PassResult(model, widened > 0, stats)

    def _fix(self, model: QModel, config, weight: str, readers: list) -> tuple[str | None, str]:
        """How a layer at risk is protected: ``fix`` if it can be, else the other way; or None and why not."""
        tq = model.quant[weight]
        blocked = {
            GRID: ("its scale was given" if tq.fixed or "scale" in user_keys(config, weight)
                   else "asymmetric int8 codes" if any(tq.zero_point) else None),
            UINT8: (f"{tq.qtype} weights were asked for" if "weight_type" in chosen(config)
                    or "quant_type" in user_keys(config, weight)
                    else "int8 activations (onnxruntime fuses no int8 x uint8 layer)"
                    if not all(model.quant[r.node.inputs[0].name].qtype_read_by(r.node.name) == "uint8" for r in readers)
                    else "unequal zero points per channel (onnxruntime's uint8 kernels take one)"
                    if len(set(tq.zero_point)) > 1 else None)}
        for fix in sorted(blocked, key=lambda f: f != self.fix):
            if blocked[fix] is None:
                return fix, ""
        return None, "; ".join(blocked.values())

    def _seen(self, samples: int, largest: float, exact: bool, noise_db: float | None) -> str:
        """What the calibration data showed, in words."""
        text = (f"largest pair sum on {samples} calibration samples {'' if exact else 'at most '}{largest:.0%} "
                f"of the int16 bound")
        if noise_db is None:
            return text
        return (text + f"; saturating at {self.bound:.0%} of it, the error power would be {noise_db:+.1f} dB against "
                f"the noise quantizing the input adds (protected from {self.noise_db:+.1f} dB)")

    def _measure(self, model: QModel, ctx, layers: list) -> tuple[dict, dict]:
        """The pair sums each layer reaches on the calibration data, and how they were measured
        (what they cost: ``self.cost``)."""
        if not layers:
            return {}, {}
        if not self.data:
            return {}, {"skipped": "data=false: every layer at risk is protected"}
        if ctx.calibration_data is None:
            return {}, {"skipped": "no calibration data in this run"}
        try:
            found, samples = reached(model, layers, ctx.calibration_data, self.samples, self.bound, self.max_sums)
        except CalibrationDataError as exc:
            return {}, {"skipped": f"the calibration data cannot be read again ({first_line(exc)})"}
        self.cost = {"emulated_sums": sum(f.sums for f in found.values())}   # its time is the pass's (--time-passes)
        return found, {"samples": samples, "bound": self.bound, "noise_db": self.noise_db}
