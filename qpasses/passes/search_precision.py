"""search-precision: keep the fewest, most sensitive tensors at a higher precision until the
model's outputs meet an accuracy target on held-out calibration feeds."""
from __future__ import annotations

import math
import time
from dataclasses import field
from functools import partial
from typing import ClassVar

from .. import executors
from ..analysis.sensitivity import eight_bit_share, graph_order, local_errors, promotion_groups, promote
from ..analysis.walks import Walk, aimed, fewest
from ..config import ACCURACY_FALLBACKS, ACCURACY_METRICS
from ..decisions import PRECISION_SEARCH
from ..errors import CalibrationDataError, first_line
from ..evaluate import Reference, rerun_skip_reason
from ..executors import speculate
from ..executors.scoring import objective_score, objective_scores
from ..ir import QModel
from ..scored_runs import ScoredRuns
from ..objective import Objective
from ..pipeline import Pass, PassResult, run_nested, split_after
from ..progress import progress
from ..qdq import require_opset
from ..registry import register

NAME = "search-precision"
DECISION = PRECISION_SEARCH
# The default target: a model whose worst output component is below 12 dB SNR is unusable on the
# benchmark models (a detector's erased probabilities: 3 dB, an embedder at cosine 0.1: ~0 dB),
# while ppocr_v4_det's masks agree at 0.95 IoU from 13 dB on: a higher default would spend
# evaluations and 8-bit layers on models that already work (tools/README.md).
DEFAULT_TARGET_DB = 12.0
# Beyond the target, without one given: 25 dB (the bar for a usable model on every class
# measured) while 80 % of the weighted ops stay 8-bit. On ppocr_v4_det IoU 0.960 -> 0.984, on
# ppocr_v4_rec text 0.836 -> 0.875, each with 20 % of its weighted ops out of 8 bits (tools/README.md).
DEFAULT_AIM_DB = 25.0
ORDERS = ("local-error ranking", "graph order")


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
    (float, or 16 bits) meets the target, then gives members back to 8 bits in halves, least sensitive
    first, while the target still holds: at most 2*log2(tensors) + 16 evaluations of a quantized copy on
    the held-out feeds. Then, below ``aim`` (default: 25 dB of SNR when no target is given), it goes on
    promoting while ``keep_8bit`` of the weighted ops stay 8-bit: each of two orders (the same ranking;
    the graph order, the inputs' end first, as errors made early grow through the rest) is cut where the
    share would drop below ``keep_8bit``, the order whose head scores higher is searched (bisection to
    the aim, then at most 4 evaluations giving members back), within the same evaluation budget. With
    ``config.executor`` ray the copies are scored as parallel tasks, a round of them at once: the checks
    the search may make next, found by replaying its decisions (qpasses.executors.speculate); the same
    checks and result.
    Writes: the promoted tensors' table entries (float: removed, with their sharers and the biases
    derived from them, the reason in ``model.decisions["float"]``; 16-bit: the new type, with a
    why-line), ``model.decisions["precision_search"]`` (target, scores and what they counted as,
    promotions, evaluations; the aim, the share and the order it took).
    Invariants: the graph is not changed; nothing is promoted when the quantized model already meets the
    aim (the target when there is no aim); the aim never takes the share of 8-bit weighted ops below
    ``keep_8bit`` (the target may); nothing is done (and it says why) without calibration data or above
    ``max_nodes`` / ``max_weight_mb``.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"calibrated", "types-annotated"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated"})
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
        "help": "beyond the target, promote towards this score while keep_8bit of the weighted ops stay "
                f"8-bit (empty: config accuracy.aim, else {DEFAULT_AIM_DB:g} dB of SNR when no target is given)"})
    keep_8bit: float | None = field(default=None, metadata={
        "help": "share of the weighted ops (Conv/ConvTranspose/Gemm/MatMul with a constant weight) that stays "
                "8-bit while aiming (empty: config accuracy.keep_8bit, 0.8)"})
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
    probe_samples: int = field(default=4, metadata={"help": "feeds the local errors are measured on"})
    max_nodes: int = field(default=2000, metadata={
        "help": "do nothing for graphs with more nodes than this (each evaluation quantizes a copy)"})
    max_weight_mb: float = field(default=512.0, metadata={
        "help": "do nothing for models with more weight data than this"})
    then: str = field(default="compute-qparams,fix-bias-scales,insert-qdq,insert-converts", metadata={
        "help": "the passes that turn a candidate into the QDQ model that is scored", "pipeline": True})

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
        groups = promotion_groups(model)
        if skip or not groups:
            ctx.findings.set(NAME, {"skipped": skip or "nothing quantized to promote"})
            return PassResult(model, False, {"promoted": 0})
        try:
            check, held_out = Reference.for_check(model, ctx.calibration_data, ctx.cache.pop("kept_samples", None),
                                                  self.samples, self.output_values)
        except CalibrationDataError as exc:
            ctx.findings.set(NAME, {"skipped": f"the calibration data cannot be read again ({first_line(exc)})"})
            return PassResult(model, False, {"promoted": 0})
        objective = Objective(metric, model=model.to_proto(metadata=False))
        needed = target if held_out else target + room
        aim = max(aim, needed)
        search = _Search(self, model, ctx, check, groups, objective, needed, fallback)
        first = search.check([])
        decision = {"metric": metric, "target": target, **({"checked_at": needed} if needed > target else {}),
                    "fallback": fallback, "feeds": len(check.feeds), "held_out": held_out, "confidence": self.confidence,
                    **({"aim": aim} if aim > needed else {})} | search.spread([], "quantized")
        chosen, reached = search.search(len(ORDERS) if aim > needed else 0) if first < needed else ([], first)
        if aim > needed and reached < aim:
            chosen, reached = search.aim(chosen, aim, keep)
            decision |= {"aim": aim, "keep_8bit": keep, "aimed": search.aimed}
        search.bar.close()
        decision |= search.spread(chosen, "reached")
        if chosen:
            total = len(groups)
            how = f"taken over the {search.aimed}" if search.aimed in ORDERS else search.aimed
            goal = (f"target {target:g}" + (f", {needed:g} on feeds the ranges came from" if needed > target else "")
                    + (f", aim {aim:g} with {keep:.0%} of the weighted ops 8-bit: {how}" if "aimed" in decision else ""))
            promote(model, [groups[name] for name in chosen], fallback, {
                name: (f"{NAME}: kept {fallback}: local quantization error {search.local_db[name]:+.1f} dB "
                       f"of its typical value; with {len(chosen)} of {total} tensors kept {fallback} the "
                       f"worst output component's {metric} goes from {search.raw[frozenset()]:.4g} to "
                       f"{search.raw[frozenset(chosen)]:.4g} ({goal}"
                       f"{_margin(self.confidence, search.scores[frozenset(chosen)])})")
                for name in chosen})
        decision |= {"promoted": chosen, "evaluations": search.evaluations, "met": reached >= target}
        decision |= {"aim_met": reached >= aim} if "aim" in decision else {}
        model.decisions[DECISION] = decision
        ctx.findings.set(NAME, decision)
        return PassResult(model, True, {"promoted": len(chosen), "evaluations": search.evaluations})

