"""The checks of search-precision: scores of the model quantized with some tensor groups kept at a
higher precision, on the check feeds (cached, budgeted), and the walks over them."""
from __future__ import annotations

import math
import time
from functools import partial

from ... import executors
from ...analysis import op_costs
from ...analysis.sensitivity import eight_bit_share, graph_order, local_errors, promote, weighted_ops
from ...analysis.walks import Walk, aimed, fewest
from ...core.progress import progress
from ...errors import first_line
from ...evaluation.evaluate import Reference
from ...evaluation.objective import recorded
from ...evaluation.scored_runs import ScoredRuns
from ...executors import speculate
from ...executors.scoring import objective_score, objective_scores
from ...ir.model import QModel
from ...quant.qdq import require_opset

NAME = "search-precision"
ORDERS = ("local-error ranking", "graph order")


class Checks:
    """Scores on the held-out feeds of the model with some tensor groups promoted (cached). With a
    parallel executor (config ``executor``) the candidates are quantized here and scored as tasks,
    several at once: the next ones the search may check, found by replaying its decisions on the
    scores known (qpasses.executors.speculate); the decisions, and so the result, are the same."""

    def __init__(self, options, model: QModel, ctx, check: Reference, groups: dict, objective,
                 target: float, fallback: str):
        self.options, self.model, self.ctx, self.groups, self.check_ref = options, model, ctx, groups, check
        self.objective, self.target, self.fallback = objective, target, fallback
        self.budget, self.evaluations = int(2 * math.log2(max(len(groups), 2))) + 16, 0
        self.bar = progress(ctx, NAME, self.budget, unit="evaluations")
        self.scores: dict[frozenset, float] = {}   # key -> its score minus ``confidence`` standard errors
        self.raw: dict[frozenset, float] = {}   # key -> its score itself
        self.uppers: dict[frozenset, float] = {}   # key -> its score plus ``confidence`` standard errors
        self.known: dict = {}   # scored, not yet checked: key -> objective_score's result (or what building raised)
        self.computed: dict = {}   # root -> its entry in the fully quantized trial (its qparams)
        self.raised: QModel | None = None   # the model at the highest opset a trial needed (see _quantized)
        self.copier = None   # (the model trials copy, its QModel.copier)
        # the outputs select-by-snr's chosen variant gave, if any: the first check and the confirmation
        # (on more feeds) may be that model
        self.reuse = ctx.cache.pop(ScoredRuns.CACHE_KEY, None)
        self.executor, self.shared = executors.from_config(ctx.config), None
        self.seconds = {"build": 0.0, "built": 0, "tasks": 0.0, "scored": 0}   # quantizing here, scoring in tasks
        self.speculated: dict = {}   # rounds of speculative tasks, for speculate.LAST
        self.local_db, self.ranking = None, []   # root -> local error in dB; the roots, largest first
        self.aimed = ""   # which order the aim took
        self.confirmed_upper: float | None = None   # the last confirmation's score plus its margin
        self.shares: dict = {}   # keep_8bit -> EightBitShare (the model does not change during the search)

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
        first, rest = self.options.then.split_after("compute-qparams")
        first.run(trial, self.ctx)
        if not promoted:   # its qparams measure the local errors
            self.computed = {n: trial.quant.get(n) for n in self.groups}
        rest.run(trial, self.ctx)
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
        self.scores[key], self.raw[key], self.uppers[key] = self._bound(result), result["score"], self._bound(result, -1)

    def _bound(self, result: dict, sign: int = 1) -> float:
        """What a check compares with the target: the score, ``confidence`` standard errors down
        (``sign`` -1: up, where the aim asks whether two candidates can be told apart)."""
        return self.objective.lower_bound(result["score"], result["standard_error"], sign * self.options.confidence)

    def spread(self, promoted: list[str], label: str) -> dict:
        """The checked score of ``promoted`` and what it counted as, for the decision."""
        key = frozenset(promoted)
        return {label: recorded(self.raw[key]), f"{label}_counted": recorded(self.scores[key])}

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
        ranked, share = self.ranked(), self._share(0.0)
        return self._walked(lambda walk: fewest(walk, ranked, self.target, reserve=reserve, share=share), self.target)

    def confirmed(self, chosen: list[str], rest: Reference, reserve: int = 0) -> tuple[list[str], dict]:
        """``chosen`` (meeting the target on the check feeds) scored on those and ``rest`` together:
        the calibration feeds after them, which the checks did not cover (judged as every check is, in
        evaluate.judging_session; select-by-snr's runs taken when ``chosen`` is its model). While it misses the target
        there and evaluations are left, the worst of ``rest`` (half as many as there are check feeds)
        join the check feeds and the search goes on from ``chosen`` down the ranking (``fewest``,
        leaving ``reserve`` evaluations and one to confirm again). Returns the promotions and what
        the last confirmation read (``met`` None: no evaluation was left to read it)."""
        record = {"feeds": len(self.check_ref.feeds) + len(rest.feeds), "added": 0}
        while rest.feeds and self.evaluations < self.budget:
            both = self.check_ref.plus(rest)
            try:
                runs = both.runs_of(self._quantized(chosen).to_proto(metadata=False).SerializeToString(),
                                    judged=True, reuse=self.reuse)
            except Exception as exc:   # a model that ran on the check feeds and not on these: said, not raised
                record["skipped"] = first_line(exc)
                break
            references = both.runs()
            summary, error = self.objective.summary_and_error(references, runs, both.names)
            self.evaluations += 1
            self.bar.update(self.evaluations)
            bound = self.objective.lower_bound(summary["overall"], error, self.options.confidence)
            record |= {"score": recorded(summary["overall"]), "counted": recorded(bound)}
            self.confirmed_upper = self.objective.lower_bound(summary["overall"], error, -self.options.confidence)
            if bound >= self.target or self.evaluations >= self.budget:
                break
            checked = len(self.check_ref.feeds)
            worst = [i - checked for i in self.objective.worst_feeds(references, runs, both.names) if i >= checked]
            moved = worst[:max(1, checked // 2)]
            self.check_ref = self.check_ref.plus(rest.pick(moved))
            rest = rest.pick(sorted(set(range(len(rest.feeds))) - set(moved)))
            record["added"] += len(moved)
            del record["score"], record["counted"]   # read again on the new promotions, if evaluations are left
            self.confirmed_upper = None
            self.scores, self.raw, self.uppers, self.known, self.shared, self.reuse = {}, {}, {}, {}, None, None
            ranked = chosen + [name for name in self.ranked() if name not in chosen]
            start = len(chosen)   # short of the target on all the feeds, so on the worst of them too
            share = self._share(0.0)
            chosen, _ = self._walked(lambda walk: fewest(walk, ranked, self.target, start, reserve + 1, share),
                                     self.target)
        if "counted" not in record and not rest.feeds:   # every feed is a check feed now
            key = frozenset(chosen)
            record |= {"score": recorded(self.raw[key]), "counted": recorded(self.scores[key])}
        record["met"] = record["counted"] >= self.target if "counted" in record else None
        return chosen, record

    def widest_upper(self, chosen: list[str]) -> float:
        """``chosen``'s score plus its margin on the widest reading: the last confirmation's, else
        the check feeds' (which then hold every feed read), to 0.01 as decisions record scores."""
        upper = self.confirmed_upper if self.confirmed_upper is not None else self.uppers[frozenset(chosen)]
        return float(recorded(upper))

    def blocking(self, chosen: list[str], count: int = 5) -> dict[str, float]:
        """The ``count`` tensors the ranking would promote next (not in ``chosen``), with their local
        errors in dB: where a target missed still costs most."""
        taken = set(chosen)
        left = [name for name in self.ranked() if name not in taken][:count]
        return {name: round(self.local_db[name], 1) for name in left}

    def aim(self, chosen: list[str], aim: float, keep: float) -> tuple[list[str], float]:
        """From ``chosen`` towards ``aim`` while ``keep`` of the weighted ops stay 8-bit, over the
        local-error ranking and the graph order (analysis.walks.aimed); says which order it took."""
        orders, share = self._orders(), self._share(keep)
        promoted, reached, index = self._walked(lambda walk: aimed(walk, orders, chosen, aim, share), aim)
        self.aimed = ORDERS[index] if index >= 0 else "nothing within the share: no head, or each read measurably lower"
        return promoted, reached

    def _orders(self) -> list[list[str]]:
        local = self.ranked()
        return [local, graph_order(self.model, self.groups, local)]

    def _share(self, keep: float):
        if keep not in self.shares:   # on the table shipped, or this machine's timings of the model's patterns
            table = (op_costs.measured(filter(None, map(op_costs.pattern, weighted_ops(self.model))))
                     if self.options.cost == "measured" else None)
            self.shares[keep] = eight_bit_share(self.model, self.groups, keep, table)
        return self.shares[keep]

    def int8_share(self, chosen: list[str]) -> float:
        """The share of the weighted ops' float-vs-int8 latency that stays int8 with ``chosen`` promoted."""
        share = self._share(0.0)
        return (share.eight - share.lost(chosen)) / share.total if share.total else 1.0

    def _walked(self, walk, threshold: float):
        """``walk(Walk)``'s result; with a parallel executor, its checks replayed on scores evaluated
        in rounds of speculative candidates (each assumed to reach ``threshold`` or not)."""
        base, spent = dict(self.scores), self.evaluations
        if not self.executor.parallel:
            return walk(Walk(self.check, self.budget, spent, base, self._upper))
        rounds, scored = 0, 0
        while True:
            try:
                result = walk(Walk(self._replayed, self.budget, spent, base, self._upper))
                break
            except speculate.Unknown as miss:
                batch = speculate.frontier(lambda assumed: walk(Walk(partial(self._supposed, assumed), self.budget,
                                                                     spent, base, partial(self._supposed_upper, assumed))),
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

    def _upper(self, promoted: list[str]) -> float:
        return self.uppers[frozenset(promoted)]

    def _supposed_upper(self, assumed: dict, promoted: list[str]) -> float:
        """A scored candidate's margin up as the search would see it (an assumed score: no margin)."""
        key = frozenset(promoted)
        if key in self.uppers:
            return self.uppers[key]
        known = self.known.get(key)
        return self._bound(known, -1) if isinstance(known, dict) else self._supposed(assumed, promoted)

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
