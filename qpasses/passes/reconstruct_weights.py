"""reconstruct-weights: each integer weight's codes (and its bias) chosen against the quantized model's
own inputs to the layer, so that the error arriving from earlier layers is corrected too (AdaRound,
AdaQuant)."""
from __future__ import annotations

from dataclasses import field
from typing import ClassVar

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..analysis.scopes import all_nodes
from ..analysis.saturation import pair_grids, within_pairs
from ..analysis.weighted_layers import Target, checked_values, find_targets
from ..calibration.data import model_inputs, open_data
from ..calibration.segments import SegmentedModel
from ..calibration.subgraphs import thread_out
from ..core.pipeline import Pass, PassResult, Pipeline, pipeline_option
from ..core.progress import progress
from ..core.registry import register
from ..errors import CalibrationDataError, ModelError, first_line
from ..evaluation.evaluate import max_nodes_option, max_weight_mb_option, rerun_skip_reason, session
from ..ir.analyses import GRAPH, RANGES
from ..ir.graphutil import proto_subgraphs, subgraphs
from ..ir.model import QModel
from ..quant.oprules import WEIGHTED_OPS
from ..quant.qdq import QParams, quantized_values, require_opset
from ..quant.qparams import dequantize
from ..quant.qtypes import qtype
from ..quant.rounding import Hessian, damped, refine_codes, round_codes, target

NAME = "reconstruct-weights"
DECISION = "weight_reconstruction"
ALGORITHMS = ("adaround", "adaquant")


