"""Accuracy benchmark for issue 15: task metrics of quantized models against their float model,
onnxruntime, NNCF and qpasses side by side in one run.

Models: the 4 shared-corpus models (scored with /work/shared/corpus/task_metrics.py) and the 5
models of tools/accuracy_models.py (BERT-style embedder, byte classifier with decomposed
LayerNorm/GELU, YOLOv8-style detector, CRNN OCR with LSTM, VAD with its compute in If bodies).

Tools (each quantization in its own spawned child process; only the quantize call and the save
are timed, imports and data loading are not):

* ``ort``: onnxruntime ``quantize_static``, QDQ, QUInt8 activations / QInt8 weights, per-channel,
  MinMax: the usual configuration users start with (no pre-processing);
* ``nncf``: ``nncf.quantize(onnx_model, nncf.Dataset(feeds), subset_size=N)`` with its defaults;
* ``nncf_tf``: the same with ``model_type=nncf.ModelType.TRANSFORMER`` (only on the transformer
  models: bert_encoder and ppocr_v4_rec, whose SVTR neck has attention);
* ``qpasses``: ``qpasses.quantize(path, feeds)`` (the default pipeline), saved with ``qpasses.save``;
* extra qpasses runs: ``--qp-config name=cfg.json`` (a config) and ``--qp-passes name='pipeline'``
  (both with one name: that config with that pipeline).

Measured on the held-out eval samples for every produced model: the model's task metric against
the float model's outputs, output SNR (dB, the minimum over outputs of
10*log10(sum ref^2 / sum (ref - q)^2) over all eval samples), the share of weighted ops (Conv,
ConvTranspose, Gemm, MatMul with a constant weight, in subgraphs too) whose input and weight are
both read through an 8-bit DequantizeLinear, and the quantization wall time. Every produced model is
checked with onnx.checker (full) and loaded in onnxruntime; failures are listed, not fatal.

    python tools/bench_accuracy.py                              # all 9 models (~25 min on 2 cores)
    python tools/bench_accuracy.py --quick --models bert_encoder,ppocr_v2_cls
    python tools/bench_accuracy.py --qp-passes weighted='...' --qp-config u16=u16.json --json out.json
    python tools/bench_accuracy.py --qpasses-rev HEAD           # measure a commit, not the work tree
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import accuracy_models as acc  # noqa: E402  (tools/accuracy_models.py)
from models import FeedReader, run_spawned  # noqa: E402  (tools/models.py)

SHARED_CORPUS_CODE = REPO.parent / "shared" / "corpus"
DEFAULT_CORPUS = Path(os.path.expanduser("~/.cache/qp-corpus"))
DEFAULT_OUT = Path(os.path.expanduser("~/.cache/qp-bench/acc-out"))
CORPUS_MODELS = ("ppocr_v4_det", "ppocr_v4_rec", "ppocr_v2_cls", "ddddocr_det")
ALL_MODELS = CORPUS_MODELS + acc.MODELS
EXTRA_MODELS = ("encoder_block",)   # tools/models.py, no task metric (output SNR); only when named
TRANSFORMERS = ("bert_encoder", "ppocr_v4_rec")
QUICK_CALIB, QUICK_EVAL = 8, 8
WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


# ================================================================================ weighted ops
def weighted_op_share(model) -> tuple[int, int]:
    """(weighted ops, of which 8-bit): Conv/ConvTranspose/Gemm/MatMul whose weight is constant (an
    initializer or Constant, possibly through DequantizeLinear/QuantizeLinear/Transpose/Reshape/
    Cast/Identity), in the main graph and every subgraph; 8-bit when both the data input and the
    weight are produced directly by a DequantizeLinear whose input is int8/uint8."""
    import onnx

    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model))
    eight = {onnx.TensorProto.INT8, onnx.TensorProto.UINT8}
    through = {"DequantizeLinear", "QuantizeLinear", "Transpose", "Reshape", "Cast", "Identity", "Unsqueeze",
               "Squeeze"}
    counts = [0, 0]

    def walk(graph, outer_consts: dict, outer_prod: dict):
        consts = dict(outer_consts)     # name -> elem type
        for t in graph.initializer:
            consts[t.name] = t.data_type
        prod = dict(outer_prod)
        for n in graph.node:
            for o in n.output:
                prod[o] = n
            if n.op_type == "Constant":
                for a in n.attribute:
                    if a.name == "value":
                        consts[n.output[0]] = a.t.data_type

        def const(name, depth=0):
            if name in consts:
                return True
            p = prod.get(name)
            if p is None or p.op_type not in through or depth > 8:
                return False
            return const(p.input[0], depth + 1)

        def elem_type(name):
            if name in consts:
                return consts[name]
            p = prod.get(name)
            if p is not None and p.op_type == "QuantizeLinear":
                for a in p.attribute:
                    if a.name == "output_dtype" and a.i:
                        return a.i
                if len(p.input) > 2 and p.input[2]:
                    return elem_type(p.input[2])
                return onnx.TensorProto.UINT8
            return None

        def dq8(name):
            p = prod.get(name)
            return p is not None and p.op_type == "DequantizeLinear" and elem_type(p.input[0]) in eight

        for n in graph.node:
            if n.op_type in WEIGHTED_OPS and len(n.input) > 1:
                data, weight = n.input[0], n.input[1]
                if not const(weight) and n.op_type == "MatMul" and const(data):
                    data, weight = weight, data
                if const(weight) and not const(data):
                    counts[0] += 1
                    counts[1] += dq8(data) and dq8(weight)
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g, consts, prod)
                for g in a.graphs:
                    walk(g, consts, prod)

    walk(model.graph, {}, {})
    return counts[0], counts[1]


# ================================================================================ models
@dataclass
class BenchModel:
    name: str
    path: Path
    calib: Path        # npz, per input (N, *feed_shape)
    eval: Path

    def feeds(self, which: str, limit: int | None = None) -> list[dict]:
        with np.load(self.calib if which == "calib" else self.eval, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        n = min(len(a) for a in arrays.values())
        n = n if limit is None else min(n, limit)
        return [{k: np.ascontiguousarray(a[i]) for k, a in arrays.items()} for i in range(n)]

    def metric(self, outs_f, outs_q) -> tuple[str, float]:
        if self.name in CORPUS_MODELS:
            sys.path.insert(0, str(SHARED_CORPUS_CODE))
            from task_metrics import task_metric  # /work/shared/corpus/task_metrics.py

            return task_metric(self.name, outs_f, outs_q, model_path=str(self.path))
        if self.name in EXTRA_MODELS:
            return "output SNR dB", output_snr(outs_f, outs_q)
        return acc.task_metric(self.name, outs_f, outs_q)


def bench_model(name: str, corpus: Path, cache: Path) -> BenchModel:
    if name in CORPUS_MODELS:
        path = corpus / "models" / f"{name}.onnx"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: corpus absent (bash ../shared/corpus/make_corpus.sh {corpus})")
        return BenchModel(name, path, corpus / "calib" / f"{name}.npz", corpus / "eval" / f"{name}.npz")
    folder = _prepare_extra(name, cache) if name in EXTRA_MODELS else acc.prepare(name, cache)
    return BenchModel(name, folder / "model.onnx", folder / "calib.npz", folder / "eval.npz")


def _prepare_extra(name: str, cache: Path) -> Path:
    """encoder_block of tools/models.py (one post-LN encoder layer) with 64 calibration and 16 eval
    samples, written once into ``cache/encoder_block/`` in the corpus npz layout."""
    import onnx
    from models import encoder_block, encoder_data

    folder = cache / name
    if not (folder / "eval.npz").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        onnx.save(encoder_block(), str(folder / "model.onnx"))
        np.savez(folder / "calib.npz", **encoder_data(64, 1))
        np.savez(folder / "eval.npz", **encoder_data(16, 2))
    return folder


# ================================================================================ tools / children
@dataclass(frozen=True)
class Tool:
    name: str
    kind: str                       # ort | nncf | qp
    model_type: str | None = None   # nncf: TRANSFORMER
    config: str | None = None       # qp: path of a JSON config
    passes: str | None = None       # qp: pipeline text

    def applies(self, model: str) -> bool:
        return self.model_type != "TRANSFORMER" or model in TRANSFORMERS




def calibration_draw(feeds: list, draw: int, draws: int) -> list:
    """Draw ``draw`` of ``draws``: every calibration feed but the ``draw``-th of ``draws`` equal blocks
    (all of them when ``draws`` is 1), so repeated quantizations see overlapping, different data."""
    if draws <= 1:
        return feeds
    size = math.ceil(len(feeds) / draws)
    return feeds[:draw * size] + feeds[(draw + 1) * size:]


def _child(tool: Tool, bm: BenchModel, n_calib: int | None, out_path: str, log_path: str, qp_src,
           draw: tuple[int, int], conn):
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    result: dict = {"tool": tool.name}
    try:
        feeds = calibration_draw(bm.feeds("calib", n_calib), *draw)
        result["calib_samples"] = len(feeds)
        if tool.kind == "ort":
            from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

            for per_channel in (True, False):   # per tensor where the per-channel output does not load
                start = time.perf_counter()
                quantize_static(str(bm.path), out_path, FeedReader(feeds), quant_format=QuantFormat.QDQ,
                                per_channel=per_channel, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                                calibrate_method=CalibrationMethod.MinMax)
                result["seconds"] = time.perf_counter() - start
                result["per_channel"] = per_channel
                try:
                    _session(out_path)
                    break
                except Exception as exc:
                    result["per_channel_error"] = _one_line(exc)
        elif tool.kind == "nncf":
            import nncf
            import onnx

            model = onnx.load(str(bm.path))
            kwargs = {"subset_size": len(feeds)}
            if tool.model_type:
                kwargs["model_type"] = getattr(nncf.ModelType, tool.model_type)
            start = time.perf_counter()
            q = nncf.quantize(model, nncf.Dataset(feeds), **kwargs)
            onnx.save(q, out_path)
            result["seconds"] = time.perf_counter() - start
        else:
            if qp_src:
                sys.path.insert(0, qp_src)
            from models import import_qpasses, imported_since

            qpasses, modules = import_qpasses()   # imports are not timed, as the others' are not
            result["qpasses_file"] = qpasses.__file__
            config = json.loads(Path(tool.config).read_text()) if tool.config else None
            start = time.perf_counter()
            model = qpasses.quantize(str(bm.path), feeds, config=config, passes=tool.passes)
            qpasses.save(model, out_path)
            result["seconds"] = time.perf_counter() - start
            result["imported_in_timed_run"] = imported_since(modules)
        result["ok"] = True
    except BaseException as exc:  # the parent reports it and goes on
        result["ok"] = False
        result["error"] = _one_line(exc)
        traceback.print_exc()
    conn.send(result)
    conn.close()


def run_child(tool: Tool, bm: BenchModel, n_calib, out_path: Path, timeout: float, qp_src,
              draw: tuple[int, int] = (0, 1)) -> dict:
    log_path = out_path.with_suffix(".log")
    if out_path.exists():
        out_path.unlink()
    result = run_spawned(_child, (tool, bm, n_calib, str(out_path), str(log_path), qp_src, draw), timeout,
                         log_path, {"tool": tool.name})
    result["path"] = str(out_path) if result.get("ok") else None
    result["log"] = str(log_path)
    return result


# ================================================================================ measurements
def _one_line(exc) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300]


def integer_weighted_kernels(path) -> int | None:
    """How many weighted ops onnxruntime (CPU, default optimization) runs as integer kernels, read off
    its optimized graph (qpasses.evaluation.integer_kernels: the same count the run's summary line gives)."""
    import onnx

    from qpasses.evaluation.integer_kernels import integer_kernels

    return integer_kernels(onnx.load(str(path)))


def _session(path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def snr_db(ref, test) -> float:
    ref, test = np.asarray(ref, np.float64), np.asarray(test, np.float64)
    err, sig = float(np.sum((ref - test) ** 2)), float(np.sum(ref ** 2))
    if not math.isfinite(err):
        return float("nan")
    if err == 0.0:
        return math.inf
    return 10.0 * math.log10(sig / err) if sig > 0 else -math.inf


def output_snr(outs_f, outs_q) -> float:
    """Minimum over float outputs of the SNR over all eval samples concatenated."""
    vals = []
    for i in range(len(outs_f[0])):
        if not np.issubdtype(np.asarray(outs_f[0][i]).dtype, np.floating):
            continue
        vals.append(snr_db(np.concatenate([np.ravel(o[i]) for o in outs_f]),
                           np.concatenate([np.ravel(o[i]) for o in outs_q])))
    return min(vals) if vals else float("nan")


def repeat_quantizations(drawn: dict[str, list[dict]], tools: list, bm, n_calib, out_dir: Path, args, qp_src) -> None:
    """``--time-repeats``: each tool quantizes the model (its first draw's data) again, the tools
    interleaved run by run; its ``seconds`` become the median of all its runs (``seconds_runs``)."""
    for _ in range(args.time_repeats - 1):
        for tool in tools:
            again = run_child(tool, bm, n_calib, out_dir / f"{tool.name}.again.onnx", args.timeout, qp_src,
                              (0, args.draws))
            first = drawn[tool.name][0]
            first.setdefault("seconds_runs", [first.get("seconds")]).append(again.get("seconds"))
    for draws in drawn.values():
        runs = [s for s in draws[0].get("seconds_runs", ()) if isinstance(s, float)]
        if runs:
            draws[0]["seconds"] = statistics.median(runs)


def time_row(draws_by_tool: dict[str, list[dict]], feed: dict, runs: int) -> None:
    """Each produced model's latency (``latency_ms``, in place): the median of ``runs`` single-thread
    runs of ``feed``, the runs of every model of the row interleaved (bench_vs_ort.latencies), so
    that load from other processes falls on every tool alike."""
    from bench_vs_ort import latencies   # tools/bench_vs_ort.py

    timed = [d for draws in draws_by_tool.values() for d in draws
             if d.get("ok") and not d.get("ort_load") and not d.get("run_error")]
    for d, ms in zip(timed, latencies([Path(d["path"]) for d in timed], feed, runs)):
        d["latency_ms"] = ms


def model_mb(path) -> float:
    """The model file's size in MB (with its external data files, if any)."""
    import onnx

    path = Path(path)
    size = path.stat().st_size
    model = onnx.load(str(path), load_external_data=False)
    files = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    return (size + sum((path.parent / f).stat().st_size for f in files)) / 1e6


def worst_component_snr(model_path, outs_f, outs_q) -> tuple[float | None, float | None]:
    """The worst output component's SNR, as qpasses' objective scores it (an output built by Concat
    along a non-batch axis piece by piece: boxes beside scores), and how far one jackknife standard
    error over the eval samples takes it down, in dB (taken on the error-to-signal ratio, as
    search-precision's margin is); (None, None) if it cannot score them."""
    import onnx
    from qpasses.evaluation.objective import Objective

    try:
        model = onnx.load(str(model_path), load_external_data=False)
        names = [o.name for o in model.graph.output]
        objective = Objective("snr", model=model)
        summary, error = objective.summary_and_error(outs_f, outs_q, names)
        score = summary["overall"]
        return score, score - objective.lower_bound(score, error, 1.0)
    except Exception:
        return None, None


def jackknife_se(metric, outs_f, outs_q) -> float:
    """The jackknife standard error of ``metric(outs_f, outs_q)`` over the eval samples: how far the
    task metric of this eval set is from the same model's on another set of that size."""
    from qpasses.evaluation.objective import jackknife

    return jackknife([metric(outs_f[:i] + outs_f[i + 1:], outs_q[:i] + outs_q[i + 1:]) for i in range(len(outs_f))])


def measure(result: dict, bm: BenchModel, feeds: list[dict], outs_f) -> None:
    """Checks, size, weighted-op share, task metric and SNR of a produced model (in place)."""
    import onnx

    if not result.get("ok"):
        return
    path = Path(result["path"])
    result["checker"] = result["ort_load"] = None
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:
        result["checker"] = _one_line(exc)
    result["size_mb"] = model_mb(path)
    try:
        result["weighted_ops"], result["weighted_8bit"] = weighted_op_share(path)
    except Exception as exc:
        result["share_error"] = _one_line(exc)
    try:
        sess = _session(path)
    except Exception as exc:
        result["ort_load"] = _one_line(exc)
        return
    try:
        result["integer_kernels"] = integer_weighted_kernels(path)
    except Exception as exc:
        result["share_error"] = _one_line(exc)
    try:
        outs_q = [sess.run(None, f) for f in feeds]
        result["metric_name"], result["task"] = bm.metric(outs_f, outs_q)
        result["snr"] = output_snr(outs_f, outs_q)
        result["snr_worst"], result["snr_worst_se"] = worst_component_snr(bm.path, outs_f, outs_q)
        result["task_se"] = jackknife_se(lambda f, q: bm.metric(f, q)[1], outs_f, outs_q)
    except Exception as exc:
        result["run_error"] = _one_line(exc)


def chance_level(name: str, bm: BenchModel, outs_f) -> float:
    """What a useless model scores, so that a degenerate metric shows: for decisions (top-1, speech
    decision) the share of the most frequent float decision (a constant answer); otherwise the
    metric of unrelated outputs (eval sample i scored against the float output of sample i+1)."""
    if name in ("ppocr_v2_cls", "byte_classifier"):
        decisions = [int(np.asarray(o[0]).argmax(-1).ravel()[0]) for o in outs_f]
    elif name == "vad_if":
        decisions = [int(float(np.ravel(o[0])[0]) > 0.5) for o in outs_f]
    else:
        return bm.metric(outs_f, outs_f[1:] + outs_f[:1])[1]
    return float(np.bincount(decisions).max() / len(decisions))


def describe_model(bm: BenchModel) -> dict:
    import onnx

    m = onnx.load(str(bm.path))
    nodes = 0

    def walk(g):
        nonlocal nodes
        for n in g.node:
            nodes += 1
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)

    walk(m.graph)
    shape = lambda v: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]  # noqa: E731
    return {"nodes": nodes, "weighted_ops": weighted_op_share(m)[0],
            "opset": max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=None),
            "outputs": {o.name: shape(o) for o in m.graph.output}}


