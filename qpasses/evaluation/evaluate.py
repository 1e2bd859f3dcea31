"""Numeric comparison of two models in onnxruntime: SNR and max error per output."""
from __future__ import annotations

import itertools
import math
from dataclasses import field
from pathlib import Path

import numpy as np
import onnx

from ..calibration import segments
from ..calibration.data import InputSpec, validate
from ..calibration.sessions import ort_session
from ..errors import CalibrationDataError, ModelError
from ..executors.threads import in_order, thread_count
from ..ir.model import QModel, constant_bytes, load, load_external_data, max_ort_ir_version
from .scored_runs import ScoredRuns, model_bytes


def session(model, *, optimize: bool = True, threads: int | None = None, float_only: bool = False):
    """An onnxruntime CPU session for a QModel, ModelProto, bytes or path (``optimize=False``: no
    graph optimizations, so Q/DQ pairs run as written instead of as fused integer kernels; a
    quantized model is judged in ``judging_session``; ``threads``: onnxruntime's, None: its default)."""
    model = _serialized(model)
    try:
        return ort_session(model if isinstance(model, bytes) else str(model), optimization=None if optimize else "none",
                           threads=threads, float_only=float_only)
    except Exception:
        if isinstance(model, bytes):
            raise
        proto = onnx.load(str(model), load_external_data=False)  # e.g. an IR version ORT refuses
        if proto.ir_version <= max_ort_ir_version():
            raise
        load_external_data(proto, Path(model).parent)
        return session(load(proto), optimize=optimize, threads=threads, float_only=float_only)


JUDGED_FOLDING_BYTES = 256 * 2**20   # models from this size on are judged unoptimized (see judging_session)


def judging_session(model):
    """The session every judgement of a quantized model runs in (select-by-snr's variants,
    search-precision's checks, quantize-silu, round-weights): each Q/DQ as written, never fused into
    onnxruntime's integer kernels (session.disable_quant_qdq), and every other op in float. Those
    kernels differ by CPU (without VNNI, U8S8 pair sums saturate in int16); this simulation does
    not, so the same model, data and config give the same decisions on every CPU. onnxruntime's
    float optimizations do run (NCHWc convolutions, fused activations, weight DQs folded to the
    same float values): a judged run of yolo_detector's trials 26 -> 19 ms, bert_encoder's
    4 -> 1.5 ms, for about 25 ms more per session. A model of JUDGED_FOLDING_BYTES or more (its
    folded weights are float copies, 4x their int8 bytes), or one the optimizer refuses, runs
    unoptimized. It runs on one thread, as float kernels may round differently on another number
    (yolo_detector's select-by-snr read 7.68 dB on 2 threads, 7.66 on 1), so the scores do not
    depend on the cores either; the cores run feeds side by side instead (``run_feeds``)."""
    model = _serialized(model)   # once for both tries
    if (len(model) if isinstance(model, bytes) else Path(model).stat().st_size) < JUDGED_FOLDING_BYTES:
        try:
            return session(model, threads=1, float_only=True)
        except Exception:   # the unoptimized session says what is wrong, if anything is
            pass
    return session(model, optimize=False, threads=1)


def _serialized(model):
    """``model`` as onnxruntime loads it: a path as it is, anything else as bytes (model_bytes)."""
    return model if isinstance(model, (str, Path)) else model_bytes(model)


def run_feeds(sess, names: list[str], feeds: list[dict]) -> list[list]:
    """``sess``'s outputs ``names`` on each of ``feeds``, in order; feeds run side by side on the
    CPUs free (executors.threads), as one onnxruntime session may run on several threads at once."""
    return list(in_order(feeds, lambda feed: sess.run(names, feed)))


def max_nodes_option(default: int, why: str = ""):
    """The ``max_nodes`` option of a pass that runs the model again (``rerun_skip_reason``)."""
    return field(default=default, metadata={
        "help": "do nothing for graphs with more nodes than this" + (f" ({why})" if why else "")})


def max_weight_mb_option(default: float, why: str = "", *, than_this: bool = True):
    """The ``max_weight_mb`` option of a pass that runs the model again (``rerun_skip_reason``)."""
    return field(default=default, metadata={
        "help": "do nothing for models with more weight data" + (" than this" if than_this else "")
                + (f" ({why})" if why else "")})