@register
class ReconstructWeights(Pass):
    """Choose integer weight codes and biases against the quantized model's own inputs (AdaRound, AdaQuant).

    Each layer's output error given the quantized model's inputs to it is a quadratic loss of its weights.

    Reads: the table after compute-qparams (the weights' scales and zero points, the activations'
    grids) and the calibration data. Layers are taken in graph order, ``stages`` at a time: for each
    stage, one run of the float model and one of the QDQ model built from the table by ``then``
    (onnxruntime without graph optimizations: the same on every CPU), with the layers of earlier
    stages already reconstructed, accumulate over ``samples`` feeds, per layer, E[x_q x_q^T] and
    E[x_q x^T] of the quantized and float inputs as the layer reads them (rows of receptive fields,
    sampled). The codes then minimise E||W_q x_q + b_q - (W x + b)||^2: GPTQ towards the weights that
    minimise it unrounded, then single-code moves while the loss falls (``sweeps``).
    ``adaround``: each code is the floor or the ceiling of weight / scale; ``adaquant``: any code of
    the type. With ``fit_bias`` a constant bias takes the mean output error (the moments are then
    centred). Writes: weight values on their grid (insert-qdq stores exactly those codes), biases,
    why-lines, ``model.decisions["weight_reconstruction"]``. With ``check``, the QDQ models with the
    new values and with round-to-nearest are scored on ``check_samples`` calibration feeds after the
    ones used (search-precision's metric) and the values kept unless they score lower by more than
    ``tolerance_db`` plus one standard error of the paired difference (analysis.weighted_layers).
    Invariants: scales and zero points unchanged; codes within the type's range; a second run
    changes nothing.

    ``effort: high`` runs it in place of round-weights; the default does not (docs/decisions/weights.md):
    over 4 calibration draws it moved ppocr_v4_rec (text 0.918 -> 0.949, 128 held-out samples) and
    crnn_lstm (0.964 -> 0.976, 512), and none of the other 7 benchmark models, at 2-14x onnxruntime's
    quantize_static time.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"qparams-computed"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated", "qparams-computed"})
    unchanged: ClassVar[frozenset] = frozenset({GRAPH, RANGES})   # it changes weight and bias values and the table
    example: ClassVar[str] = """
        <ir_version: 10, opset_import: ["" : 17]>
        g (float[1, 3, 5, 5] x) => (float[1, 2, 5, 5] y) <float[2, 3, 1, 1] w = {0.31, -0.52, 0.2, -0.45,
        0.93, -0.41}, float[2] b = {0.5, -0.25}>
        {
            y = Conv (x, w, b)
        }
    """
    example_prelude: ClassVar[str] = "annotate-types,calibrate,compute-qparams"

    algorithm: str = field(default="adaround", metadata={
        "help": "adaround: each code the floor or ceiling of weight / scale; adaquant: any code of the type",
        "choices": ALGORITHMS})
    samples: int = field(default=32, metadata={"help": "calibration feeds the layers' moments are accumulated over"})
    stages: int = field(default=8, metadata={
        "help": "runs of the float and quantized models (layers split evenly in graph order; each stage sees "
                "the earlier stages reconstructed; 0: one per layer)"})
    sweeps: int = field(default=4, metadata={"help": "coordinate-descent sweeps over the codes after GPTQ"})
    fit_bias: bool = field(default=False, metadata={
        "help": "a constant bias takes the mean output error (the moments are centred); off: it cost "
                "ddddocr_det 25.7 -> 8.0 dB and ppocr_v4_rec 14.8 -> 11.9 dB on their eval sets"})
    mix: float = field(default=1.0, metadata={
        "help": "share of the input values taken from the quantized model, the others from the float one "
                "(QDrop: a loss less tied to this model's own errors)"})
    activation_bits: int = field(default=8, metadata={
        "help": "reconstruct only layers whose input is float or quantized to at least this many bits"})
    flops: float = field(default=5e8, metadata={
        "help": "input rows sampled per layer (spread over the feeds): as many as this many multiply-adds "
                "per moment allow, at least twice min_rows per input"})
    min_rows: float = field(default=8.0, metadata={
        "help": "reconstruct a layer only when its sampled input rows are at least this many times its "
                "inputs per channel"})
    damping: float = field(default=0.01, metadata={
        "help": "pull towards the float weights: added to diag(E[x_q x_q^T]), times its mean"})
    check: bool = field(default=True, metadata={
        "help": "keep the values only if the worst output component scores (almost) as high with them as "
                "with round-to-nearest"})
    check_samples: int = field(default=16, metadata={"help": "calibration feeds the check scores, after the ones used"})
    tolerance_db: float = field(default=0.0, metadata={
        "help": "dB of SNR the values may score below round-to-nearest and still be kept (other metrics: none)"})
    then: Pipeline = pipeline_option("fix-bias-scales,insert-qdq,insert-converts",
                                     "the passes that turn the model into the QDQ model whose inputs are read and scored")
    max_hessian_mb: float = field(default=512.0, metadata={
        "help": "moments of the layers of one stage (more: the stage is split); a layer whose own are "
                "larger keeps round-to-nearest"})
    max_stash_mb: float = field(default=1024.0, metadata={
        "help": "values kept per feed between the parts of the models (more: each stage runs the models "
                "again from the feeds; 0: always)"})
    max_nodes: int = max_nodes_option(20000)
    max_weight_mb: float = max_weight_mb_option(1024.0, than_this=False)

    def run(self, model: QModel, ctx) -> PassResult:
        if DECISION in model.decisions:
            return PassResult(model, False, {"reconstructed": 0})
        if not find_targets(model, self.activation_bits, WEIGHTED_OPS, bodies=True):
            return PassResult(model, False, {"reconstructed": 0})
        skip = rerun_skip_reason(model, ctx.calibration_data, self.max_nodes, self.max_weight_mb)
        if skip:
            ctx.findings.set(NAME, {"skipped": skip})
            return PassResult(model, False, {"reconstructed": 0})
        budget = self.max_hessian_mb * 2**20
        reference = model.to_proto(metadata=False)   # the float model, before any weight moves
        work, trial = self._working_copy(model, ctx)
        targets = [t for t in find_targets(work, self.activation_bits, WEIGHTED_OPS, True) if 2 * t.geo.h_bytes <= budget]
        changed, notes, gains, done, few, samples = {}, [], [], 0, 0, 0
        grids = pair_grids(model)
        stages = _merged(list(_stages(targets, self.stages, budget)), _anchors(work))
        bar = progress(ctx, NAME, len(targets))
        try:
            runner = _Stashed.made(self, ctx, model, trial, stages) or _Rerun(self, ctx, reference, work, trial)
            for k, stage in enumerate(stages):
                try:
                    samples = runner.measure(k, stage)
                except _StashFull:   # from here on, every stage runs the models again from the feeds
                    runner = _Rerun(self, ctx, reference, work, None)
                    samples = runner.measure(k, stage)
                for t in stage:
                    if t.hessian.rows < self.min_rows * t.geo.k:
                        few += 1
                    else:
                        done += self._solve(work, t, samples, changed, notes, gains, t.weight.name in grids)
                    t.hessian = None
                runner.advance(k, stage, changed)
                bar.update(done + few)
            runner = None
        except CalibrationDataError as exc:
            bar.close()
            ctx.findings.set(NAME, {"skipped": f"the calibration data cannot be read again ({first_line(exc)})"})
            return PassResult(model, False, {"reconstructed": 0})
        bar.close()
        checked = None
        if self.check and changed:
            try:
                checked = checked_values(model, ctx, changed, self.then, self.check_samples, self.tolerance_db, samples)
            except CalibrationDataError as exc:
                ctx.findings.set(NAME, {"skipped": f"the calibration data cannot be read again ({first_line(exc)})"})
                return PassResult(model, False, {"reconstructed": 0})
            if not checked["kept"]:
                changed, notes, done = {}, [], 0
        tensors = model.tensors()
        for name, values in changed.items():
            tensors[name].values = values
        for name, why in notes:
            model.quant[name].because(why)
        summary = {"algorithm": self.algorithm, "layers": len(targets), "reconstructed": done, "samples": samples,
                   "too_few_rows": few, **({"checked": checked} if checked else {})}
        model.decisions[DECISION] = {"by": NAME} | summary
        # the gain is read off the moments, whose last digits differ between CPUs: not in the written model
        ctx.findings.set(NAME, summary | {"mean_gain_db": round(float(np.mean(gains)), 3) if gains else 0.0})
        return PassResult(model, True, {"reconstructed": done, "samples": samples})

    def _working_copy(self, model: QModel, ctx) -> tuple[QModel, QModel]:
        """A scratch copy of ``model`` whose weights the stages move, at the opset ``then`` raises it
        to (raised once, not in every stage's trial), and the first stage's QDQ trial."""
        fresh = model.copier()   # one export for both
        work, trial = fresh(), fresh()
        self.then.run(trial, ctx)
        if trial.opset > work.opset:
            require_opset(work, trial.opset)
        return work, trial

    def _solve(self, model: QModel, t: Target, samples: int, changed: dict, notes: list, gains: list,
               grid: bool) -> bool:
        """Choose ``t``'s codes (and bias) in ``model`` (the working copy): ``changed`` gets the new
        values by name, ``notes`` the why-lines (tensor name, line), ``gains`` the dB its output error
        fell by on the rows seen; ``grid``: its weight is on protect-pair-sums' pair-safe grid."""
        tq = model.quant[t.weight.name]
        values = np.asarray(t.weight.values)
        rows = t.to_rows(values.astype(np.float64))
        scale, zero = t.per_row(tq.scale, values.shape), t.per_row(tq.zero_point, values.shape)
        qt = qtype(tq.qtype)
        bias = _bias(t)
        centred = self.fit_bias and bias is not None
        h, cross = t.hessian.moments(centred, self.mix)
        goal = target(rows, h, cross, self.damping)
        s, z = scale[..., None], zero[..., None]
        if self.algorithm == "adaround":
            lo = np.clip(np.floor(rows / s) + z, qt.qmin, qt.qmax)
            hi = np.clip(lo + 1, qt.qmin, qt.qmax)
        else:
            lo, hi = qt.qmin, qt.qmax
        codes = round_codes(goal, scale, zero, lo, hi, h, self.damping, dead_to_zero=False)
        codes, _ = refine_codes(codes, goal / s + z, lo, hi, damped(h, self.damping), self.sweeps)
        if grid:   # protect-pair-sums' grid: zero point 0
            codes = within_pairs(t, codes, goal / s, qt)
        rounded = (codes - z) * s
        nearest = (np.clip(np.rint(rows / s) + z, qt.qmin, qt.qmax) - z) * s
        new = t.from_rows(rounded, values.shape).astype(values.dtype)
        shift = None
        if centred:   # the mean output error the codes leave: W mean(x) - W_q mean(x_q)
            shift = (np.einsum("grk,gk->gr", rows, t.hessian.ref_mean())
                     - np.einsum("grk,gk->gr", rounded, t.hessian.mean)).ravel()
        before, after = t.hessian.error_db(rows, nearest), t.hessian.error_db(rows, rounded, shift)
        gains.append(before - after)
        if np.array_equal(new, values) and (shift is None or not np.any(shift)):
            return False
        t.weight.values = changed[t.weight.name] = new
        what = "codes" if self.algorithm == "adaround" else "codes and bias"
        if shift is not None:
            if t.node.op == "Gemm":   # y = alpha A B + beta C
                shift = shift * float(t.node.attrs.get("alpha", 1.0)) / float(t.node.attrs.get("beta", 1.0) or 1.0)
            old = np.asarray(bias.values)
            bias.values = changed[bias.name] = (old.astype(np.float64) + shift.reshape(old.shape)).astype(old.dtype)
            if bias.name in model.quant:
                notes.append((bias.name, f"{NAME}: plus the mean output error of '{t.node.name}' "
                                                      f"on the quantized model's inputs ({samples} calibration samples)"))
            what = "codes and bias"
        notes.append((t.weight.name, f"{NAME}: {self.algorithm} {what} chosen to minimise the output error of '{t.node.name}' "
                          f"given the quantized model's inputs: {before:.1f} -> {after:.1f} dB of its output on "
                          f"{t.hessian.rows} input rows of {samples} calibration samples (round to nearest -> these)"))
        return True


def _bias(t: Target) -> gs.Constant | None:
    """The layer's constant bias (one value per output channel, read by it alone), if any."""
    bias = t.node.inputs[2] if len(t.node.inputs) > 2 and t.node.op != "MatMul" else None
    if not isinstance(bias, gs.Constant) or len(bias.outputs) != 1:
        return None
    rows = t.per_row(0.0, np.shape(t.weight.values)).size
    return bias if np.size(bias.values) == rows else None


def _stages(targets: list[Target], stages: int, budget: float):
    """The targets in graph order cut into ``stages`` runs of about equal length (0: one per layer),
    a run cut again where its moments would pass ``budget`` bytes."""
    per = max(1, -(-len(targets) // stages)) if stages > 0 else 1
    for start in range(0, len(targets), per):
        batch, used = [], 0
        for t in targets[start:start + per]:
            if batch and used + 2 * t.geo.h_bytes > budget:
                yield batch
                batch, used = [], 0
            batch.append(t)
            used += 2 * t.geo.h_bytes
        if batch:
            yield batch


class _StashFull(Exception):
    """The values kept between the parts of the models passed ``max_stash_mb``."""


def _pairs(stage: list[Target], trial: QModel, samples: int, flops: float, least: float) -> list[tuple[Target, str, str]]:
    """(target, its float input, its input in the QDQ model ``trial``) of each layer of a stage, each
    given a fresh Hessian sampling, over ``samples`` feeds, as many input rows as ``flops``
    multiply-adds per moment allow, at least ``least`` times its inputs."""
    by_name = {n.name: n for n in all_nodes(trial)}
    out = []
    for k, t in enumerate(stage):
        most = max(least * t.geo.k, flops // (t.geo.groups * t.geo.k * t.geo.k))
        t.hessian = Hessian(t.geo, seed=k, most=max(1, int(-(-most // samples))))
        node = by_name.get(t.node.name)
        if node is None:
            raise ModelError(f"{NAME}: '{t.node.name}' is gone from the QDQ model")
        out.append((t, t.node.inputs[0].name, node.inputs[0].name))
    return out


def _accumulate(pairs, got_f: dict, got_q: dict, env_f: dict, env_q: dict, feeds: int, min_rows: float) -> None:
    """Add one feed's values (name -> arrays, one per run of a body; else from ``env_*``: the feed or
    values an earlier part passed on) to each layer's moments; a layer whose rows so far, over
    ``feeds`` feeds, cannot reach ``min_rows`` per input is left (too few rows: a waste of time)."""
    for t, f, q in pairs:
        h = t.hessian
        if h.updates and h.rows * feeds < min_rows * t.geo.k * h.updates:
            continue
        fs, qs = got_f.get(f, [env_f.get(f)]), got_q.get(q, [env_q.get(q)])
        for x, x_ref in zip(qs, fs) if len(qs) == len(fs) else ():
            if x is not None and x_ref is not None and np.shape(x) == np.shape(x_ref):
                if t.geo.kind == "dense":   # body values come flat
                    x, x_ref = np.reshape(x, (-1, t.geo.k)), np.reshape(x_ref, (-1, t.geo.k))
                t.hessian.update(x, x_ref)


class _Exposed:
    """The tensors ``names`` made outputs of ``proto`` (edited in place): those of the main graph it
    computes as they are, those of If/Loop/Scan bodies threaded out (calibration.subgraphs), a Conv
    input with its shape beside it (``ranks``: name -> rank) so that each run of its body gives one
    array. ``fetch``: the outputs to ask for; ``values``: decodes what they returned."""

    def __init__(self, proto: onnx.ModelProto, names: list[str], in_body: set[str], ranks: dict[str, int]):
        graph = proto.graph
        body = [n for n in dict.fromkeys(names) if n in in_body]
        dims = {n: _add_shape(graph, n) for n in body if n in ranks}
        threaded = thread_out(proto, body + [d for d in dims.values() if d], reduce=False)
        self.body = {n: (threaded[n][0], threaded[dims[n]][0] if dims.get(n) in threaded else None, ranks.get(n))
                     for n in body if n in threaded}
        made = {o for n in graph.node for o in n.output}
        listed = {o.name for o in graph.output}
        self.top = [n for n in dict.fromkeys(names) if n in made and n not in in_body]
        graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in self.top if n not in listed)
        self.fetch = self.top + [o for v, d, _ in self.body.values() for o in (v, d) if o]

    def values(self, got: dict) -> dict[str, list[np.ndarray]]:
        """name -> the arrays it took (one per run of its body; a main-graph tensor: one)."""
        out = {n: [got[n]] for n in self.top}
        for name, (flat, dims, rank) in self.body.items():
            out[name] = _split(got[flat], got[dims] if dims else None, rank)
        return out


def _layout(pairs) -> tuple[set[str], dict[str, int]]:
    """The layer inputs living in bodies, and the rank of each Conv input."""
    bodies = {n for t, f, q in pairs if t.scope for n in (f, q)}
    ranks = {n: len(np.shape(t.weight.values)) for t, f, q in pairs if t.geo.kind == "conv" for n in (f, q)}
    return bodies, ranks


class _Rerun:
    """Each stage runs the float model and a fresh QDQ model of ``work`` (its weights as moved so far)
    from the feeds, each cut down to what the stage's layers read."""

    def __init__(self, owner, ctx, reference: onnx.ModelProto, work: QModel, trial: QModel | None):
        self.owner, self.ctx, self.reference, self.work, self.trial = owner, ctx, reference, work, trial

    def measure(self, k: int, stage: list[Target]) -> int:
        if self.trial is None:
            self.trial = self.work.copy(share_weights=True)
            self.owner.then.run(self.trial, self.ctx)
        pairs = _pairs(stage, self.trial, self.owner.samples, self.owner.flops, 2 * self.owner.min_rows)
        bodies, ranks = _layout(pairs)
        floats = _Session(self.reference, [f for _, f, _ in pairs], bodies, ranks, optimize=True)
        quants = _Session(self.trial.to_proto(metadata=False), [q for _, _, q in pairs], bodies, ranks, optimize=False)
        self.trial, count = None, 0
        for feed in open_data(self.ctx.calibration_data).validated(model_inputs(self.reference), self.owner.samples):
            _accumulate(pairs, floats.run(feed), quants.run(feed), feed, feed, self.owner.samples, self.owner.min_rows)
            count += 1
        return count

    def advance(self, k: int, stage: list[Target], changed: dict) -> None:
        pass   # the next stage's QDQ model is built from ``work``


class _Session:
    """One session of ``proto`` cut down to what the tensors ``names`` need, returning them (_Exposed)."""

    def __init__(self, proto: onnx.ModelProto, names: list[str], in_body: set[str], ranks: dict[str, int],
                 optimize: bool):
        proto = _copy(proto)
        self.exposed = _Exposed(proto, names, in_body, ranks)
        _prune(proto.graph, self.exposed.fetch)
        self.session = session(proto, optimize=optimize) if self.exposed.fetch else None
        self.inputs = {i.name for i in self.session.get_inputs()} if self.session else set()

    def run(self, feed: dict) -> dict[str, list[np.ndarray]]:
        if self.session is None:
            return {}
        fetch = self.exposed.fetch
        got = dict(zip(fetch, self.session.run(fetch, {k: v for k, v in feed.items() if k in self.inputs})))
        return self.exposed.values(got)


class _Stashed:
    """The float model and one QDQ model, each cut before every stage's first layer
    (calibration.segments) and run part by part over the feeds, the values later parts read kept per
    feed (the stash, at most ``max_stash_mb``): each part runs once on the float side, twice on the
    quantized side (to read the stage's inputs, then with its new weights to pass on), so the
    stages cost about two runs of the QDQ model and one of the float model in all."""

    def __init__(self, owner, ctx, trial: QModel, q_seg, f_seg, q_parts: list[int], f_parts: list[int],
                 feeds: list[dict]):
        self.owner, self.ctx, self.trial = owner, ctx, trial
        self.q_seg, self.f_seg, self.q_parts, self.f_parts = q_seg, f_seg, q_parts, f_parts
        self.env_q, self.env_f = feeds, [dict(f) for f in feeds]
        self.limit = owner.max_stash_mb * 2**20
        for seg, envs, parts in ((q_seg, self.env_q, q_parts), (f_seg, self.env_f, f_parts)):
            if parts[0] > 0:   # the nodes before the first stage
                part = seg.build(0, lambda proto: [])
                for env in envs if part else ():
                    part.run(env)
        self._check()

    @classmethod
    def made(cls, owner, ctx, model: QModel, trial: QModel, stages: list[list[Target]]) -> "_Stashed | None":
        """The staged runner, or None when the models cannot be cut before every stage."""
        if owner.max_stash_mb <= 0:
            return None
        q_seg = SegmentedModel(trial, optimize=False)
        f_seg = SegmentedModel(model, optimize=True)
        parts = []
        for seg, m in ((q_seg, trial), (f_seg, model)):
            at = _anchors(m, constants=True)
            try:
                starts = [min(at[t.node.name][0] for t in stage) for stage in stages]
                end = max(at[t.node.name][1] for t in stages[-1]) + 1
            except KeyError:
                return None
            if len(set(starts)) != len(starts) or starts != sorted(starts) or not seg.cut_at(starts + [end]):
                return None
            parts.append([sorted({0} | set(starts)).index(s) for s in starts])
        feeds = list(open_data(ctx.calibration_data).validated(model_inputs(f_seg.proto or model.to_proto(metadata=False)),
                                                                  owner.samples))
        return cls(owner, ctx, trial, q_seg, f_seg, parts[0], parts[1], feeds)

    def _check(self) -> None:
        held = sum(getattr(v, "nbytes", 0) for envs in (self.env_q, self.env_f) for env in envs for v in env.values())
        if held > self.limit:
            raise _StashFull()

    def measure(self, k: int, stage: list[Target]) -> int:
        pairs = _pairs(stage, self.trial, self.owner.samples, self.owner.flops, 2 * self.owner.min_rows)
        bodies, ranks = _layout(pairs)
        exposed = {}

        def fetching(side, names):
            def extend(proto):
                exposed[side] = _Exposed(proto, names, bodies, ranks)
                return exposed[side].fetch
            return extend

        part_f = self.f_seg.build(self.f_parts[k], fetching("f", [f for _, f, _ in pairs]))
        part_q = self.q_seg.build(self.q_parts[k], fetching("q", [q for _, _, q in pairs]))
        for env_f, env_q in zip(self.env_f, self.env_q):
            before = dict(env_f)   # the run passes the float values on (and drops what it read last)
            got_f = exposed["f"].values(part_f.run(env_f)) if part_f else {}
            got_q = exposed["q"].values(part_q.run(dict(env_q))) if part_q else {}
            _accumulate(pairs, got_f, got_q, before, env_q, len(self.env_q), self.owner.min_rows)
        return len(self.env_q)

    def advance(self, k: int, stage: list[Target], changed: dict) -> None:
        """The stash past this stage's part on the quantized side, with the stage's new values."""
        if k + 1 >= len(self.q_parts):
            return
        moved = {c: _as_stored(self.trial, c, changed[c]) for t in stage for c in _constants(t) if c in changed}

        def patch(proto) -> list[str]:
            nodes = {n.name: n for n in _every_node(proto.graph)}
            for t in stage:
                node = nodes.get(t.node.name)
                for index, name in enumerate(_constants(t), 1):
                    if node is not None and name in moved and index < len(node.input):
                        node.input[index] = f"{name}__qp_moved"
                        proto.graph.initializer.append(onnx.numpy_helper.from_array(moved[name], node.input[index]))
            return []

        part = self.q_seg.build(self.q_parts[k], patch)
        for env in self.env_q if part else ():
            part.run(env)
        self._check()


def _merged(stages: list[list[Target]], anchors: dict[str, int]) -> list[list[Target]]:
    """Consecutive stages whose first layers sit in the same main-graph node (an If's bodies) as one."""
    out: list[list[Target]] = []
    for stage in stages:
        if out and anchors.get(stage[0].node.name) == anchors.get(out[-1][0].node.name):
            out[-1] = out[-1] + stage
        else:
            out.append(stage)
    return out


def _as_stored(trial: QModel, name: str, values: np.ndarray) -> np.ndarray:
    """``values`` as the QDQ model ``trial`` would hold them: on the grid its table gives ``name``."""
    tq = trial.quant.get(name)
    if tq is None or not tq.scale or tq.convert is not None:
        return values
    qp = QParams.make(name, tq.qtype, tq.scale, tq.zero_point, tq.axis, np.ndim(values))
    stored = dequantize(quantized_values(values, qp).astype(np.int64), qp.scale, qp.zero_point, qp.axis)
    return stored.astype(values.dtype)


def _constants(t: Target) -> list[str]:
    """The names of the layer's weight and, if any, bias (inputs 1 and 2)."""
    bias = _bias(t)
    return [t.weight.name] + ([bias.name] if bias is not None else [])


def _anchors(model: QModel, constants: bool = False) -> dict:
    """Node name -> index of the main-graph node that is it or holds it (If/Loop/Scan); with
    ``constants``, name -> (first, that index): first, the earliest node computing its constant inputs
    from constants alone (a weight's DequantizeLinear), so a cut there keeps them in one part."""
    out = {}
    producer = {o.name: i for i, node in enumerate(model.graph.nodes) for o in node.outputs}
    nodes = model.graph.nodes

    def first(i: int) -> int:
        made = [producer.get(x.name) for x in nodes[i].inputs[1:]]
        return min([i] + [j for j in made if j is not None and all(isinstance(x, gs.Constant) for x in nodes[j].inputs)])

    for i, node in enumerate(nodes):
        out[node.name] = (first(i), i) if constants else i
        for inner in _gs_inside(node):
            out[inner.name] = (i, i) if constants else i
    return out


def _gs_inside(node: gs.Node):
    for sub in subgraphs(node):
        for inner in sub.nodes:
            yield inner
            yield from _gs_inside(inner)


def _every_node(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for _, sub in proto_subgraphs(node):
            yield from _every_node(sub)


def _split(flat: np.ndarray, dims: np.ndarray | None, rank: int | None) -> list[np.ndarray]:
    """The arrays a body tensor took, from its threaded values and (for a Conv input) shapes."""
    if dims is None or not rank:
        return [flat] if flat.size else []
    shapes = np.asarray(dims).reshape(-1, rank).astype(np.int64)
    ends = np.cumsum(np.prod(shapes, axis=1))
    if not len(ends) or ends[-1] != flat.size:
        return []
    return [piece.reshape(shape) for piece, shape in zip(np.split(flat, ends[:-1]), shapes)]


def _add_shape(graph: onnx.GraphProto, name: str) -> str | None:
    """Add Cast(Shape(name), float) beside the body node computing ``name``; its output's name."""
    for node in graph.node:
        for _, sub in proto_subgraphs(node):
            if any(name in n.output for n in sub.node):
                shape, dims = f"{name}__qp_shape", f"{name}__qp_dims"
                sub.node.extend([onnx.helper.make_node("Shape", [name], [shape], name=shape),
                                 onnx.helper.make_node("Cast", [shape], [dims], name=dims, to=onnx.TensorProto.FLOAT)])
                return dims
            found = _add_shape(sub, name)
            if found:
                return found
    return None


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    return out


def _prune(graph: onnx.GraphProto, names: list[str]) -> None:
    """Keep only the nodes and initializers (and inputs backed by them) the tensors ``names`` need, and
    them as the outputs."""
    needed, keep = set(names), []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(_reads(node))
    known = {vi.name: vi for vi in list(graph.value_info) + list(graph.output)}
    outputs = [known.get(n) or onnx.helper.make_empty_tensor_value_info(n) for n in names]
    inits = [t for t in graph.initializer if t.name in needed]
    dropped = {t.name for t in graph.initializer} - needed   # an input backed by one would become required
    inputs = [i for i in graph.input if i.name not in dropped]
    del graph.node[:], graph.output[:], graph.initializer[:], graph.input[:]
    graph.node.extend(reversed(keep))
    graph.output.extend(outputs)
    graph.initializer.extend(inits)
    graph.input.extend(inputs)


def _reads(node: onnx.NodeProto) -> list[str]:
    """What a node reads, from its bodies' outer scope too."""
    out = list(node.input)
    for _, g in proto_subgraphs(node):
        for inner in g.node:
            out += _reads(inner)
    return out