class _Search:
    """Scores on the held-out feeds of the model with some tensor groups promoted (cached). With a
    parallel executor (config ``executor``) the candidates are quantized here and scored as tasks,
    several at once: the next ones the search may check, found by replaying its decisions on the
    scores known (qpasses.executors.speculate); the decisions, and so the result, are the same."""

    def __init__(self, options: SearchPrecision, model: QModel, ctx, check: Reference, groups: dict, objective,
                 target: float, fallback: str):
        self.options, self.model, self.ctx, self.groups, self.check_ref = options, model, ctx, groups, check
        self.objective, self.target, self.fallback = objective, target, fallback
        self.budget, self.evaluations = int(2 * math.log2(max(len(groups), 2))) + 16, 0
        self.bar = progress(ctx, NAME, self.budget, unit="evaluations")
        self.scores: dict[frozenset, float] = {}   # key -> its score minus ``confidence`` standard errors
        self.raw: dict[frozenset, float] = {}   # key -> its score itself
        self.known: dict = {}   # scored, not yet checked: key -> objective_score's result (or what building raised)
        self.computed: dict = {}   # root -> its entry in the fully quantized trial (its qparams)
        self.raised: QModel | None = None   # the model at the highest opset a trial needed (see _quantized)
        self.copier = None   # (the model trials copy, its QModel.copier)
        # the outputs select-by-snr's chosen variant gave, if any: the first check may be that model
        self.reuse = ctx.cache.pop(ScoredRuns.CACHE_KEY, None)
        self.executor, self.shared = executors.from_config(ctx.config), None
        self.seconds = {"build": 0.0, "built": 0, "tasks": 0.0, "scored": 0}   # quantizing here, scoring in tasks
        self.speculated: dict = {}   # rounds of speculative tasks, for speculate.LAST
        self.local_db, self.ranking = None, []   # root -> local error in dB; the roots, largest first
        self.aimed = ""   # which order the aim took

    def check(self, promoted: list[str]) -> float:
        """The objective (worst component) on the held-out feeds with ``promoted`` kept at the fallback."""
        key = frozenset(promoted)
        if key not in self.scores:
            if key not in self.known:
                self._evaluate([list(promoted)])
            self._take(key)
        return self.scores[key]

    def _evaluate(self, batch: list[list[str]]) -> None:
        """Quantize every candidate of ``batch`` here, score them (as tasks of a parallel executor,
        each submitted when its model is built)."""
        keys = []

        def built():
            for promoted in batch:
                key, began = frozenset(promoted), time.perf_counter()
                try:
                    trial = self._quantized(promoted)
                except Exception as exc:   # raised when the search checks it (a speculative one: maybe never)
                    if not self.executor.parallel:
                        raise
                    self.known[key] = exc
                    continue
                try:
                    model = trial.to_proto(metadata=False).SerializeToString()
                except Exception as exc:   # scored as a model onnxruntime cannot run
                    self.known[key] = {"score": -math.inf, "failed": first_line(exc)}
                    continue
                keys.append(key)
                self.seconds["build"] += time.perf_counter() - began
                self.seconds["built"] += 1
                yield model

        if not self.executor.parallel:
            results = [objective_score(self.check_ref, m, self.objective, self.reuse) for m in built()]
            self.reuse = None
        else:
            if self.shared is None:   # the reference goes to the object store once
                self.shared = self.executor.put((self.check_ref, self.objective))
            results = objective_scores(self.executor, self.shared, built())
            self.seconds["tasks"] += sum(r["seconds"] for r in results)
            self.seconds["scored"] += len(results)
        self.known.update(zip(keys, results))

    def _quantized(self, promoted: list[str]) -> QModel:
        """A copy with ``promoted`` kept at the fallback, through the ``then`` pipeline."""
        base = self.raised or self.model   # unchanged during the search: exported once (QModel.copier)
        if self.copier is None or self.copier[0] is not base:
            self.copier = (base, base.copier())
        trial = self.copier[1]()
        promote(trial, [self.groups[n] for n in promoted], self.fallback, {})
        first, rest = split_after(self.options.then, "compute-qparams")
        run_nested(first, trial, self.ctx)
        if not promoted:   # its qparams measure the local errors
            self.computed = {n: trial.quant.get(n) for n in self.groups}
        run_nested(rest, trial, self.ctx)
        if trial.opset > base.opset:
            # insert-qdq raised the opset (onnx.version_converter for some ops: 0.26 s a trial on
            # ppocr_v4_rec); later trials start from a copy raised once, as that does not change
            # what any node computes
            self.raised = self.model.copy(share_weights=True)
            require_opset(self.raised, trial.opset)
        return trial

    def _take(self, key: frozenset) -> None:
        """Check the scored candidate ``key``: one evaluation of the search."""
        result = self.known.pop(key)
        if isinstance(result, BaseException):
            raise result
        self.evaluations += 1
        self.bar.update(self.evaluations)
        if result["failed"]:   # a candidate onnxruntime cannot run is never chosen
            self.ctx.findings.update(NAME, {f"failed_{self.evaluations}": result["failed"]})
        self.scores[key], self.raw[key] = self._bound(result), result["score"]

    def _bound(self, result: dict) -> float:
        """What a check compares with the target: the score, ``confidence`` standard errors down."""
        return self.objective.lower_bound(result["score"], result["standard_error"], self.options.confidence)

    def spread(self, promoted: list[str], label: str) -> dict:
        """The checked score of ``promoted`` and what it counted as, for the decision."""
        key = frozenset(promoted)
        return {label: _round(self.raw[key]), f"{label}_counted": _round(self.scores[key])}

    def ranked(self) -> list[str]:
        """Group roots from the largest local error (analysis.sensitivity.local_errors) down."""
        if self.local_db is None:
            feeds = self.check_ref.feeds[:max(1, self.options.probe_samples)]
            self.local_db = local_errors(self.model, self.computed, feeds)
            self.ranking = sorted(self.local_db, key=lambda name: (-self.local_db[name], name))
        return list(self.ranking)

    def search(self, reserve: int = 0) -> tuple[list[str], float]:
        """The fewest promotions found that meet the target (analysis.walks.fewest), leaving
        ``reserve`` evaluations of the budget."""
        ranked = self.ranked()
        return self._walked(lambda walk: fewest(walk, ranked, self.target, reserve=reserve), self.target)

    def aim(self, chosen: list[str], aim: float, keep: float) -> tuple[list[str], float]:
        """From ``chosen`` towards ``aim`` while ``keep`` of the weighted ops stay 8-bit, over the
        local-error ranking and the graph order (analysis.walks.aimed); says which order it took."""
        orders, share = self._orders(), self._share(keep)
        promoted, reached, index = self._walked(lambda walk: aimed(walk, orders, chosen, aim, share), aim)
        self.aimed = ORDERS[index] if index >= 0 else "nothing within the share scored higher"
        return promoted, reached

    def _orders(self) -> list[list[str]]:
        local = self.ranked()
        return [local, graph_order(self.model, self.groups, local)]

    def _share(self, keep: float):
        return eight_bit_share(self.model, self.groups, keep)

    def _walked(self, walk, threshold: float):
        """``walk(Walk)``'s result; with a parallel executor, its checks replayed on scores evaluated
        in rounds of speculative candidates (each assumed to reach ``threshold`` or not)."""
        base, spent = dict(self.scores), self.evaluations
        if not self.executor.parallel:
            return walk(Walk(self.check, self.budget, spent, base))
        rounds, scored = 0, 0
        while True:
            try:
                result = walk(Walk(self._replayed, self.budget, spent, base))
                break
            except speculate.Unknown as miss:
                batch = speculate.frontier(lambda assumed: walk(Walk(partial(self._supposed, assumed), self.budget,
                                                                     spent, base)),
                                           self._width(), (threshold, -math.inf)) or [(miss.key, miss.item)]
                self._evaluate([names for _, names in batch])
                rounds, scored = rounds + 1, scored + len(batch)
        done = self.speculated
        done.update(rounds=done.get("rounds", 0) + rounds, scored=done.get("scored", 0) + scored,
                    used=done.get("used", 0) + self.evaluations - spent,
                    build_seconds=self.seconds["build"], task_seconds=self.seconds["tasks"])
        speculate.LAST.clear()
        speculate.LAST.update(done)
        return result

    def _width(self) -> int:
        done = self.seconds
        return speculate.width(self.executor.workers, done["build"] / max(1, done["built"]),
                               done["tasks"] / max(1, done["scored"]))

    def _replayed(self, promoted: list[str]) -> float:
        key = frozenset(promoted)
        if key not in self.scores:
            if key not in self.known:
                raise speculate.Unknown(key, list(promoted))
            self._take(key)
        return self.scores[key]

    def _supposed(self, assumed: dict, promoted: list[str]) -> float:
        """A score the search would see, with ``assumed`` scores for candidates not scored yet."""
        key = frozenset(promoted)
        if key in self.scores:
            return self.scores[key]
        if key in self.known:
            if isinstance(self.known[key], BaseException):
                raise speculate.Stop
            return self._bound(self.known[key])
        if key in assumed:
            return assumed[key]
        raise speculate.Unknown(key, list(promoted))


def _margin(confidence: float, bound: float) -> str:
    return f"; counted as {bound:.4g}, the score less {confidence:g} standard error" if confidence else ""


def _round(value: float):
    return round(value, 2) if math.isfinite(value) else str(value)