# ================================================================================ reporting
def _fmt(v, digits=3):
    if v is None:
        return "—"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        if math.isnan(v):
            return "nan"
        return f"{v:.{digits}f}"
    return str(v)


def status(r: dict) -> str | None:
    """None if the model was produced, passes the checker, loads and ran; else a short reason."""
    if not r.get("ok"):
        return f"quantization failed: {r.get('error')}"
    problems = [f"{what}: {r[key]}" for key, what in (("checker", "onnx.checker"), ("ort_load", "onnxruntime load"),
                                                       ("run_error", "run")) if r.get(key)]
    return "; ".join(problems) or None


def cell(r: dict | None, key: str, digits=3) -> str:
    if r is None:
        return "—"
    if key == "task" and status(r) and "task" not in r:
        return "fail"
    if key in ("task", "snr", "snr_worst", "latency_ms") and len(r.get("draws", ())) > 1:   # the mean and the range over the draws
        values = [d[key] for d in r["draws"] if isinstance(d.get(key), float)]
        if values:
            return f"{_fmt(sum(values) / len(values), digits)} ({_fmt(min(values), digits)}-{_fmt(max(values), digits)})"
    if key == "share":
        if "weighted_ops" not in r:
            return "fail" if not r.get("ok") else "—"
        shares = sorted({d["weighted_8bit"] for d in r.get("draws", ()) if "weighted_8bit" in d})
        low = f"{shares[0]}-" if len(shares) > 1 else ""
        return f"{low}{shares[-1] if shares else r['weighted_8bit']}/{r['weighted_ops']}"
    return _fmt(r.get(key), digits)


