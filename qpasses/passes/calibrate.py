"""calibrate: run the float model on calibration data and record a range per float activation."""
from __future__ import annotations

from dataclasses import field
from typing import ClassVar

import onnx_graphsurgeon as gs

from .. import executors
from ..analysis.ranges import tensors_needing_ranges
from ..analysis.scopes import unobserved
from ..calibration.data import open_data
from ..calibration.kept import KeptSamples
from ..calibration.ranges import calibrate_ranges
from ..calibration.softmax import row_max_probes
from ..config.quant_config import CALIBRATION_METHODS, CalibrationConfig, QuantConfig, method_given
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..errors import CalibrationDataError
from ..ir.analyses import GRAPH, QUANT, WEIGHTS
from ..ir.model import QModel
from ..quant.qtypes import qtype


KEEP_SAMPLES = 32   # feeds kept with the float outputs for select-by-snr (at most 64 MB)
@register
class Calibrate(Pass):
    """Run the float model on calibration data and record a range for every float activation.

    Reads: the calibration data (``data`` option, else the data attached to the model), options not
    given come from ``config.calibration``; the activation bit width from ``config.activation_type``.
    Writes: ``model.decisions["calibration"]`` (the method, whether the user chose it, the first
    sample held out of the ranges),
    ``model.ranges[t] = (rmin, rmax)`` chosen by the method and ``model.observed[t] =
    (min, max)`` seen, for every float graph input and non-constant float node output (inside
    If/Loop/Scan bodies too: the calibration copy threads them out, qpasses.calibration.subgraphs;
    those of a body that never ran get no range and are listed in the decision's ``unobserved``),
    and for a tensor read only by Softmax also ``<t>::softmax_row_max``: the range of its row maxima
    (qpasses.calibration.softmax: compute-qparams keeps them and clips 20 below the smallest); after
    annotate-types, only for the activations whose qparams come from a range (not those that share
    another tensor's qparams (MaxPool outputs are measured), are fixed or have a user range), which keeps onnxruntime's fusions
    (Conv+Relu, ...) in the calibration run and makes it faster.
    Also ``ctx.cache["kept_samples"]``: the first 32 feeds and the float outputs on them (at most 64 MB;
    not when the parts of a big model run one at a time), so select-by-snr, search-precision and the
    CLI's SNR line need no second float run.
    With ``config.executor`` ray, the samples run in shards as Ray tasks whose statistics merge
    exactly (qpasses.calibration.sharded): the same ranges.
    Invariants: the graph is not changed; memory does not grow with the number of samples.
    """

    name: ClassVar[str] = "calibrate"
    establishes: ClassVar[frozenset] = frozenset({"calibrated"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated"})
    unchanged: ClassVar[frozenset] = frozenset({GRAPH, WEIGHTS, QUANT})   # it changes ranges and observed min/max only
    example: ClassVar[str] = """
        <ir_version: 10, opset_import: ["" : 17]>
        g (float[1, 4] x) => (float[1, 4] y) {
            h = Relu(x)
            y = Sigmoid(h)
        }
    """
    example_prelude: ClassVar[str] = ""

    method: str = field(default="", metadata={
        "help": "minmax | percentile | entropy | mse | pow2 (empty: config.calibration.method)",
        "choices": ("",) + CALIBRATION_METHODS})
    percentile: float | None = field(default=None, metadata={"help": "percentile method: p in (0, 100]"})
    num_bins: int | None = field(default=None, metadata={"help": "entropy histogram bins (at least 16)"})
    moving_average: bool | None = field(default=None, metadata={
        "help": "minmax: moving average of per-sample min/max instead of the extremes"})
    symmetric: bool | None = field(default=None, metadata={"help": "ranges symmetric around 0"})
    max_samples: int = field(default=0, metadata={"help": "use at most this many samples (0: all)"})
    hold_out: int = field(default=0, metadata={
        "help": "leave the last N samples out of the ranges for search-precision to score on (only "
                "when the data holds at least 4N samples and says how many; 0: use every sample)"})
    data: str = field(default="", metadata={"help": "calibration data path (empty: the model's --calib data)"})

    def settings(self, config: QuantConfig | None) -> CalibrationConfig:
        """config.calibration with this pass's explicit options applied (checked like the config)."""
        base = (config or QuantConfig()).calibration
        given = {k: getattr(self, k) for k in ("method", "percentile", "num_bins", "moving_average", "symmetric")}
        merged = {k: (base.__dict__[k] if v in (None, "") else v) for k, v in given.items()}
        return CalibrationConfig(**merged, averaging_constant=base.averaging_constant)

    def run(self, model: QModel, ctx) -> PassResult:
        cal = self.settings(ctx.config)
        source = self.data or ctx.calibration_data
        if source is None or source == "":
            raise CalibrationDataError("calibrate: no calibration data (pass --calib ...)")
        config = ctx.config
        only = tensors_needing_ranges(model)
        candidates = only if only is not None else [
            name for name, t in model.tensors().items() if isinstance(t, gs.Variable)]
        kept = KeptSamples(KEEP_SAMPLES, source=source)
        data, limit, held_out_from = open_data(source), int(self.max_samples), None
        if self.hold_out > 0 and not self.data and (data.count or 0) >= 4 * self.hold_out:
            held_out_from = data.count - self.hold_out
            limit = min(limit, held_out_from) if limit else held_out_from
        with row_max_probes(model, candidates) as probes:
            ranges, observed, samples = calibrate_ranges(
                model, data, method=cal.method, percentile=float(cal.percentile),
                num_bins=int(cal.num_bins), bits=qtype(config.activation_type).bits,
                symmetric=bool(cal.symmetric), moving_average=bool(cal.moving_average),
                averaging_constant=float(cal.averaging_constant), max_samples=limit,
                only=None if only is None else only | set(probes), kept=kept,
                executor=executors.from_config(config))
        ctx.cache[KeptSamples.CACHE_KEY] = kept if kept.feeds else None
        # as saved: a resumed run reads the same Python floats
        ranges = {k: (float(lo), float(hi)) for k, (lo, hi) in ranges.items()}
        observed = {k: (float(lo), float(hi)) for k, (lo, hi) in observed.items()}
        decision = {"method": cal.method, "given": bool(self.method) or method_given(config.calibration)}
        if held_out_from is not None:
            decision["held_out_from"] = held_out_from
        missed = unobserved(model, only, ranges)   # bodies that never ran: their tensors stay float
        if missed:
            decision["unobserved"] = missed
        modified = (ranges != model.ranges or observed != model.observed
                    or model.decisions.get("calibration") != decision)
        model.ranges, model.observed = ranges, observed
        model.decisions["calibration"] = decision
        ctx.findings.set(self.name, {"method": cal.method, "samples": samples})
        return PassResult(model, modified, {"tensors": len(ranges), "samples": samples, "method": cal.method})
