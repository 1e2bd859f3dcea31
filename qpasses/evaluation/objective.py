"""The accuracy objective: how far a model's outputs are from the float model's, per output
*component*, in the metric the user checks.

Components
    An output built by a Concat along a non-batch axis (axis 0 is taken as the batch axis) is
    measured per concatenated piece, so that no piece can hide behind a larger one: a YOLO head
    ``output = Concat([boxes (1,4,N), Sigmoid(scores) (1,80,N)], axis=1)`` has the components
    ``output[boxes]`` (``output[0:4]`` on axis 1) and ``output[scores]`` (``output[4:84]``).
    The pieces are found statically in the float model: the output's producer, looking through
    Identity and Transpose nodes (a Transpose moves the axis), is a Concat whose inputs have a
    static size along the concat axis (from value_info, else from one run of onnx shape
    inference). A piece is named after its Concat input tensor, or by its range when that name
    is not unique. Every other output is one component named like the output. When an output's
    size along the axis differs at run time from the static sizes' sum, it is one component.
    (The static analysis: qpasses.analysis.output_components; Component and output_components
    are re-exported here.)

Metrics (every one: higher is better)
    ``snr``     10*log10(sum ref^2 / sum (ref-test)^2) in dB over all feeds (inf: identical).
    ``cosine``  the mean over feeds of the cosine similarity of the flattened component
                (1 when both are all zero, 0 when only one is).
    ``top1``    the fraction of positions (all indices but the last) whose argmax over the last
                axis agrees, over all feeds; for a component, argmax over the component's slice.
    a callable  ``metric(float_outputs, quant_outputs) -> float``: each argument is a list over
                feeds of ``{output_name: numpy array}`` holding every model output as onnxruntime
                returns it (batch axis included, the model's dtype, outputs in model order). It is
                called once for all feeds; its value is the objective (one number, no components).
                On the command line: ``--metric module:function`` (the module is imported from
                the current directory or PYTHONPATH).
    Built-in metrics accumulate in float64 with vectorized numpy (no per-element Python loops).

API
    ``Objective(metric="snr", *, model=None, components=None, name=None)``
        ``metric``: "snr" | "cosine" | "top1" | a callable; ``model``: the float model (path,
        ModelProto, bytes or QModel) whose outputs are split into components (without it or
        ``components``, every output is one component); ``name``: the user metric's name.
    ``Objective.for_model(model) -> Objective``   the same metric with ``model``'s components.
    ``Objective.scores(reference_outputs, test_outputs) -> dict[str, float]``
        lists over feeds of ``{output_name: array}``; keyed by component name ("out",
        "out[boxes]"); a user metric gives one entry keyed by its name.
    ``Objective.scores_from_runs(reference_runs, test_runs, names) -> dict[str, float]``
        the same from lists over feeds of lists of arrays in the order of ``names``, as
        ``session.run(names, feed)`` returns them (what a search pass holds).
    ``objective_scores(objective, reference_runs, test_runs, names)``  the function form of that.
    ``Objective.overall(scores) -> float``   the minimum over components (a user metric: its value).
    ``Objective.components_for(names, reference_runs=None) -> dict[str, list[Component]]``
        per output, the components scored (an output whose run-time size along the concat axis
        differs from the static split is one component).
    ``Objective.summary(reference_runs, test_runs, names) -> dict``
        ``{metric, overall, components, outputs: {output: [component names]}, slices}`` (the
        report's ``objective`` section).
    ``Objective.format(value) -> str``   e.g. "SNR 31.20 dB", "cosine 0.999812", "top1 0.984375".
    ``Objective.headline(result) -> str``   what ``qpasses run`` and the report say first of a
        compared model: the objective (the worst component) and, with several, which one.
    ``output_components(model) -> dict[str, list[Component]]``   the static analysis alone.
    ``parse_metric(spec) -> Objective``   "snr" | "cosine" | "top1" | "module:function"; a bad
        spec raises MetricError (a QpassesError, one line) before anything runs.
    ``qpasses.evaluation.evaluate.compare(float_model, test_model, feeds, objective=...)`` (and
        ``Reference.score(test_model, objective=...)``) add ``components`` (SNR per component)
        and ``objective`` (the summary) to their result.
"""
from __future__ import annotations