def mean_over_draws(r: dict | None, key: str) -> float | None:
    values = [d[key] for d in (r.get("draws") or [r]) if isinstance(d.get(key), float)] if r else []
    return sum(values) / len(values) if values else None


def versus(r: dict | None, ort: dict | None, key: str, digits: int) -> str:
    """'12.345 (1.07x)': the mean over the draws and its ratio to onnxruntime's QDQ model's."""
    mine, theirs = mean_over_draws(r, key), mean_over_draws(ort, key)
    if mine is None:
        return "—"
    return f"{mine:.{digits}f}" + (f" ({mine / theirs:.2f}x)" if theirs and r is not ort else "")


def task_cell(r: dict | None) -> str:
    """The task metric with its eval-set standard error: '0.969 ± 0.031'."""
    se = mean_over_draws(r, "task_se")
    return cell(r, "task") + (f" ± {_fmt(se)}" if se is not None else "")


def spread_cell(r: dict | None) -> str:
    """The eval set's own noise: the jackknife standard errors of the task metric and of the worst
    component's dB (one standard error down), averaged over the draws."""
    if r is None:
        return "—"
    draws = r.get("draws") or [r]

    def mean(key):
        values = [d[key] for d in draws if isinstance(d.get(key), float) and math.isfinite(d[key])]
        return sum(values) / len(values) if values else None

    return f"{_fmt(mean('task_se'))} / {_fmt(mean('snr_worst_se'), 2)}"


