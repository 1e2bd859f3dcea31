"""select-by-snr: quantize a few variants end to end and keep the one whose outputs are closest to float."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import numpy as np

from .. import executors
from ..analysis.requests import named_tensors
from ..calibration.data import open_data
from ..calibration.kept import KeptSamples
from ..calibration.softmax import ROW_MAX_SUFFIX
from ..core.pipeline import Pass, PassResult, Pipeline, make_pass, pipeline_option
from ..core.progress import progress
from ..core.registry import register
from ..errors import CalibrationDataError, first_line
from ..evaluation.duels import Contender, duel
from ..evaluation.evaluate import MIN_FEEDS, Reference, max_nodes_option, max_weight_mb_option, rerun_skip_reason
from ..evaluation.objective import Objective
from ..evaluation.scored_runs import ScoredRuns
from ..executors import portable
from ..executors.scoring import prescored
from ..ir.analyses import GRAPH
from ..ir.decisions import PRECISION_SEARCH
from ..ir.model import QModel
from ..quant.oprules import WEIGHTED_OPS

NAME = "select-by-snr"
CORRECT_BIAS = "correct-bias"
BIAS_DECISION = "bias_correction"   # model.decisions key correct-bias reads: it does nothing when set
KEEP_RUNS = 32   # the chosen variant's outputs on its first feeds (those it ran), kept for search-precision's checks


@dataclass
class Variant:
    """One choice on one axis: a name, what it does to a model, and its handicap in dB."""

    axis: str
    name: str
    apply: Callable[[QModel], None]
    changes: bool = True                 # False: the model as it is
    penalty_db: float = 0.0
    why: tuple[list[str], str] = ([], "")  # table entries it changes and the reason it gives them


def range_variants(model: QModel, config, fitted_penalty_db: float = 0.0) -> list[Variant]:
    """The calibrated ranges, or the observed min/max (only when the user did not pick the method);
    the calibrated ones handicapped by ``fitted_penalty_db``."""
    info = model.decisions.get("calibration", {})
    method = info.get("method", config.calibration.method)
    if info.get("given", True) or method == "minmax":
        return []
    observed = {k: v for k, v in model.observed.items() if not k.endswith(ROW_MAX_SUFFIX)}
    if all(model.ranges.get(k) == v for k, v in observed.items()):
        return []

    def use_minmax(m: QModel) -> None:
        m.ranges = {k: observed.get(k, v) for k, v in m.ranges.items()}
        m.decisions["calibration"] = {**m.decisions.get("calibration", {}), "method": "minmax", "given": False,
                                      "chosen_by": NAME, "over": method}   # held-out feeds stay held out

    return [Variant("ranges", method, lambda m: None, changes=False, penalty_db=fitted_penalty_db),
            Variant("ranges", "minmax", use_minmax)]


def _gemm_weight(tensor) -> bool:
    """Read only as the weight (second input) of Conv/ConvTranspose/MatMul/Gemm."""
    readers = tensor.outputs if tensor is not None else []
    return bool(readers) and all(n.op in WEIGHTED_OPS and len(n.inputs) > 1 and n.inputs[1] is tensor
                                 for n in readers)


def asymmetric_weights(model: QModel, config) -> list[str]:
    """Per-tensor Conv/MatMul/Gemm weights that are asymmetric by default (neither the config nor
    an override asks for it: a tensor the config names keeps what it asked)."""
    if "weight_symmetric" in config.given:
        return []
    overridden = set(named_tensors(config))
    tensors = model.tensors()
    return [name for name, tq in model.quant.items()
            if tq.role == "weight" and tq.axis is None and not tq.symmetric and not tq.fixed
            and tq.convert is None and name not in overridden and _gemm_weight(tensors.get(name))]


def weight_variants(model: QModel, config, penalty_db: float) -> list[Variant]:
    """Per-tensor weights symmetric (onnxruntime's fastest int8 kernels) or asymmetric."""
    names = asymmetric_weights(model, config)
    if not names:
        return []

    def symmetric(m: QModel) -> None:
        for name in names:
            m.quant[name].symmetric = True

    why = (names, f"symmetric: {NAME} scored symmetric per-tensor weights best (report['{NAME}'])")
    return [Variant("weights", "asymmetric", lambda m: None, changes=False, penalty_db=penalty_db),
            Variant("weights", "symmetric", symmetric, why=why)]


def _label(combo) -> str:
    return ", ".join(f"{v.axis} {v.name}" for v in combo)


@register
class SelectBySnr(Pass):
    """Quantize each open variant on a copy, score its output SNR vs float, keep the best.

    Reads: the table, ranges and observed min/max (after calibrate and annotate-types; placed after
    search-precision, it judges the ranges with the tensors the search keeps float left out, and
    reads the search's saved target), the first ``samples`` calibration feeds (fewer, at
    least 8, for big outputs or inputs) with the float outputs calibrate kept for them (else the
    float model runs on them again). Open axes: ``ranges`` (the calibrated ranges or the observed
    min/max; only when ``calibration.method`` was not chosen by the user) and ``weights``
    (per-tensor weights symmetric or asymmetric; only when ``weight_symmetric`` was not given).
    Each combination runs ``then`` on a copy of the model and is scored by the lowest SNR of an
    output component over the feeds (an output built by Concat judged piece by piece: probabilities
    beside boxes; Q/DQ run as written, the same on every CPU: evaluate.judging_session), minus
    penalties: ``fitted_penalty_db`` for the calibrated ranges, which were fitted to these feeds
    (their clipping is tuned to the tails seen here, and new data has others); ``asymmetric_penalty_db`` trades accuracy for onnxruntime's faster symmetric kernels
    (by default it only settles ties); then the first wins (calibrated ranges, asymmetric weights).
    After search-precision, a variant below its SNR target is not chosen over one that meets it.
    Variants are scored in that order, each against the best so far on the same feeds, the best a
    block of 8 feeds ahead: from 8 feeds on, as soon as one trails the other by more than
    ``early_stop`` standard errors (jackknife over the feeds) both stop and the leader is kept.
    With ``bias_correction``, the chosen variant is scored the same way against itself with correct-bias run after compute-qparams; its corrected biases
    are kept only if it wins. Writes: the chosen variant into ``model.ranges`` / the table (with a
    ``why`` line), the corrected bias values (or not) and ``model.decisions["bias_correction"]``
    (so the correct-bias pass does nothing more); every score goes to the findings. Also
    ``ctx.cache["scored_runs"]``: the chosen variant's outputs on its first 32 feeds, which
    search-precision's first check takes when it is the same model on the same feeds. With
    ``config.executor`` ray, the variants are scored as parallel tasks and the duels replayed on
    their per-feed errors (qpasses.executors.scoring): the same scores and choice.
    Invariants: the graph is not changed (copies share its weight arrays, read-only); nothing is
    done (and it says why) without re-readable calibration data or above ``max_weight_mb`` /
    ``max_nodes``.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"calibrated", "types-annotated"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated"})
    unchanged: ClassVar[frozenset] = frozenset({GRAPH})   # it changes the table, ranges and bias values
    example: ClassVar[str] = """
        <ir_version: 10, opset_import: ["" : 17]>
        g (float[1, 8] x) => (float[1, 4] y) <float[8, 4] w = {0.9, 0.1, 0.2, 0.3, 0.1, 0.2, 0.3, 0.4,
        0.2, 0.3, 0.4, 0.5, 0.3, 0.4, 0.5, 0.6, 0.4, 0.5, 0.6, 0.7, 0.5, 0.6, 0.7, 0.8, 0.6, 0.7, 0.8,
        0.9, 0.7, 0.8, 0.9, -0.1}>
        {
            y = MatMul(x, w)
        }
    """
    example_prelude: ClassVar[str] = "annotate-types,calibrate"

    samples: int = field(default=32, metadata={"help": "calibration feeds each variant is scored on "
                                                          "(16 could not tell ppocr_v2_cls' weight grids apart)"})
    output_values: int = field(default=2**20, metadata={
        "help": "fewer feeds (at least 8) once the outputs compared hold this many values (big outputs "
                "average out noise: a detection map needs fewer images than class scores)"})
    asymmetric_penalty_db: float = field(default=0.05, metadata={
        "help": "dB asymmetric per-tensor weights must gain to be chosen: onnxruntime's int8 kernels "
                "run them up to ~14 % slower (the default only settles ties)"})
    fitted_penalty_db: float = field(default=1.0, metadata={
        "help": "dB the calibrated ranges must gain over the observed min/max to be chosen: fitted to the "
                "feeds that score them, they read 0.7-2.5 dB better there than on held-out data (bert_encoder)"})
    max_weight_mb: float = max_weight_mb_option(512.0, "each variant quantizes a copy")
    max_nodes: int = max_nodes_option(2000, "each variant costs a quantization and an onnxruntime session")
    early_stop: float = field(default=3.0, metadata={
        "help": "stop scoring two variants once one trails the other by this many standard errors "
                "(jackknife over the feeds both scored, from 8 on; 0: every variant scores every feed)"})
    bias_correction: bool = field(default=False, metadata={
        "help": "also score the chosen variant with correct-bias and keep the corrected biases only "
                "if they score higher (else correct-bias does nothing); off by default: on the "
                "benchmark it cost time and chose worse than always correcting (tools/README.md)"})
    then: Pipeline = pipeline_option("compute-qparams,fix-bias-scales,insert-qdq,insert-converts",
                                     "the passes that turn a variant into the QDQ model that is scored")

    def run(self, model: QModel, ctx) -> PassResult:
        config = ctx.config
        axes = [a for a in (range_variants(model, config, self.fitted_penalty_db),
                            weight_variants(model, config, self.asymmetric_penalty_db)) if a]
        bias = (self.bias_correction and bool(self.then.split_after("compute-qparams")[0])
                and BIAS_DECISION not in model.decisions and _has_biases(model))
        kept = ctx.cache.get(KeptSamples.CACHE_KEY)   # search-precision's reference too: it frees them
        if not axes and not bias:
            return PassResult(model, False, {"variants": 0})
        skip = rerun_skip_reason(model, ctx.calibration_data, self.max_nodes, self.max_weight_mb)
        if skip:
            ctx.findings.set(NAME, {"skipped": skip})
            return PassResult(model, False, {"variants": 0})
        reference = self._reference(model, ctx, kept)
        if reference is None:
            ctx.findings.set(NAME, {"skipped": "the calibration data cannot be read again"})
            return PassResult(model, False, {"variants": 0})
        scored, failed, best = [], [], None   # best: (combo, Contender) of the best variant so far
        combos = list(itertools.product(*axes))   # the order is the preference: the first wins ties
        bar = progress(ctx, NAME, len(combos), unit="variants")
        contender_of = self._contenders(model, ctx, reference, combos)
        for i, combo in enumerate(combos):
            bar.update(len(scored) + len(failed))
            try:
                contender = contender_of(i)
                if best is None:
                    contender.advance(MIN_FEEDS)
                winner = self._duel(reference, best[1], contender) if best else contender
            except Exception as exc:   # a variant that cannot be built or run is not chosen
                failed.append({"variant": _label(combo), "error": f"{type(exc).__name__}: {first_line(exc)}"})
                continue
            scored.append((combo, contender))
            if best is None or winner is contender:
                if best:
                    best[1].close()
                best = (combo, contender)
            else:
                contender.close()
        bar.update(len(combos))
        bar.close()
        report = {"samples": len(reference.feeds)} | ({"failed": failed} if failed else {})
        if best is None:   # the passes after this one will meet the same problem and say so
            ctx.findings.set(NAME, report | {"skipped": "no variant could be quantized and run"})
            return PassResult(model, False, {"variants": 0})
        best = _within_target(model, scored, best)
        for variant in best[0]:
            variant.apply(model)
            names, reason = variant.why
            for name in names:
                model.quant[name].because(reason)
        report |= {"chosen": _label(best[0]) or "as configured",
                   "variants": [{"variant": _label(c) or "as configured", "snr_db": round(r.snr(), 2),
                                 "penalty_db": round(r.penalty, 2), "samples": r.ran}
                                | ({"dropped": True} if r.dropped else {}) for c, r in scored]}
        decided = self._bias_correction(model, ctx, best[1], reference, report) if bias else False
        if getattr(best[1], "kept", None) is not None:   # a later check of this model takes the feeds it ran
            ctx.cache[ScoredRuns.CACHE_KEY] = best[1].kept   # and runs only the others (none: the search promoted)
        best[1].close()
        ctx.findings.set(NAME, report)
        return PassResult(model, any(v.changes for v in best[0]) or decided, {"variants": len(scored)})

    def _contenders(self, model: QModel, ctx, reference: Reference, combos: list):
        """i -> the Contender of ``combos[i]``, quantized and given a session when asked; with a
        parallel executor (config ``executor``), all quantized now and scored as parallel tasks
        (qpasses.executors.scoring: the duels replay their per-feed errors, deciding as here)."""
        penalties = [sum(v.penalty_db for v in combo) for combo in combos]
        executor = executors.from_config(ctx.config)
        fresh = model.copier()   # the model does not change until a variant is chosen
        if not executor.parallel or len(combos) < 2:
            return lambda i: Contender(reference, self._quantized(model, ctx, combos[i], fresh=fresh)[0],
                                       penalty=penalties[i], keep=KEEP_RUNS)
        models = []
        for combo in combos:
            try:
                models.append(self._quantized(model, ctx, combo, fresh=fresh)[0].SerializeToString())
            except Exception as exc:   # raised when its turn comes, as above
                models.append(portable(exc))
        return prescored(executor, reference, models, penalties)

    def _duel(self, reference: Reference, best, challenger):
        return duel(reference, best, challenger, min_samples=MIN_FEEDS, z=self.early_stop)

    def _bias_correction(self, model: QModel, ctx, chosen, reference: Reference, report: dict) -> bool:
        """Score the chosen variant with correct-bias against it (``chosen``: its Contender); keep
        the corrected biases if they win. Either way ``model.decisions["bias_correction"]`` says
        what was decided (then the correct-bias pass does nothing more); returns whether it did."""
        try:
            proto, biases = self._quantized(model, ctx, (), with_correct_bias=True)
            contender = Contender(reference, proto, penalty=chosen.penalty) if biases else None
            winner = self._duel(reference, chosen, contender) if contender else None
        except Exception as exc:   # scored like any variant: a failure is reported, not fatal
            error = f"{type(exc).__name__}: {first_line(exc)}"
            report.setdefault("failed", []).append({"variant": CORRECT_BIAS, "error": error})
            ctx.findings.set(CORRECT_BIAS, {"skipped": f"{NAME}: it failed on a copy ({error})"})
            return False
        if contender is None:   # nothing to correct: correct-bias would find nothing either
            return False
        contender.close()
        gain = contender.margin(chosen)   # over the same feeds, with the same penalty
        applied = winner is contender
        report["bias_correction"] = {"snr_db": round(contender.snr(), 2), "gain_db": round(gain, 2),
                                     "samples": contender.ran, "applied": applied}
        model.decisions[BIAS_DECISION] = {"by": NAME, "applied": applied, "gain_db": round(gain, 2)}
        if not applied:
            ctx.findings.set(CORRECT_BIAS, {"skipped": f"{NAME} scored the model {gain:+.2f} dB with it"})
            return True
        tensors = model.tensors()
        for name, (values, why) in biases.items():
            tensors[name].values = values
            model.quant[name].because(why)
        ctx.findings.set(CORRECT_BIAS, {"applied_by": NAME, "biases": len(biases), "gain_db": round(gain, 2)})
        return True

    def _quantized(self, model: QModel, ctx, combo, with_correct_bias: bool = False, fresh=None):
        """(the QDQ model of a copy of ``model`` with ``combo`` applied and ``then`` run, None); with
        ``with_correct_bias``, correct-bias runs right after compute-qparams and the second item is
        {bias: (corrected values, why line)}. ``fresh``: ``model.copier()``, made once for many trials."""
        trial = fresh() if fresh is not None else model.copy(share_weights=True)
        for variant in combo:
            variant.apply(trial)
        first, rest = self.then.split_after("compute-qparams")
        corrected = None
        if with_correct_bias:
            trial.decisions.pop(BIAS_DECISION, None)
            (first + [make_pass(CORRECT_BIAS)]).run(trial, ctx)
            corrected = _changed_biases(model, trial)
        else:
            rest = first + rest
        rest.run(trial, ctx)
        return trial.to_proto(metadata=False), corrected

    def _reference(self, model: QModel, ctx, kept) -> Reference | None:
        reference = Reference.from_kept(kept, model, self.samples, self.output_values, MIN_FEEDS)
        if reference is None:   # else calibrate kept enough: no second float run
            try:
                reference = Reference.run(model, open_data(ctx.calibration_data), self.samples,
                                          enough_values=self.output_values, min_samples=MIN_FEEDS)
            except CalibrationDataError:
                return None
        return reference.split(Objective("snr", model=model)) if reference.feeds else None


def _within_target(model: QModel, scored: list, best: tuple) -> tuple:
    """The best variant that keeps search-precision's SNR target (its saved decision, when it ran
    first) if the best one falls below it: a range choice made after the search must not undo it."""
    search = model.decisions.get(PRECISION_SEARCH, {})
    target = search.get("target") if search.get("metric") == "snr" else None
    if target is None or best[1].snr() >= target:
        return best
    meeting = [s for s in scored if s[1].snr() >= target]
    return max(meeting, key=lambda s: s[1].score()) if meeting else best


def _has_biases(model: QModel) -> bool:
    return any(tq.role == "bias" for _, tq in model.quant.items())


def _changed_biases(model: QModel, trial: QModel) -> dict[str, tuple[np.ndarray, str]]:
    """{bias: (values, last why line)} of the table's biases whose values differ in ``trial``."""
    ours, theirs = model.tensors(), trial.tensors()
    out = {}
    for name, tq in model.quant.items():
        if tq.role != "bias" or name not in theirs or not hasattr(theirs[name], "values"):
            continue
        new = np.asarray(theirs[name].values)
        if not np.array_equal(new, np.asarray(ours[name].values)):
            out[name] = (new, trial.quant[name].why[-1])
    return out