def rerun_skip_reason(model: QModel, data, max_nodes: int, max_weight_mb: float) -> str | None:
    """Why a pass that runs the model again in onnxruntime on the calibration data should stand
    aside (too many nodes or weights for another session, or no data), else None."""
    if len(model.graph.nodes) > max_nodes:
        return f"{len(model.graph.nodes)} nodes is over max_nodes={max_nodes}"
    weight_mb = constant_bytes(model.graph) / 2**20
    if weight_mb > max_weight_mb:
        return f"{weight_mb:.3g} MB of weights is over max_weight_mb={max_weight_mb:g}"
    if data is None:
        return "no calibration data in this run"
    return None


def _segmented(model) -> bool:
    """A QModel too big for one plain session: more than CHUNK_NODES nodes (session creation grows
    faster than linearly) or IN_MEMORY_BYTES of weights (serialising them peaks at several copies)."""
    return isinstance(model, QModel) and (len(model.graph.nodes) > segments.CHUNK_NODES
                                          or constant_bytes(model.graph) >= segments.IN_MEMORY_BYTES)


def check_same_signature(ref_inputs: list[str], ref_outputs: list[str], test_sess) -> None:
    """Both models need the same required inputs and the test model every reference output."""
    _check_signature(ref_inputs, ref_outputs, *io_names(test_sess))


def io_names(sess) -> tuple[list[str], list[str]]:
    """A session's input and output names."""
    return [a.name for a in sess.get_inputs()], [a.name for a in sess.get_outputs()]


def _check_signature(ref_inputs: list[str], ref_outputs: list[str], inputs: list[str], outputs: list[str]) -> None:
    test_in = sorted(inputs)
    missing_out = sorted(set(ref_outputs) - set(outputs))
    if ref_inputs != test_in:
        raise ModelError(f"the models have different inputs (reference: {', '.join(ref_inputs)}; "
                         f"compared: {', '.join(test_in)})")
    if missing_out:
        raise ModelError(f"the compared model lacks the reference output(s) {', '.join(missing_out)}")


def session_inputs(sess) -> list:
    """The session's inputs as calibration InputSpecs (overridable initializers are optional): what
    data is checked against before running a model (compare, report, compare --per-layer). A dimension
    onnxruntime leaves free (symbolic, or -1 in the model) takes any size."""
    def spec(arg, optional):
        elem = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(_ORT_TYPES[arg.type])) if arg.type in _ORT_TYPES else None
        shape = (tuple(d if isinstance(d, (int, str)) else None for d in arg.shape)
                 if arg.shape else None)  # onnxruntime shows an unknown rank as []: check no shape
        return InputSpec(arg.name, elem, shape, optional)

    return ([spec(a, False) for a in sess.get_inputs()]
            + [spec(a, True) for a in sess.get_overridable_initializers()])


def checked_feeds(model, data, max_samples: int | None = None) -> list[dict]:
    """The first ``max_samples`` feeds of ``data`` (any data source) checked and normalised against
    the inputs of onnxruntime's session of ``model`` (a session, or what ``session`` opens)."""
    from ..calibration.data import open_data

    sess = model if hasattr(model, "get_inputs") else session(model)
    return list(open_data(data).validated(session_inputs(sess), max_samples or 0))


_ORT_TYPES = {f"tensor({name})": value for name, value in (
    ("float", onnx.TensorProto.FLOAT), ("float16", onnx.TensorProto.FLOAT16), ("double", onnx.TensorProto.DOUBLE),
    ("int8", onnx.TensorProto.INT8), ("uint8", onnx.TensorProto.UINT8), ("int16", onnx.TensorProto.INT16),
    ("uint16", onnx.TensorProto.UINT16), ("int32", onnx.TensorProto.INT32), ("uint32", onnx.TensorProto.UINT32),
    ("int64", onnx.TensorProto.INT64), ("uint64", onnx.TensorProto.UINT64), ("bool", onnx.TensorProto.BOOL))}


def snr_from_sums(signal, error):
    """10*log10(signal / error) in dB from the sums of squares of the reference and of the error:
    inf where the error is 0 (identical), -inf where only the signal is. Scalars give a float;
    arrays are taken element-wise."""
    if np.ndim(signal) == 0 and np.ndim(error) == 0:
        if error == 0:
            return math.inf
        return -math.inf if signal == 0 else 10.0 * math.log10(signal / error)
    with np.errstate(divide="ignore", invalid="ignore"):
        snr = 10 * np.log10(signal / error)
    return np.where(error == 0, np.inf, np.where(signal == 0, -np.inf, snr))


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """10*log10(sum(ref^2) / sum((ref-test)^2)); inf when identical."""
    ref = np.asarray(reference, dtype=np.float64)
    err = float(np.sum((ref - np.asarray(test, dtype=np.float64)) ** 2))
    return snr_from_sums(float(np.sum(ref**2)), err)