def tables(rows: list[dict], tools: list[Tool]) -> str:
    names = [t.name for t in tools]
    out = ["| model | metric | chance | " + " | ".join(f"{n} (± eval-set SE)" for n in names) + " |",
           "|---|---|---|" + "---|" * len(names)]
    for row in rows:
        res = row["results"]
        out.append(f"| {row['model']} | {row['metric']} | {_fmt(row.get('chance'))} | "
                   + " | ".join(task_cell(res.get(n)) for n in names) + " |")
    timed = any("latency_ms" in r for row in rows for r in row["results"].values())
    out += ["", "| model | tool | task | SNR dB | worst component SNR dB | eval-set SE (task / dB) | 8-bit weighted ops | "
            "run as integer kernels | quantize s | " + ("latency ms (x ort) | " if timed else "") + "size MB (x ort) | status |",
            "|---|---|---|---|---|---|---|---|---|---|" + "---|" * (1 + timed)]
    for row in rows:
        res = row["results"]
        for n in names:
            r = res.get(n)
            if r is None:
                continue
            st = status(r)
            out.append(f"| {row['model']} | {n} | {cell(r, 'task')} | {cell(r, 'snr', 2)} | {cell(r, 'snr_worst', 2)} | "
                       f"{spread_cell(r)} | {cell(r, 'share')} | "
                       f"{cell(r, 'integer_kernels')} | {cell(r, 'seconds', 1)} | "
                       + (f"{versus(r, res.get('ort'), 'latency_ms', 3)} | " if timed else "")
                       + f"{versus(r, res.get('ort'), 'size_mb', 2)} | {'ok' if st is None else st[:90]} |")
    out += ["", "| model | nodes | weighted ops | opset | outputs |", "|---|---|---|---|---|"]
    for row in rows:
        d = row.get("model_info", {})
        outs = ", ".join(f"{k} {v}" for k, v in d.get("outputs", {}).items())
        out.append(f"| {row['model']} | {d.get('nodes')} | {d.get('weighted_ops')} | {d.get('opset')} | {outs} |")
    pt = [row["model"] for row in rows if row["results"].get("ort", {}).get("per_channel") is False]
    if pt:
        out += ["", f"ort is per tensor on {', '.join(pt)}: its per-channel output does not load in onnxruntime."]
    fails = [(row["model"], n, status(r)) for row in rows for n, r in row["results"].items() if status(r)]
    if fails:
        out += ["", "Failures (not fatal):"]
        out += [f"- {m} / {n}: {s}" for m, n, s in fails]
    return "\n".join(out)


