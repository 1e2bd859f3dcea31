"""search-precision: keep the fewest, most sensitive tensors at a higher precision until the
model's outputs meet an accuracy target on held-out calibration feeds."""
from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from ...analysis.requests import pinned
from ...analysis.sensitivity import promote, promotion_groups
from ...calibration.kept import KeptSamples
from ...config.quant_config import ACCURACY_FALLBACKS, ACCURACY_METRICS
from ...core.pipeline import Pass, PassResult, Pipeline, pipeline_option
from ...core.registry import register
from ...errors import CalibrationDataError, first_line
from ...evaluation.evaluate import Reference, max_nodes_option, max_weight_mb_option, rerun_skip_reason
from ...evaluation.objective import Objective
from ...evaluation.scored_runs import ScoredRuns
from ...ir.analyses import GRAPH, RANGES, WEIGHTS
from ...ir.decisions import PRECISION_SEARCH
from ...ir.model import QModel
from .checks import NAME, ORDERS, Checks

DECISION = PRECISION_SEARCH
# The default target: a model whose worst output component is below 12 dB SNR is unusable on the
# benchmark models (a detector's erased probabilities: 3 dB, an embedder at cosine 0.1: ~0 dB),
# while ppocr_v4_det's masks agree at 0.95 IoU from 13 dB on: a higher default would spend
# evaluations and 8-bit layers on models that already work (tools/README.md).
DEFAULT_TARGET_DB = 12.0
# Beyond the target, without one given: 25 dB (the bar for a usable model on every class
# measured) while 80 % of the latency the weighted ops' int8 kernels save stays 8-bit: the cost of
# float is the time it loses (analysis.op_costs; counting ops instead, ppocr_v4_rec read 0.891 on
# 128 samples, 0.938 by multiply-accumulates, both under onnxruntime's latency; tools/RESULTS.md).
DEFAULT_AIM_DB = 25.0
AIM_WITHIN_MARGIN = "nothing: not measurably below the aim (the widest reading plus its margin reaches it)"