import importlib
import math
import os
import sys
from pathlib import Path

import numpy as np

from ..analysis.output_components import Component, output_components
from ..errors import ModelError, QpassesError, first_line
from .evaluate import snr_from_sums

BUILTIN_METRICS = ("snr", "cosine", "top1")


class MetricError(QpassesError):
    """A --metric spec that cannot be used, or a user metric that failed or returned no number."""


# ---------------------------------------------------------------------------------------------
# the objective

class Objective:
    """A metric over the model's outputs and their components (see the module docstring)."""

    def __init__(self, metric="snr", *, model=None, components: dict | None = None, name: str | None = None):
        if callable(metric):
            self.fn = metric
            self.metric = name or getattr(metric, "__name__", None) or "metric"
        elif isinstance(metric, str) and metric.lower() in BUILTIN_METRICS:
            self.fn, self.metric = None, metric.lower()
        else:
            raise MetricError(f"unknown metric {metric!r}: expected {', '.join(BUILTIN_METRICS)} or a callable")
        if model is not None and components is None:
            components = output_components(model)
        self.components = components

    def __repr__(self) -> str:
        return f"Objective({self.metric!r}{', with components' if self.components is not None else ''})"

    @property
    def builtin(self) -> bool:
        return self.fn is None

    def for_model(self, model) -> "Objective":
        """The same metric, with the components of the float ``model``'s outputs."""
        return Objective(self.fn or self.metric, name=self.metric, model=model)

    def with_metric(self, metric, name: str | None = None) -> "Objective":
        """Another metric over the same components."""
        return Objective(metric, name=name, components=self.components)

    # -- scoring -----------------------------------------------------------------------------
    def scores(self, reference_outputs: list, test_outputs: list) -> dict[str, float]:
        """Per component, the metric of ``test_outputs`` against ``reference_outputs`` (lists over
        feeds of ``{output_name: array}``; a single dict is one feed)."""
        if isinstance(reference_outputs, dict):
            reference_outputs, test_outputs = [reference_outputs], [test_outputs]
        if len(reference_outputs) != len(test_outputs):
            raise ValueError(f"{len(reference_outputs)} reference feeds but {len(test_outputs)} test feeds")
        if not reference_outputs:
            return {} if self.builtin else {self.metric: self._call([], [])}
        names = list(reference_outputs[0])
        if not self.builtin:
            return {self.metric: self._call(reference_outputs, test_outputs)}
        return self._builtin_scores([[r[n] for n in names] for r in reference_outputs],
                                    [[t[n] for n in names] for t in test_outputs], names)

    def scores_from_runs(self, reference_runs: list, test_runs: list, names: list[str]) -> dict[str, float]:
        """``scores`` from lists over feeds of lists of arrays in the order of ``names``."""
        if len(reference_runs) != len(test_runs):
            raise ValueError(f"{len(reference_runs)} reference feeds but {len(test_runs)} test feeds")
        if not self.builtin:
            return {self.metric: self._call([dict(zip(names, r)) for r in reference_runs],
                                            [dict(zip(names, t)) for t in test_runs])}
        return self._builtin_scores(reference_runs, test_runs, list(names))

    def overall(self, scores: dict[str, float]) -> float:
        """The minimum over components (a user metric: its single value)."""
        if not scores:
            return {"snr": math.inf, "cosine": 1.0, "top1": 1.0}.get(self.metric, math.nan)
        return float(min(scores.values()))

    def components_for(self, names: list[str], reference_runs: list | None = None) -> dict[str, list[Component]]:
        """Per output, the components scored (checked against the feeds' shapes when given)."""
        result = {}
        for k, name in enumerate(names):
            arrays = [run[k] for run in reference_runs] if reference_runs is not None else None
            result[name] = self._components(name, arrays)
        return result

    def summary(self, reference_runs: list, test_runs: list, names: list[str]) -> dict:
        """The report's ``objective`` section: metric, overall, per-component scores, which
        components each output has and where they lie."""
        return self.summary_and_error(reference_runs, test_runs, names, error=False)[0]

    def summary_and_error(self, reference_runs: list, test_runs: list, names: list[str], *,
                          error: bool = True) -> tuple[dict, float | None]:
        """``summary`` and (``error``) ``standard_error``, a built-in metric's from one pass over the
        outputs (a user metric's: one more call per feed)."""
        if self.builtin:
            scores, stats = self._scores_and_stats(reference_runs, test_runs, names)
        else:
            scores, stats = self.scores_from_runs(reference_runs, test_runs, names), None
        comps = self.components_for(names, reference_runs)
        summary = {"metric": self.metric, "overall": self.overall(scores), "components": scores,
                   "outputs": {n: [c.name for c in cs] for n, cs in comps.items()},
                   "slices": {c.name: c.where for cs in comps.values() for c in cs if c.axis is not None}}
        if not error:
            return summary, None
        if stats is not None:
            return summary, self._stats_error(stats)
        return summary, self.standard_error(reference_runs, test_runs, names)

    def format(self, value: float) -> str:
        """A score as printed: "SNR 31.20 dB", "cosine 0.999812", "top1 0.984375", "<name> 0.93"."""
        if self.metric == "snr":
            return "SNR " + format_db(value)
        if self.metric in ("cosine", "top1"):
            return f"{self.metric} {value:.6f}"
        return f"{self.metric} {value:.6g}"

    # -- internals ---------------------------------------------------------------------------
    def _call(self, reference_outputs: list, test_outputs: list) -> float:
        try:
            value = self.fn(reference_outputs, test_outputs)
        except Exception as exc:
            raise MetricError(f"metric {self.metric} failed: {type(exc).__name__}: {first_line(exc)}") from None
        try:
            if np.ndim(value) != 0 or isinstance(value, (str, bytes)):
                raise TypeError
            return float(value)
        except (TypeError, ValueError):
            text = repr(value)
            text = text if len(text) <= 60 and "\n" not in text else type(value).__name__
            raise MetricError(f"metric {self.metric} returned {text}, not a number") from None

    def _components(self, name: str, arrays: list | None) -> list[Component]:
        comps = (self.components or {}).get(name)
        if not comps or len(comps) < 2:
            return [Component(name, name)]
        axis, total = comps[0].axis, comps[-1].stop
        if arrays is not None and any(np.ndim(a) <= axis or np.shape(a)[axis] != total for a in arrays):
            return [Component(name, name)]   # not the static layout at run time: one piece
        return comps

    def _builtin_scores(self, reference_runs: list, test_runs: list, names: list[str]) -> dict[str, float]:
        return self._scores_and_stats(reference_runs, test_runs, names)[0]

    def _scores_and_stats(self, reference_runs: list, test_runs: list, names: list[str]) -> tuple[dict, np.ndarray]:
        labels, stats = self._feed_stats(reference_runs, test_runs, names)
        return dict(zip(labels, _aggregate(self.metric, stats.sum(axis=0)))), stats

    def _feed_stats(self, reference_runs: list, test_runs: list, names: list[str]) -> tuple[list[str], np.ndarray]:
        """Component names, and per feed and component the two sums the metric adds up over feeds
        (snr: signal and error energy; cosine: the cosine and 1; top1: agreeing and all positions)."""
        labels, columns = [], []
        for k, name in enumerate(names):
            refs = [np.asarray(run[k]) for run in reference_runs]
            tests = [np.asarray(run[k]) for run in test_runs]
            for i, (r, t) in enumerate(zip(refs, tests)):
                if r.shape != t.shape:
                    raise ModelError(f"output {name}: shape {t.shape} on feed {i}, the reference has {r.shape}")
            comps = self._components(name, refs)
            labels += [c.name for c in comps]
            columns.append(np.array([_feed_sums(self.metric, r, t, comps) for r, t in zip(refs, tests)])
                           .reshape(len(refs), len(comps), 2))
        return labels, np.concatenate(columns, axis=1) if columns else np.zeros((len(reference_runs), 0, 2))

    def standard_error(self, reference_runs: list, test_runs: list, names: list[str]) -> float:
        """The jackknife standard error over the feeds of ``overall`` (0 with fewer than two feeds).
        For snr, of the worst component's error-to-signal ratio instead of its dB: leaving out the
        one feed that holds most of the error moves the dB far, and upwards only (a classifier's
        8 check feeds: 35 dB +- 39), while the ratio's spread says how much worse it may get."""
        if self.builtin:
            return self._stats_error(self._feed_stats(reference_runs, test_runs, names)[1])
        return jackknife(self._left_out(reference_runs, test_runs, names) if len(reference_runs) >= 2 else [])

    def worst_feeds(self, reference_runs: list, test_runs: list, names: list[str]) -> list[int]:
        """The feeds from the one whose leaving out raises ``overall`` most (the worst) down."""
        n = len(reference_runs)
        if n < 2:
            return list(range(n))
        if self.builtin:
            left_out = self._left_out_sums(self._feed_stats(reference_runs, test_runs, names)[1])
        else:
            left_out = self._left_out(reference_runs, test_runs, names)
        return sorted(range(n), key=lambda i: (-left_out[i], i))

    def _left_out(self, reference_runs: list, test_runs: list, names: list[str]) -> list[float]:
        """``overall`` with each feed left out in turn (a user metric: one call per feed)."""
        return [self.overall(self.scores_from_runs(reference_runs[:i] + reference_runs[i + 1:],
                                                   test_runs[:i] + test_runs[i + 1:], names))
                for i in range(len(reference_runs))]

    def _left_out_sums(self, stats: np.ndarray) -> list[float]:
        """``_left_out`` from a built-in metric's per-feed sums (``_feed_stats``)."""
        total = stats.sum(axis=0)
        return [self.overall(dict(enumerate(_aggregate(self.metric, total - row)))) for row in stats]

    def _stats_error(self, stats: np.ndarray) -> float:
        """``standard_error`` from a built-in metric's per-feed sums (``_feed_stats``)."""
        if len(stats) < 2:
            return 0.0
        if self.metric == "snr":
            total = stats.sum(axis=0)
            return jackknife([_worst_ratio(total - row) for row in stats])
        return jackknife(self._left_out_sums(stats))

    def headline(self, result: dict, over: str = "") -> str:
        """The first thing a user reads of a compared model (evaluate.compare with this objective):
        the objective -- the worst output component -- then ``over`` (" over 32 samples"), and which
        component is the worst when there are several; a metric other than snr adds the worst SNR."""
        summary = result.get("objective")
        if not summary:
            return f"output SNR vs float: {format_db(result['snr_db'])}{over}"
        snr = self.builtin and self.metric == "snr"
        text = (f"output SNR vs float: {format_db(summary['overall'])}" if snr else
                f"objective: {self.format(summary['overall'])}") + over
        scores = summary["components"]
        if self.builtin and len(scores) > 1:
            text += f", worst of {len(scores)} output components: {min(scores, key=scores.get)}"
        if not snr and "snr_db" in result:
            text += f"; output SNR vs float: {format_db(min(result.get('components', {}).values(), default=result['snr_db']))}"
        return text

    def spread_note(self, result: dict) -> str:
        """For a compared model (evaluate.compare with this objective): its worst component one
        standard error down, as the samples spread, in words; for snr with a finite, non-zero error."""
        error = result.get("standard_error") or 0.0
        if self.metric != "snr" or not result.get("objective") or not 0 < error < math.inf:
            return ""
        low = self.lower_bound(result["objective"]["overall"], error, 1.0)
        return f" (the worst component one standard error down, as they spread: {self.format(low)})"

    def paired_difference(self, reference_runs: list, runs_a: list, runs_b: list, names: list[str]) -> tuple[float, float]:
        """``overall`` of ``runs_b`` less that of ``runs_a`` (both on the reference's feeds), and the
        jackknife standard error of that difference (each feed left out of both in turn). One feed
        holding most of the error moves both scores, not their difference: on ppocr_v2_cls a weight
        reconstruction read 4.4 dB worse pooled over 16 feeds while better on 11 of them, and 7.8
        dB better on 128 held-out samples."""
        if self.builtin:
            stats = [self._feed_stats(reference_runs, runs, names)[1] for runs in (runs_a, runs_b)]
            a, b = (self.overall(dict(enumerate(_aggregate(self.metric, s.sum(axis=0))))) for s in stats)
            left = [self._left_out_sums(s) for s in stats] if len(reference_runs) >= 2 else [[], []]
        else:
            a, b = (self.overall(self.scores_from_runs(reference_runs, runs, names)) for runs in (runs_a, runs_b))
            left = ([self._left_out(reference_runs, runs, names) for runs in (runs_a, runs_b)]
                    if len(reference_runs) >= 2 else [[], []])
        with np.errstate(invalid="ignore"):
            differences = [lb - la for la, lb in zip(*left)]
        return b - a, jackknife(differences)

    def lower_bound(self, score: float, error: float, z: float) -> float:
        """``score`` less ``z`` standard errors ``error`` (``standard_error``; for snr taken on the
        error-to-signal ratio, then back in dB). No finite error (all of a component's signal in one
        feed): the score itself."""
        if not z or not math.isfinite(error):
            return score
        if not (self.builtin and self.metric == "snr"):
            return score - z * error
        ratio = 10 ** (-score / 10) if math.isfinite(score) else (0.0 if score > 0 else math.inf)
        worse = ratio + z * error
        return -10 * math.log10(worse) if worse > 0 else math.inf