# ================================================================================ main
def _git(*args) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return ""


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def parse_tools(args) -> list[Tool]:
    tools = [Tool("ort", "ort")]
    if not args.no_nncf:
        if _version("nncf"):
            tools += [Tool("nncf", "nncf"), Tool("nncf_tf", "nncf", model_type="TRANSFORMER")]
        else:
            print("nncf is not installed (pip install nncf): its columns are skipped", file=sys.stderr)
    tools.append(Tool("qpasses", "qp"))
    for spec in args.qp_config:
        name, _, path = spec.partition("=")
        if not path or not Path(path).is_file():
            raise SystemExit(f"--qp-config {spec!r}: expected name=path.json of an existing file")
        tools.append(Tool(name, "qp", config=str(Path(path).resolve())))
    for spec in args.qp_passes:   # a name also given to --qp-config: that config with this pipeline
        name, _, text = spec.partition("=")
        if not text:
            raise SystemExit(f"--qp-passes {spec!r}: expected name='pipeline text'")
        same = [k for k, t in enumerate(tools) if t.name == name and t.config and not t.passes]
        if same:
            tools[same[0]] = Tool(name, "qp", config=tools[same[0]].config, passes=text)
        else:
            tools.append(Tool(name, "qp", passes=text))
    if len({t.name for t in tools}) != len(tools):
        raise SystemExit("tool names must be unique")
    if args.tools:
        keep = set(args.tools.split(","))
        extras = {spec.partition("=")[0] for spec in args.qp_config + args.qp_passes} if "extras" in keep else set()
        tools = [t for t in tools if t.name in keep or t.name in extras]
    return tools


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ALL_MODELS),
                    help=f"comma list of {', '.join(ALL_MODELS + EXTRA_MODELS)} (default: all but the last)")
    ap.add_argument("--tools", help="comma list: only these tool columns (ort, nncf, nncf_tf, qpasses, a "
                                    "--qp-config/--qp-passes name, or extras: all of those)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_CALIB} calibration / {QUICK_EVAL} eval samples")
    ap.add_argument("--calib-samples", type=int, help="calibration samples (default: all, 32-64)")
    ap.add_argument("--eval-samples", type=int, help="eval samples (default: all, 32)")
    ap.add_argument("--qp-config", action="append", default=[], metavar="NAME=CFG.json",
                    help="an extra qpasses column with this config (repeatable)")
    ap.add_argument("--qp-passes", action="append", default=[], metavar="NAME='PIPELINE'",
                    help="an extra qpasses column with this pipeline text (repeatable)")
    ap.add_argument("--qpasses-src", help="import qpasses from this directory (default: the installed one)")
    ap.add_argument("--qpasses-rev", help="import qpasses from this git revision (exported to a temp dir)")
    ap.add_argument("--no-nncf", action="store_true")
    ap.add_argument("--eval-dir", type=Path, metavar="DIR",
                    help="eval sets DIR/<model>.npz instead of the models' own (tools/build_eval_sets.py: 128 "
                         "held-out samples each)")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--cache", type=Path, default=acc.DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="quantized models and child logs")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per quantization child")
    ap.add_argument("--draws", type=int, default=1, metavar="K",
                    help="quantize K times, each leaving out one of K blocks of the calibration data: the task "
                         "metric and SNR are shown as mean (min-max) over the draws, the 8-bit share as its range")
    ap.add_argument("--latency", type=int, default=0, metavar="N",
                    help="also time each produced model: median of N runs of the first eval sample (onnxruntime "
                         "CPU, one thread, every model of a row interleaved run by run), mean over the draws, with "
                         "its ratio to onnxruntime's QDQ model (ort)")
    ap.add_argument("--time-repeats", type=int, default=1, metavar="N",
                    help="quantize each model N times, the tools interleaved run by run, and report each "
                         "tool's median seconds (runs of the same quantization vary by 15 %% on this machine)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    n_calib = args.calib_samples or (QUICK_CALIB if args.quick else None)
    n_eval = args.eval_samples or (QUICK_EVAL if args.quick else None)
    tools = parse_tools(args)
    qp_src = args.qpasses_src
    tmp = None
    if args.qpasses_rev:
        tmp = tempfile.TemporaryDirectory(prefix="qp-rev-")
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.qpasses_rev, "qpasses"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp.name], input=archive, check=True)
        qp_src = tmp.name
    dirty = [line.split(maxsplit=1)[-1] for line in _git("status", "--porcelain", "--", "qpasses").splitlines()]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "qpasses_commit": _git("rev-parse", "--short", args.qpasses_rev or "HEAD"),
            "qpasses_source": ("git " + args.qpasses_rev) if args.qpasses_rev else (qp_src or "installed/work tree"),
            "qpasses_dirty_files": [] if (args.qpasses_rev or qp_src) else dirty,
            "versions": {m: _version(m) for m in ("onnxruntime", "onnx", "nncf", "torch", "numpy")},
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "calib_samples": n_calib or "all", "eval_samples": n_eval or "all", "draws": args.draws,
            "eval_dir": str(args.eval_dir) if args.eval_dir else None,
            "tools": [t.__dict__ for t in tools]}
    print(json.dumps(meta), file=sys.stderr)

    rows = []
    started = time.time()
    for name in args.models.split(","):
        row: dict = {"model": name, "results": {}}
        rows.append(row)
        try:
            bm = bench_model(name, args.corpus, args.cache)
        except Exception as exc:
            row["metric"] = "—"
            row["error"] = _one_line(exc)
            print(f"{name}: skipped ({row['error']})", file=sys.stderr)
            continue
        if args.eval_dir:
            larger = args.eval_dir / f"{name}.npz"
            if larger.is_file():
                bm.eval = larger
            else:
                print(f"{name}: no {larger} (python tools/build_eval_sets.py {name}): its own eval set is used",
                      file=sys.stderr)
        row["eval_set"] = str(bm.eval)
        row["model_info"] = describe_model(bm)
        feeds = bm.feeds("eval", n_eval)
        sess = _session(bm.path)
        outs_f = [sess.run(None, f) for f in feeds]
        row["metric"], _ = bm.metric(outs_f, outs_f)
        row["chance"] = chance_level(name, bm, outs_f)
        row["eval_samples"] = len(feeds)
        out_dir = args.out / name
        out_dir.mkdir(parents=True, exist_ok=True)
        drawn: dict[str, list[dict]] = {}
        for tool in tools:
            if not tool.applies(name):
                continue
            draws = drawn[tool.name] = []
            for k in range(max(1, args.draws)):
                suffix = f".draw{k}" if args.draws > 1 else ""
                d = run_child(tool, bm, n_calib, out_dir / f"{tool.name}{suffix}.onnx", args.timeout, qp_src,
                              (k, args.draws))
                measure(d, bm, feeds, outs_f)
                if d.get("imported_in_timed_run"):
                    print(f"{name} {tool.name}: its timed run imported {', '.join(d['imported_in_timed_run'])} "
                          "(tools/models.py LAZY_IMPORTS)", file=sys.stderr)
                draws.append(d)
            print(f"{name:16s} {tool.name:10s} task {cell(draws[0], 'task'):>6s}  snr {cell(draws[0], 'snr', 2):>6s}  "
                  f"8-bit {cell(draws[0], 'share'):>7s}  {cell(draws[0], 'seconds', 1):>6s} s  {status(draws[0]) or 'ok'}",
                  file=sys.stderr, flush=True)
        if args.time_repeats > 1:
            repeat_quantizations(drawn, [t for t in tools if t.name in drawn], bm, n_calib, out_dir, args, qp_src)
        if args.latency:
            time_row(drawn, feeds[0], args.latency)
        for tool_name, draws in drawn.items():
            r = dict(draws[0])
            if args.draws > 1:
                r["draws"] = [{k: d.get(k) for k in ("task", "snr", "snr_worst", "weighted_8bit", "seconds", "calib_samples",
                                                     "latency_ms", "size_mb", "task_se", "snr_worst_se")}
                              for d in draws]
            row["results"][tool_name] = r
    meta["total_seconds"] = round(time.time() - started, 1)
    text = tables(rows, tools)
    print(f"\nqpasses {meta['qpasses_commit']} ({meta['qpasses_source']}"
          + (f"; plus uncommitted changes in {len(meta['qpasses_dirty_files'])} files under qpasses/"
             if meta["qpasses_dirty_files"] else "")
          + f"), {meta['date']}, " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
          + f"; calib samples {meta['calib_samples']}, eval samples {meta['eval_samples']}; "
          f"total {meta['total_seconds']} s\n")
    print(text)
    if args.json:
        for row in rows:
            for r in row["results"].values():
                r.pop("snr_parts", None)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