@register
class SearchPrecision(Pass):
    """Keep the tensors whose quantization costs most at a higher precision until the outputs meet a target.

    Reads: the table and ranges (after annotate-types and calibrate), the calibration feeds calibrate
    held out from range estimation (``model.decisions["calibration"]["held_out_from"]``; else the first
    ``samples`` feeds, fewer (not under 8) once the outputs hold ``output_values`` values; said in the
    decision). Quantizes a copy with ``then`` and scores the objective against the float model:
    ``metric`` of the worst output component (an output built by Concat is judged piece by piece: boxes
    beside probabilities), less ``confidence`` standard errors (jackknife over the feeds checked, for
    snr on the error-to-signal ratio: a few feeds can flatter a model); an SNR target given must hold
    with ``in_sample_db`` to spare when those feeds were not held out. Below ``target``, it ranks the
    quantized tensors (activations and weights, with the tensors sharing their qparams) by their local
    error — the RMS error quantizing a tensor adds, relative to the median magnitude of its non-zero
    values, from one float run on ``probe_samples`` feeds: a tensor whose few large values stretch the
    grid over its many small ones (an additive attention mask over scores, boxes beside probabilities)
    ranks first — finds by bisection the shortest head of that ranking whose move to ``fallback``
    (float, or 16 bits) meets the target, then gives members back to 8 bits in halves while the target
    still holds, the costliest in float first (a chunk that would save under 0.5 % of the weighted
    ops' float-vs-int8 latency is not tried; ties: the least sensitive first), until 4 fail in a row: at most 2*log2(tensors) + 16 evaluations of a quantized copy on
    the held-out feeds. A target met is confirmed on the next ``confirm_samples`` calibration feeds
    (one evaluation); while it misses there, the worst of them join the check feeds and the bisection
    goes on from the promotions made, down the ranking (the same budget). Then, measurably below ``aim``
    (default: 25 dB of SNR when no target is given; see the invariants), it goes on promoting while ``keep_8bit`` of the latency the
    weighted ops' int8 kernels save stays 8-bit (analysis.op_costs: by op pattern, from the table
    shipped, or with ``cost`` measured, timed on this machine): each of two orders (the same ranking; the graph order, the inputs' end first, as
    errors made early grow through the rest) is cut where the share would drop below ``keep_8bit``,
    a head measurably below the promotions made (its score plus ``confidence`` standard errors under
    theirs less as many) is dropped, of the rest those the checks cannot tell from the best (margins
    overlapping) count as equals and the one keeping the most latency float wins (analysis.walks.aimed);
    it is searched (bisection to the aim, then at most 4 evaluations giving members back) when it meets
    the aim, else kept whole, within the same evaluation budget. With
    ``config.executor`` ray the copies are scored as parallel tasks, a round of them at once: the checks
    the search may make next, found by replaying its decisions (qpasses.executors.speculate); the same
    checks and result.
    Writes: the promoted tensors' table entries (float: removed, with their sharers and the biases
    derived from them, the reason in ``model.decisions["float"]``; 16-bit: the new type, with a
    why-line), ``model.decisions["precision_search"]`` (target, scores and what they counted as,
    promotions, evaluations; what the confirmation read and how many feeds it added to the checks;
    the aim, the share and the order it took; ``int8_share``: the share of that latency left 8-bit). ``met`` is false when the last confirmation missed;
    then ``blocking`` names the tensors next in the ranking, not promoted, with their local errors,
    and ``requested`` those the config named (never promoted).
    Invariants: the graph is not changed; what the config names (tensor_overrides, mixed_precision,
    nodes_to_quantize: qpasses.analysis.requests.pinned) is never promoted; nothing is promoted when the quantized model already meets the
    target on the check feeds or on the confirmation's wider reading, nor for the aim unless that
    reading is measurably below it: its score plus ``confidence`` standard errors under the aim
    (ddddocr_det, a draw of 24 feeds: 24.1 dB on 8 check feeds, 25.4 on all 24; the early Convs the aim kept float
    bought +0.005 F1 on 128 held-out samples, within their standard error, for 1.26x latency); the
    aim never takes the 8-bit share of the weighted ops' int8 latency gain below ``keep_8bit`` (the target may); the
    default's decisions never depend on timings taken during the run; nothing is done (and it says why) without calibration data or above
    ``max_nodes`` / ``max_weight_mb``.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"calibrated", "types-annotated"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated"})
    unchanged: ClassVar[frozenset] = frozenset({GRAPH, WEIGHTS, RANGES})   # it changes the table only
    example: ClassVar[str] = """
        <ir_version: 10, opset_import: ["" : 17]>
        g (float[1, 8] x, float[1, 8] m) => (float[1, 4] y) <float[8, 4] w = {0.9, 0.1, 0.2, 0.3, 0.1, 0.2,
        0.3, 0.4, 0.2, 0.3, 0.4, 0.5, 0.3, 0.4, 0.5, 0.6, 0.4, 0.5, 0.6, 0.7, 0.5, 0.6, 0.7, 0.8, 0.6, 0.7,
        0.8, 0.9, 0.7, 0.8, 0.9, -0.1}, float k = {-10000.0}>
        {
            big = Mul(m, k)
            s = Add(x, big)
            y = MatMul(s, w)
        }
    """
    example_prelude: ClassVar[str] = "annotate-types,calibrate"

    metric: str = field(default="", metadata={
        "help": "snr (dB) | cosine | top1: the objective, per output component (empty: config "
                "accuracy.metric, snr)", "choices": ("",) + ACCURACY_METRICS})
    target: float | None = field(default=None, metadata={
        "help": "the worst output component's score the quantized model must reach (empty: config "
                f"accuracy.target, else {DEFAULT_TARGET_DB:g} dB of SNR; 0: do nothing)"})
    fallback: str = field(default="", metadata={
        "help": "what a promoted tensor becomes: float (runs everywhere) or uint16/int16 (empty: "
                "config accuracy.fallback, float)", "choices": ("",) + ACCURACY_FALLBACKS})
    aim: float | None = field(default=None, metadata={
        "help": "beyond the target, promote towards this score while keep_8bit of the weighted ops' work stays "
                f"8-bit (empty: config accuracy.aim, else {DEFAULT_AIM_DB:g} dB of SNR when no target is given)"})
    keep_8bit: float | None = field(default=None, metadata={
        "help": "share of the latency the weighted ops' int8 kernels save (Conv/ConvTranspose/Gemm/MatMul with a "
                "constant weight, against float) that stays 8-bit while aiming (empty: config accuracy.keep_8bit, 0.8)"})
    cost: str = field(default="table", metadata={
        "help": "what a weighted op loses in float: table (shipped, measured with onnxruntime on one machine: the same "
                "decisions on every CPU) or measured (timed on this machine per op pattern, cached in "
                "~/.cache/qpasses/op-costs; decisions may then differ by machine)", "choices": ("table", "measured")})
    samples: int = field(default=32, metadata={"help": "most feeds a check runs (held out when calibrate held some out)"})
    output_values: int = field(default=2**17, metadata={"help": "fewer feeds (not under 8) once the outputs hold this "
                            "many values: bert_encoder's 128-value embedding read 3 dB above its eval set on 8, 1 on 24"})
    confidence: float = field(default=1.0, metadata={
        "help": "standard errors (jackknife over the check's feeds; for snr, of the error-to-signal ratio) a "
                "score must clear the target by: on bert_encoder 8 feeds read 25.2 dB and the eval set 24.1 "
                "(0: the score itself)"})
    in_sample_db: float = field(default=1.0, metadata={
        "help": "dB a given SNR target must be cleared by on check feeds the ranges were computed from (not "
                "held out): those read 1-2 dB above new data (tools/README.md; the default target and aim "
                "were set on them already)"})
    confirm_samples: int = field(default=32, metadata={
        "help": "most feeds after the checked ones a target met is confirmed on (0: none): one unchecked "
                "feed took ppocr_v4_rec's snr=25 search from 29 dB on its 8 check feeds to 14.5 on all 24"})
    probe_samples: int = field(default=4, metadata={"help": "feeds the local errors are measured on"})
    max_nodes: int = max_nodes_option(2000, "each evaluation quantizes a copy")
    max_weight_mb: float = max_weight_mb_option(512.0)
    then: Pipeline = pipeline_option("compute-qparams,fix-bias-scales,insert-qdq,insert-converts",
                                     "the passes that turn a candidate into the QDQ model that is scored")

    def settings(self, config) -> tuple[str, float, str, float, float, float]:
        """(metric, target, fallback, aim, keep_8bit, room): this pass's options, else config.accuracy,
        else the defaults (an aim of 25 dB only for snr with no target given; no aim: the target);
        ``room``: what an SNR target given must be cleared by on feeds the ranges came from."""
        acc = config.accuracy
        metric = self.metric or acc.metric
        target = self.target if self.target is not None else acc.target
        room = self.in_sample_db if target is not None and metric == "snr" else 0.0
        aim = self.aim if self.aim is not None else acc.aim
        if aim is None:
            aim = DEFAULT_AIM_DB if metric == "snr" and target is None else 0.0
        if target is None:
            target = DEFAULT_TARGET_DB if metric == "snr" else 0.0
        keep = self.keep_8bit if self.keep_8bit is not None else acc.keep_8bit
        return (metric, float(target), self.fallback or acc.fallback, max(float(aim), float(target)), float(keep),
                float(room))

    def run(self, model: QModel, ctx) -> PassResult:
        metric, target, fallback, aim, keep, room = self.settings(ctx.config)
        if aim <= 0 or DECISION in model.decisions:
            return PassResult(model, False, {"promoted": 0})
        skip = rerun_skip_reason(model, ctx.calibration_data, self.max_nodes, self.max_weight_mb)
        pins = pinned(model, ctx.config)
        groups = promotion_groups(model, pins)
        if skip or not groups:
            ctx.findings.set(NAME, {"skipped": skip or "nothing quantized to promote"})
            return PassResult(model, False, {"promoted": 0})
        try:
            kept = ctx.cache.get(KeptSamples.CACHE_KEY)
            check, held_out = Reference.for_check(model, ctx.calibration_data, kept, self.samples, self.output_values)
        except CalibrationDataError as exc:
            ctx.findings.set(NAME, {"skipped": f"the calibration data cannot be read again ({first_line(exc)})"})
            return PassResult(model, False, {"promoted": 0})
        objective = Objective(metric, model=model.to_proto(metadata=False))
        needed = target if held_out else target + room
        aim = max(aim, needed)
        search = Checks(self, model, ctx, check, groups, objective, needed, fallback)
        first = search.check([])
        unpromoted = search.raw[frozenset()]   # on the first check feeds (a confirmation may add more)
        decision = {"metric": metric, "target": target, **({"checked_at": needed} if needed > target else {}),
                    "fallback": fallback, "feeds": len(check.feeds), "held_out": held_out, "confidence": self.confidence,
                    **({"aim": aim} if aim > needed else {})} | search.spread([], "quantized")
        reserve = len(ORDERS) if aim > needed else 0
        rest = self._rest(model, ctx, kept, check, held_out)   # a Reference, or why there is none
        confirming = isinstance(rest, Reference)
        chosen, reached = search.search(reserve + confirming) if first < needed else ([], first)
        if reached >= needed and confirming:
            chosen, confirmed = search.confirmed(chosen, rest, reserve)
            reached = search.scores[frozenset(chosen)]
            decision |= {"confirmed": confirmed, "feeds": len(search.check_ref.feeds)}
        elif reached >= needed and rest:
            decision |= {"confirmed": rest}
        if aim > needed and reached < aim:
            if search.widest_upper(chosen) >= aim:   # the aim spends latency: only measurably below it
                decision |= {"aimed": AIM_WITHIN_MARGIN}
            else:
                chosen, reached = search.aim(chosen, aim, keep)
                decision |= {"aim": aim, "keep_8bit": keep, "aimed": search.aimed}
        search.bar.close()
        decision |= search.spread(chosen, "reached")
        decision |= {"int8_share": round(search.int8_share(chosen), 3), "cost": self.cost} if chosen or "aimed" in decision else {}
        if chosen:
            total = len(groups)
            first, now = ((f" on its first {len(check.feeds)} check feeds", f" on {len(search.check_ref.feeds)}")
                          if search.check_ref is not check else ("", ""))
            how = f"taken over the {search.aimed}" if search.aimed in ORDERS else search.aimed
            goal = (f"target {target:g}" + (f", {needed:g} on feeds the ranges came from" if needed > target else "")
                    + (f", aim {aim:g} with {keep:.0%} of the weighted ops' int8 latency gain 8-bit: {how}"
                       if "aimed" in decision else ""))
            gain = (f"keeping {len(chosen)} of {total} tensors {fallback} takes the worst output component's "
                    f"{metric} from {unpromoted:.4g}{first} to {search.raw[frozenset(chosen)]:.4g}{now} ({goal}"
                    f"{_margin(self.confidence, search.scores[frozenset(chosen)])})")
            promote(model, [groups[name] for name in chosen], fallback, {
                name: f"{NAME}: kept {fallback}: {gain}; this one {_chosen_because(search, name, len(chosen))}"
                for name in chosen})
        met = reached >= target and decision.get("confirmed", {}).get("met") is not False
        decision |= {"promoted": chosen, "evaluations": search.evaluations, "met": met}
        decision |= {} if met else {"blocking": search.blocking(chosen)} | ({"requested": sorted(pins)} if pins else {})
        decision |= {"aim_met": reached >= aim or decision.get("aimed") == AIM_WITHIN_MARGIN} if "aim" in decision else {}
        model.decisions[DECISION] = decision
        ctx.findings.set(NAME, decision)
        if not chosen and search.reuse is not None:   # quantize-silu's first score is select-by-snr's model too
            ctx.cache[ScoredRuns.CACHE_KEY] = search.reuse
        return PassResult(model, True, {"promoted": len(chosen), "evaluations": search.evaluations})

    def _rest(self, model: QModel, ctx, kept, check: Reference, held_out: bool):
        """The next ``confirm_samples`` calibration feeds after the checked ones (Reference.for_rest);
        else None, or why they cannot be read."""
        if self.confirm_samples <= 0:
            return None
        try:
            return Reference.for_rest(model, ctx.calibration_data, kept, len(check.feeds), held_out,
                                      self.confirm_samples)
        except CalibrationDataError as exc:
            return {"skipped": first_line(exc)}


def _chosen_because(search, name: str, promoted: int) -> str:
    """Why the search took this tensor: its rank by local quantization error among those it ranked,
    or, past the head of that ranking, the graph order the aim walked."""
    rank = search.ranking.index(name) + 1
    ranked = (f"ranks {rank} of {len(search.ranking)} by local quantization error "
              f"({search.local_db[name]:+.1f} dB of its typical value)")
    return ranked if rank <= promoted else f"was taken in graph order, the inputs' end first; it {ranked}"


def _margin(confidence: float, bound: float) -> str:
    return f"; counted as {bound:.4g}, the score less {confidence:g} standard error" if confidence else ""