def recorded(score: float):
    """A score as a saved decision holds it: to 0.01 (a non-finite one as text). The digits after
    differ between CPUs' float kernels (a check's 42.2841 dB read 42.2842 under AVX2), and the
    decisions are part of the output's bytes."""
    return round(float(score), 2) if math.isfinite(score) else str(score)


def format_db(value: float) -> str:
    """An SNR as printed: "31.20 dB", "inf dB (identical)"."""
    return "inf dB (identical)" if math.isinf(value) and value > 0 else f"{value:.2f} dB"


def jackknife(left_out: list[float]) -> float:
    """The jackknife standard error from the leave-one-out values (0 with fewer than two; inf when
    one is not finite)."""
    n = len(left_out)
    values = np.array(left_out, np.float64)
    if n < 2:
        return 0.0
    if not np.isfinite(values).all():
        return math.inf
    return float(math.sqrt((n - 1) / n * np.sum((values - values.mean()) ** 2)))


def _worst_ratio(sums: np.ndarray) -> float:
    """The largest error-to-signal ratio over components (sums: (components, 2), see _feed_sums)."""
    signal, error = sums[:, 0], sums[:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(error == 0, 0.0, np.where(signal == 0, np.inf, error / signal))
    return float(ratio.max(initial=0.0))


def objective_scores(objective: Objective, reference_runs: list, test_runs: list, names: list[str]) -> dict[str, float]:
    """``objective.scores_from_runs``: per component scores from per-feed lists of arrays in the
    order of ``names`` (e.g. ``session.run(names, feed)`` results)."""
    return objective.scores_from_runs(reference_runs, test_runs, names)


def _segment_dots(a: np.ndarray, b: np.ndarray, comps: list[Component]) -> np.ndarray:
    """Per component, the sum of ``a * b`` (float64, output-shaped arrays) over that component
    (numpy's einsum: one pass, no temporary, no BLAS threads competing with onnxruntime's)."""
    axis = comps[0].axis
    if axis is None:
        shape = (1, 1, a.size)
    else:
        shape = (math.prod(a.shape[:axis]), a.shape[axis], math.prod(a.shape[axis + 1:]))
    per_index = np.einsum("ijk,ijk->j", a.reshape(shape), b.reshape(shape))
    if axis is None:
        return per_index
    return np.add.reduceat(per_index, [c.start for c in comps]) if per_index.size else np.zeros(len(comps))


def _feed_sums(metric: str, r: np.ndarray, t: np.ndarray, comps: list[Component]) -> np.ndarray:
    """One feed's (components, 2) sums for ``metric`` (see Objective._feed_stats)."""
    r, t = r.astype(np.float64, copy=False), t.astype(np.float64, copy=False)
    if metric == "snr":
        d = r - t
        return np.stack([_segment_dots(r, r, comps), _segment_dots(d, d, comps)], axis=-1)
    if metric == "cosine":
        dot, rr, tt = _segment_dots(r, t, comps), _segment_dots(r, r, comps), _segment_dots(t, t, comps)
        with np.errstate(divide="ignore", invalid="ignore"):
            c = dot / np.sqrt(rr * tt)
        c = np.where((rr == 0) & (tt == 0), 1.0, np.where((rr == 0) | (tt == 0), 0.0, c))
        return np.stack([c, np.ones(len(comps))], axis=-1)
    sums = np.zeros((len(comps), 2))
    for j, c in enumerate(comps):   # top1: argmax agreement over the last axis of each slice
        rc, tc = c.take(r), c.take(t)
        if rc.ndim == 0 or rc.size == 0:
            sums[j] = rc.size, rc.size
            continue
        same = np.argmax(rc, axis=-1) == np.argmax(tc, axis=-1)
        sums[j] = np.count_nonzero(same), same.size
    return sums


def _aggregate(metric: str, sums: np.ndarray) -> list[float]:
    """Per component, the metric from its sums over feeds ((components, 2), see _feed_sums)."""
    first, second = sums[:, 0], sums[:, 1]
    if metric == "snr":
        values = snr_from_sums(first, second)
    else:   # cosine: the mean over feeds; top1: the agreeing fraction (no feed or position: 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.where(second == 0, 1.0, first / second)
    return [float(v) for v in values]


# ---------------------------------------------------------------------------------------------
# --metric

def parse_metric(spec: str | None) -> Objective:
    """An Objective from a --metric spec: "snr" (also None), "cosine", "top1" or "module:function"
    (importable from the current directory or PYTHONPATH). A bad spec raises MetricError."""
    if spec is None or spec.strip().lower() in BUILTIN_METRICS:
        return Objective((spec or "snr").strip().lower())
    module_name, sep, attr = spec.strip().partition(":")
    if not sep or not module_name or not attr:
        raise MetricError(f"--metric {spec!r}: expected {', '.join(BUILTIN_METRICS)} or module:function")
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise MetricError(f"--metric {spec!r}: cannot import module {module_name!r} "
                          f"({type(exc).__name__}: {first_line(exc)})") from None
    finally:
        if added:
            sys.path.remove(cwd)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            where = getattr(module, "__file__", None) or module_name
            raise MetricError(f"--metric {spec!r}: {Path(where).name if where != module_name else module_name} "
                              f"has no {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise MetricError(f"--metric {spec!r}: {attr} is not callable ({type(fn).__name__})")
    return Objective(fn, name=spec.strip())
