"""quantize-silu: 8-bit SiLU gates where the outputs show that they cost (almost) nothing."""
from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from ..analysis.silu import quantize_gates, quantize_products, silu_chains, silu_gates
from ..calibration.kept import KeptSamples
from ..core.pipeline import Pass, PassResult, Pipeline, pipeline_option
from ..core.registry import register
from ..errors import CalibrationDataError, first_line
from ..evaluation.evaluate import Reference, max_nodes_option, max_weight_mb_option, rerun_skip_reason
from ..evaluation.objective import Objective, recorded
from ..evaluation.scored_runs import ScoredRuns
from ..executors.scoring import trial_score
from ..ir.analyses import GRAPH, QUANT, RANGES, WEIGHTS
from ..ir.decisions import FLOAT, PRECISION_SEARCH
from ..ir.model import QModel

NAME = "quantize-silu"
DECISION = "silu_gates"


@register
class QuantizeSilu(Pass):
    """Quantize the Sigmoid output of each SiLU (x * Sigmoid(x)) between 8-bit tensors, so that
    onnxruntime runs the pair as QLinearSigmoid + QLinearMul, where the outputs show it costs little.

    Reads: the table and ranges (after search-precision), the calibration feeds search-precision
    checks (held out, else the first: ``samples`` at most, fewer once the outputs hold
    ``output_values`` values, never under 8) and search-precision's decision: metric, target and
    aim. Scores the objective (the worst output component) of the model as it is and with every
    gate 8-bit, each through ``then``, and keeps the gates when that score stays at or above the
    target (as the search checked it: ``checked_at``, with its in-sample allowance) and either
    meets the aim (the bar the default search aims at; where the search's confirmation read the
    model on more feeds, that reading less what the gates cost on these feeds: ddddocr_det's 8
    check feeds read 25.66 dB, 24.98 with the gates, all 32 read 26.23) or lies within
    ``margin_db`` of the first (cosine, top1: not below it). On the benchmark: ddddocr_det 26.48 -> 25.90 dB (aim 25) and 24 %
    faster; yolo_detector 12.98 -> 11.95 and 13.03 -> 12.33 dB, its gates stay float (8-bit, its
    detection F1 fell from 0.84 to 0.79 on held-out images; tools/README.md). Scores taken before
    the search cannot tell the two apart. Then, the same way and held to the same bar against the
    first score, the SiLUs whose product only Concat/Add nodes read (a CSP block: products, their
    residual Adds, joined by a Concat feeding a Conv): gate and product 8-bit (the product's range is
    SiLU's on its input's range; an Add output only that Concat reads takes the Concat's), so that
    onnxruntime runs the joins as QLinearConcat/QLinearAdd (ddddocr_det: 43 more tensors, 25.90 ->
    25.92 dB, 1.17x -> 1.10x onnxruntime's latency). Writes: each gate's (and product's) table entry
    with a why-line, or its float reason extended; ``model.decisions["silu_gates"]`` (gates, chains,
    scores, kept or not).
    Invariants: only under the default op selection (an explicit one, or a target preset, says which
    ops it wants); the graph is not changed; a second run changes nothing; nothing is done (and it
    says why) without re-readable calibration data or above ``max_nodes`` / ``max_weight_mb``.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"calibrated", "types-annotated"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated"})
    unchanged: ClassVar[frozenset] = frozenset({GRAPH, WEIGHTS, QUANT, RANGES})   # it changes its decision only
    example: ClassVar[str] = """
        <ir_version: 10, opset_import: ["" : 17]>
        g (float[1, 2, 4, 4] x) => (float[1, 2, 4, 4] y) <float[2, 2, 1, 1] w = {0.5, -0.25, 0.75, 0.5},
        float[2, 2, 1, 1] v = {0.25, 0.5, -0.5, 0.75}>
        {
            a = Conv(x, w)
            g = Sigmoid(a)
            s = Mul(a, g)
            y = Conv(s, v)
        }
    """
    example_prelude: ClassVar[str] = "annotate-types,calibrate"

    margin_db: float = field(default=0.5, metadata={
        "help": "dB of the worst output component's SNR the 8-bit gates may cost"})
    samples: int = field(default=32, metadata={"help": "most feeds each score runs (search-precision's)"})
    output_values: int = field(default=2**17, metadata={
        "help": "fewer feeds (not under 8) once the outputs hold this many values (search-precision's)"})
    max_nodes: int = max_nodes_option(2000, "each score quantizes a copy")
    max_weight_mb: float = max_weight_mb_option(512.0)
    then: Pipeline = pipeline_option("compute-qparams,fix-bias-scales,insert-qdq,insert-converts",
                                     "the passes that turn a candidate into the QDQ model that is scored")

    def run(self, model: QModel, ctx) -> PassResult:
        config = ctx.config
        if DECISION in model.decisions or config.op_types_to_quantize is not None or config.target:
            return PassResult(model, False, {"gates": 0})
        gates, chains = silu_gates(model), silu_chains(model)
        if not gates and not chains:
            return PassResult(model, False, {"gates": 0})
        skip = rerun_skip_reason(model, ctx.calibration_data, self.max_nodes, self.max_weight_mb)
        if skip:
            ctx.findings.set(NAME, {"skipped": skip})
            return PassResult(model, False, {"gates": 0})
        search = model.decisions.get(PRECISION_SEARCH, {})
        metric, aim = search.get("metric", config.accuracy.metric), search.get("aim")
        target = search.get("checked_at", search.get("target"))   # with the search's in-sample allowance
        objective = Objective(metric, model=model.to_proto(metadata=False))
        try:
            reference, _ = Reference.for_check(model, ctx.calibration_data, ctx.cache.get(KeptSamples.CACHE_KEY),
                                               self.samples, self.output_values)
        except CalibrationDataError as exc:
            ctx.findings.set(NAME, {"skipped": f"the calibration data cannot be read again ({first_line(exc)})"})
            return PassResult(model, False, {"gates": 0})
        before = trial_score(model, self.then, ctx, reference, objective, reuse=ctx.cache.pop(ScoredRuns.CACHE_KEY, None))
        allowed = self.margin_db if metric == "snr" else 0.0
        wide = search.get("confirmed", {}).get("score")   # the search's reading of this model on more feeds

        def acceptable(after: float) -> bool:
            level = after if wide is None else float(wide) - (before - after)   # the cost read on the same feeds
            return (target is None or after >= target) and (after >= before - allowed or (aim is not None and level >= aim))

        def kept_float(names, what: str, after: float) -> None:
            floats = model.decisions.setdefault(FLOAT, {})
            for name in names:
                if name in floats:
                    floats[name]["reason"] += (f"; {NAME}: {what} took the worst output component's "
                                               f"{metric} from {before:.4g} to {after:.4g}")

        decision = {"gates": sorted(gates), "metric": metric, "before": recorded(before), "margin_db": self.margin_db,
                    "feeds": len(reference.feeds)}
        keep, after = False, before
        if gates:
            after = trial_score(model, self.then, ctx, reference, objective,
                                lambda trial: quantize_gates(trial, gates, f"{NAME}: tried"))
            keep = acceptable(after)
            if keep:
                quantize_gates(model, gates, f"{NAME}: a SiLU gate, 8-bit so onnxruntime runs x * Sigmoid(x) on integer "
                                             f"kernels: the worst output component's {metric} went from {before:.4g} to "
                                             f"{after:.4g} on {len(reference.feeds)} calibration feeds")
            else:
                kept_float(gates, "8-bit SiLU gates", after)
            decision.update(after=recorded(after), quantized=keep)
        chained = False
        if chains:   # on top of the gates kept: the total is held to the same bar against ``before``
            with_chains = trial_score(model, self.then, ctx, reference, objective,
                                      lambda trial: quantize_products(trial, chains, f"{NAME}: tried"))
            chained = acceptable(with_chains)
            if chained:
                quantize_products(model, chains, f"{NAME}: a SiLU whose product only Concat/Add read, 8-bit (gate and "
                                                 "product) so onnxruntime runs the SiLU and its joins on integer kernels: "
                                                 f"the worst output component's {metric} went from {before:.4g} to "
                                                 f"{with_chains:.4g} on {len(reference.feeds)} calibration feeds")
            else:
                kept_float(chains.names(), "8-bit SiLU products with their Concat/Add", with_chains)
            decision.update(chains=chains.names(), after_chains=recorded(with_chains), chains_quantized=chained)
        model.decisions[DECISION] = decision
        ctx.findings.set(NAME, decision)
        return PassResult(model, True, {"gates": len(gates) if keep else 0, "chains": len(chains.products) if chained else 0})