# the fewest feeds a score is judged on when its outputs hold enough values (a pooled SNR over
# fewer scatters); small outputs take more (select-by-snr, search-precision: ``output_values``)
MIN_FEEDS = 8


class Reference:
    """The reference model's outputs on some feeds, kept to score test models against them."""

    def __init__(self, names: list[str], inputs: list[str], feeds: list[dict], outputs: list[list]):
        """``outputs[i]``: the values of the outputs ``names`` on ``feeds[i]``; ``inputs``: the required inputs."""
        self.names, self.inputs, self.feeds = list(names), sorted(inputs), list(feeds)
        self.outputs = {n: np.concatenate([np.ravel(o[i]).astype(np.float64) for o in outputs])
                        if outputs else np.zeros(0) for i, n in enumerate(self.names)}
        # per output, where each feed's values start and end in self.outputs, their shapes and dtype
        self.bounds = [np.cumsum([0] + [np.size(o[i]) for o in outputs]) for i in range(len(self.names))]
        self.shapes = [[np.shape(o[i]) for o in outputs] for i in range(len(self.names))]
        self.dtypes = [np.asarray(outputs[0][i]).dtype if outputs else np.dtype(np.float64)
                       for i in range(len(self.names))]
        self.parts: list = [None] * len(self.names)   # per output, its components (None: the whole output)
        self._signal_cache: np.ndarray | None = None

    @classmethod
    def from_kept(cls, kept, model: QModel, max_samples: int, enough_values: int = 0,
                  min_samples: int = 1) -> "Reference | None":
        """The feeds calibrate kept with the float outputs on them (KeptSamples), as many as ``run``
        would take: the reference it gives on them, without a second float run. None when calibrate
        kept fewer than ``min_samples`` for lack of room, or when ``model``'s float values changed since (corrected
        biases, rounded weights): ``run`` reads those, as a run resumed from the saved model would."""
        if not _kept_usable(kept, model):
            return None
        per_feed = sum(np.size(v) for v in kept.outputs[0])
        count = min(max_samples, max(min_samples, -(-enough_values // max(per_feed, 1))))
        if len(kept.feeds) < min(count, min_samples) and kept.full:
            return None
        return cls._kept(kept, 0, count)

    @classmethod
    def _kept(cls, kept, start: int, stop: int) -> "Reference":
        """The reference on calibrate's kept feeds ``start:stop`` (KeptSamples)."""
        return cls(kept.names, list(kept.feeds[0]), kept.feeds[start:stop], kept.outputs[start:stop])

    @classmethod
    def for_check(cls, model: QModel, data, kept, max_samples: int, enough_values: int) -> tuple["Reference", bool]:
        """The float outputs a search checks quantized copies against, and whether its feeds were held
        out: the feeds calibrate held out of its ranges (``model.decisions["calibration"]
        ["held_out_from"]`` on), else the first ones, taken from ``kept`` (KeptSamples) when it holds
        them; as many as ``run`` takes with ``min_samples`` MIN_FEEDS."""
        from ..calibration.data import open_data
        from ..calibration.sessions import unrunnable
        start = model.decisions.get("calibration", {}).get("held_out_from")
        reference = None if start else cls.from_kept(kept, model, max_samples, enough_values, MIN_FEEDS)
        if reference is not None:   # calibrate ran the float model on these feeds: no second run
            return reference, False
        data = open_data(data)
        feeds = itertools.islice(data, start, None) if start else iter(data)
        try:
            reference = cls.run(model, feeds, max_samples, enough_values=enough_values, min_samples=MIN_FEEDS)
        except (CalibrationDataError, ModelError):
            raise
        except Exception as exc:   # onnxruntime refused the float model (calibrate may not have run it)
            raise ModelError(f"onnxruntime cannot run the model: {unrunnable(model, exc)}") from None
        if not reference.feeds:
            raise CalibrationDataError("no feed to score on")
        return reference, bool(start)

    @classmethod
    def for_rest(cls, model: QModel, data, kept, after: int, held_out: bool, max_samples: int) -> "Reference | None":
        """The float outputs on at most ``max_samples`` calibration feeds after the first ``after`` (of
        the held-out ones, with ``held_out``): the ones calibrate kept first (no second float run),
        then read again. None when there are none."""
        from ..calibration.data import open_data
        start = (model.decisions.get("calibration", {}).get("held_out_from") or 0) if held_out else 0
        skip, found = start + after, None
        if not held_out and _kept_usable(kept, model):
            if 0 < max_samples and skip < len(kept.feeds):
                found = cls._kept(kept, skip, skip + max_samples)
            if not (kept.full or len(kept.feeds) >= kept.limit):   # it holds every feed there is
                return found
            skip = max(skip, len(kept.feeds))
        missing = max_samples - (len(found.feeds) if found else 0)
        rest = itertools.islice(open_data(data), skip, None) if missing > 0 else iter(())
        first = next(rest, None)
        if first is None:
            return found
        more = cls.run(model, itertools.chain([first], rest), missing)
        return found.plus(more) if found else more

    def pick(self, indices) -> "Reference":
        """The same reference on the feeds ``indices`` only."""
        runs = self.runs(native=True)
        return Reference(self.names, self.inputs, [self.feeds[i] for i in indices], [runs[i] for i in indices])

    def plus(self, other: "Reference") -> "Reference":
        """This reference and ``other``'s feeds after its own."""
        return Reference(self.names, self.inputs, self.feeds + other.feeds, self.runs(native=True) + other.runs(native=True))

    @classmethod
    def run(cls, reference_model, feeds, max_samples: int | None = None, enough_values: int = 0,
            min_samples: int = 1) -> "Reference":
        """Run the reference model on ``feeds`` (at most ``max_samples``; stop after ``min_samples``
        once the outputs hold ``enough_values`` values). A QModel with more than CHUNK_NODES nodes
        or IN_MEMORY_BYTES of weights runs through the segmented executor (a chain of sessions,
        weights handed over as arrays: no serialised copy, and no 2 GB limit). Another model runs
        on one onnxruntime thread, feeds side by side (``run_feeds``): its outputs do not depend on
        the number of cores. An onnxruntime session is run as it is."""
        if is_session(reference_model):
            ref_sess = reference_model
            names = [o.name for o in ref_sess.get_outputs()]
            specs = session_inputs(ref_sess)
            inputs = [i.name for i in ref_sess.get_inputs()]
        elif _segmented(reference_model):
            ref_sess = segments.SegmentedSession(reference_model, refused="onnxruntime cannot run the reference model")
            names, specs = ref_sess.output_names, ref_sess.specs
            inputs = [s.name for s in specs if not s.optional]
        else:
            if isinstance(reference_model, QModel):
                reference_model = reference_model.to_proto(metadata=False)
            ref_sess = session(reference_model, threads=1)   # feeds side by side, as judged runs
            names = [o.name for o in ref_sess.get_outputs()]
            specs = session_inputs(ref_sess)
            inputs = [i.name for i in ref_sess.get_inputs()]
        side_by_side = not isinstance(ref_sess, segments.SegmentedSession)
        source, rest = getattr(feeds, "source", ""), iter(feeds)
        kept, outs = [], []
        while max_samples is None or len(kept) < max_samples:
            room = thread_count() if side_by_side else 1
            if max_samples is not None:
                room = min(room, max_samples - len(kept))
            batch = [validate(feed, specs, len(kept) + i, source)   # cast/reshape like calibration
                     for i, feed in enumerate(itertools.islice(rest, room))]
            if not batch:
                break
            for feed, out in zip(batch, run_feeds(ref_sess, names, batch)):
                kept.append(feed)
                outs.append(out)
                if enough_values and len(outs) >= min_samples and len(outs) * sum(map(np.size, outs[0])) >= enough_values:
                    return cls(names, inputs, kept, outs)
        return cls(names, inputs, kept, outs)

    def score(self, test_model, *, judged: bool = False, objective=None, per_output: bool = True,
              reuse: ScoredRuns | None = None) -> dict:
        """Run ``test_model`` on the kept feeds: per output SNR and max abs error, and the worst SNR.

        With an ``objective`` (qpasses.evaluation.objective.Objective, its components bound to the reference
        model), also ``components`` (the SNR of every output component) and ``objective`` (its
        summary: metric, overall, per-component scores) and ``standard_error`` (the overall score's,
        jackknife over the feeds; a user metric's only with ``per_output=False``); ``per_output=False``:
        only these (no ``outputs``, ``snr_db`` or ``components``: what a search's check reads).
        ``judged``, ``reuse``: see ``runs_of``."""
        runs = self.runs_of(test_model, judged=judged, reuse=reuse)
        _check_output_shapes(self, runs)
        scored = {}
        if objective is not None:
            summary, error = objective.summary_and_error(self.runs(native=not objective.builtin), runs, self.names,
                                                         error=objective.builtin or not per_output)
            scored = {"objective": summary, "standard_error": error}
            if not per_output:
                return {"samples": len(self.feeds)} | scored
        out = {}
        for i, n in enumerate(self.names):
            if not runs:
                continue
            r = self.outputs[n]
            t = np.concatenate([np.ravel(run[i]).astype(np.float64) for run in runs])
            out[n] = {"snr_db": snr_db(r, t), "max_abs_error": float(np.max(np.abs(r - t))) if r.size else 0.0}
        result = {"samples": len(self.feeds), "outputs": out,
                  "snr_db": min((v["snr_db"] for v in out.values()), default=math.inf)}
        if objective is not None:
            result |= scored
            result["components"] = (dict(result["objective"]["components"]) if objective.metric == "snr" else
                                    objective.with_metric("snr").scores_from_runs(self.runs(), runs, self.names))
        return result

    def runs_of(self, test_model, *, judged: bool = False, reuse: ScoredRuns | None = None) -> list[list]:
        """``test_model``'s outputs ``names`` on every kept feed: in ``judging_session`` when
        ``judged`` (taken from ``reuse`` on the first feeds when it holds this very model's judged
        outputs on them), else as this CPU runs it (in ``test_model`` itself when it is an onnxruntime
        session)."""
        runs = []
        if reuse is not None and judged:
            data = test_model if isinstance(test_model, bytes) else None
            runs = (reuse.runs_for(data, self) if data is not None else None) or []
            if runs:   # the checks below, on what the session it ran in said
                _check_signature(self.inputs, self.names, *reuse.io)
                _check_finite(self)
            if len(runs) == len(self.feeds):
                return runs
        test_sess = (test_model if is_session(test_model) else
                     judging_session(test_model) if judged else session(test_model))
        check_same_signature(self.inputs, self.names, test_sess)
        _check_comparable(self, test_sess)   # inputs it takes, finite reference outputs
        rest = self.feeds[len(runs):]
        return runs + (run_feeds(test_sess, self.names, rest) if judged else [test_sess.run(self.names, f) for f in rest])

    def runs(self, *, native: bool = False) -> list[list[np.ndarray]]:
        """The reference outputs per feed, in the order of ``names``, shaped as the model returned
        them: float64 views, or (``native``) copies in the model's dtypes."""
        return [[(self._feed_output(k, i).astype(self.dtypes[k]) if native else self._feed_output(k, i))
                 .reshape(self.shapes[k][i]) for k in range(len(self.names))] for i in range(len(self.feeds))]

    def _feed_output(self, k: int, i: int) -> np.ndarray:
        """Output ``k``'s reference values on feed ``i``."""
        bounds = self.bounds[k]
        return self.outputs[self.names[k]][bounds[i]:bounds[i + 1]]

    def split(self, objective) -> "Reference":
        """Contenders are scored per output component (``objective``'s, checked on these feeds'
        shapes), so no piece of an output (scores beside boxes) hides behind a larger one."""
        parts = objective.components_for(self.names, self.runs())
        self.parts = [parts[n] if len(parts[n]) > 1 else None for n in self.names]
        self._signal_cache = None
        return self

    def sums(self, i: int, values=None) -> list[float]:
        """Feed ``i``'s sums of squares per column (an output, or each of its components): of the
        reference values, or (``values``: the test model's outputs) of their errors. numpy, not
        BLAS: its threads would compete with onnxruntime's."""
        row = []
        for k, parts in enumerate(self.parts):
            ref = self._feed_output(k, i)
            square = np.square(ref if values is None else ref - np.ravel(values[k]).astype(np.float64))
            if parts is None:
                row.append(float(np.sum(square)))
            else:
                square = square.reshape(self.shapes[k][i])
                row.extend(float(np.sum(part.take(square))) for part in parts)
        return row

    def signal(self) -> np.ndarray:
        """Per feed and column (``sums``), the sum of squares of the reference values."""
        if self._signal_cache is None:
            columns = sum(1 if p is None else len(p) for p in self.parts)
            self._signal_cache = np.array([self.sums(i) for i in range(len(self.feeds))]).reshape(len(self.feeds), columns)
        return self._signal_cache


def _kept_usable(kept, model: QModel) -> bool:
    """Whether calibrate's kept float outputs still hold for ``model``: not once its float values
    changed (corrected biases, rounded weights)."""
    changed = model.decisions.get("bias_correction", {}).get("applied") or "weight_rounding" in model.decisions
    return kept is not None and not changed and bool(kept.feeds)


def compare(reference_model, test_model, feeds, max_samples: int | None = None, *, objective=None,
            reference: Reference | None = None, judged: bool = False) -> dict:
    """Run both models on every feed; per output: SNR over all samples and max abs error. With an
    ``objective`` (qpasses.evaluation.objective.Objective; its output components are taken from
    ``reference_model`` unless it has them), also per-component SNR and the objective (see
    Reference.score). ``reference``: the reference model's outputs on the feeds, already known
    (``feeds`` and ``max_samples`` are then not read); ``test_model`` may be an open session.
    ``judged``: ``test_model`` runs in judging_session (the same on every CPU), else as this CPU runs it."""
    if objective is not None and objective.components is None:
        objective = objective.for_model(reference_model)
    if reference is None:
        reference = Reference.run(reference_model, feeds, max_samples)
    return reference.score(test_model, objective=objective, judged=judged)


def is_session(model) -> bool:
    """Whether ``model`` is an open onnxruntime session (rather than a model to open one for)."""
    return callable(getattr(model, "run", None)) and callable(getattr(model, "get_outputs", None))


# passes whose output model computes what their input computed (in float, up to rounding): float
# outputs measured after them are the input model's (KeptSamples as the CLI's SNR reference)
FLOAT_EXACT_PASSES = frozenset({"fold-constants", "fold-batchnorm", "cleanup", "smooth-quant", "annotate-types",
                                "propagate-mixed-precision", "equalize-cross-layer"})


def eval_reference(model, data, max_samples: int, kept=None) -> Reference:
    """The float ``model``'s outputs on the first ``max_samples`` feeds of ``data``: those of them
    calibrate kept (``kept``, KeptSamples of this very data on a model computing what ``model``
    computes: see FLOAT_EXACT_PASSES), then the rest run here (no session when none is left)."""
    from ..calibration.data import open_data

    if kept is None or not kept.feeds:
        return Reference.run(model, open_data(data), max_samples)
    found = Reference._kept(kept, 0, max_samples)
    missing = max_samples - len(found.feeds)
    rest = itertools.islice(open_data(data), len(found.feeds), max_samples) if missing > 0 else iter(())
    first = next(rest, None)
    return found if first is None else found.plus(Reference.run(model, itertools.chain([first], rest), missing))


def _check_comparable(reference: Reference, test_sess) -> None:
    """The test model takes the reference model's feeds (ranks, shapes, types) and the reference
    outputs are finite (else no SNR can be measured): one-line ModelErrors naming the tensor."""
    for spec in session_inputs(test_sess):
        value = reference.feeds[0].get(spec.name) if reference.feeds else None
        if value is None:
            continue
        shape, want = np.shape(value), spec.shape
        fits = want is None or (len(shape) == len(want) and all(not isinstance(d, int) or d == s
                                                                for s, d in zip(shape, want)))
        if not fits or (spec.dtype is not None and np.asarray(value).dtype != spec.dtype):
            wanted = "?" if want is None else "(" + ", ".join(str(d) if isinstance(d, int) else "?" for d in want) + ")"
            raise ModelError(f"the compared model does not take the reference model's inputs (input "
                             f"'{spec.name}': {np.asarray(value).dtype}{tuple(shape)} given, it expects "
                             f"{spec.dtype}{wanted})")
    _check_finite(reference)


def _check_finite(reference: Reference) -> None:
    for name, values in reference.outputs.items():
        if values.size and not np.isfinite(values).all():
            what = "NaN" if np.isnan(values).any() else "Inf"
            raise ModelError(f"the float model's output '{name}' holds {what} on these feeds, so no SNR can be "
                             f"measured (weights or data that overflow float32?)")


def _check_output_shapes(reference: Reference, runs: list) -> None:
    for k, name in enumerate(reference.names):
        for i, run in enumerate(runs):
            if np.shape(run[k]) != tuple(reference.shapes[k][i]):
                raise ModelError(f"output '{name}' has shape {tuple(np.shape(run[k]))} in the compared model "
                                 f"but {tuple(reference.shapes[k][i])} in the reference model (sample {i})")
