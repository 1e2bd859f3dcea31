"""Benchmark qpasses against onnxruntime.quantization.quantize_static, side by side in one run.

For every model (tools/models.py) and config, the same quantization is run through onnxruntime
(QDQ format, a CalibrationDataReader over the calibration samples) and through qpasses, each in
its own spawned child process that reports wall time and peak RSS. The parent then measures, on
the held-out eval samples: output SNR vs the float model, single-thread CPU latency of both QDQ
models (median, the two models' runs interleaved), Q/DQ node counts, and whether each produced
model passes onnx.checker and loads in onnxruntime. A failure on either side is shown in its cells
and the run goes on.

SNR = 10*log10(sum(ref^2) / sum((ref-q)^2)) per model output over all eval samples concatenated;
a model's SNR is the minimum over its outputs (as qpasses.evaluation.evaluate.compare).

    python tools/bench_vs_ort.py --quick                      # 3 small models, 16 samples
    python tools/bench_vs_ort.py --json bench.json            # default set (~30 min on 2 cores)
    python tools/bench_vs_ort.py --models encoder_block --configs default,u8s8_entropy
    python tools/bench_vs_ort.py --rss-vs-samples             # peak RSS with 16 vs 64 samples
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models as bench_models  # noqa: E402  (tools/models.py)
from procstats import peak_rss_mb  # noqa: E402  (tools/procstats.py)

# -- configs -----------------------------------------------------------------------------------------
# Each config is run identically on both sides. Calibration details that onnxruntime does not let
# quantize_static change (num_bins: 128 for entropy, 2048 for percentile) are given to qpasses too.
# Percentile: onnxruntime's default clips |x| symmetrically; both sides are asked for asymmetric
# percentile ranges here (CalibTensorRangeSymmetric=False / symmetric=False).


WITHOUT = "_without_passes"   # a qpasses config key of this benchmark: passes left out of the default pipeline


@dataclass(frozen=True)
class Config:
    name: str
    label: str
    ort: dict                      # quantize_static arguments (enum names as strings)
    qp: dict | None                # qpasses config dict (None: qpasses defaults)


def _ort(per_channel=False, method="MinMax", **extra):
    return {"activation_type": "QUInt8", "weight_type": "QInt8", "per_channel": per_channel,
            "calibrate_method": method, "extra_options": extra}


def _qp(per_channel=False, **calibration):
    return {"activation_type": "uint8", "weight_type": "int8", "per_channel": per_channel,
            "calibration": calibration}


CONFIGS = {c.name: c for c in (
    Config("u8s8_minmax", "U8S8 minmax per-tensor", _ort(), _qp(method="minmax")),
    Config("u8s8_minmax_pc", "U8S8 minmax per-channel", _ort(per_channel=True), _qp(True, method="minmax")),
    Config("u8s8_percentile", "U8S8 percentile 99.999",
           _ort(method="Percentile", CalibPercentile=99.999, CalibTensorRangeSymmetric=False),
           _qp(method="percentile", percentile=99.999, num_bins=2048, symmetric=False)),
    Config("u8s8_entropy", "U8S8 entropy", _ort(method="Entropy"), _qp(method="entropy", num_bins=128)),
    # qpasses with no config vs onnxruntime's U8/S8 minmax per-tensor (same ORT run as u8s8_minmax)
    Config("default", "qpasses default vs ORT U8S8 minmax", _ort(), None),
    # only with --configs: onnxruntime's weight grid for QInt8 (symmetric) on the qpasses side too,
    # which otherwise lets select-by-snr pick asymmetric per-tensor weights (slower int8 kernels)
    Config("u8s8_minmax_symw", "U8S8 minmax per-tensor, symmetric weights on both sides", _ort(),
           _qp(method="minmax") | {"weight_symmetric": True}),
    # only with --configs: u8s8_minmax without search-precision (accuracy target 0): its cost apart
    Config("u8s8_minmax_nosearch", "U8S8 minmax per-tensor, qpasses without search-precision", _ort(),
           _qp(method="minmax") | {"accuracy": {"target": 0}}),
    # only with --configs: onnxruntime's exact work (its weight grid, no accuracy search) on the qpasses side
    Config("u8s8_minmax_symw_nosearch", "U8S8 minmax per-tensor, symmetric weights, qpasses without search-precision",
           _ort(), _qp(method="minmax") | {"weight_symmetric": True, "accuracy": {"target": 0}}),
    # only with --configs: the same, and without smooth-quant (onnxruntime's SmoothQuant option is off by default)
    Config("u8s8_minmax_exact", "U8S8 minmax per-tensor, symmetric weights, qpasses without search-precision and "
           "smooth-quant", _ort(), _qp(method="minmax") | {"weight_symmetric": True, "accuracy": {"target": 0},
                                                          WITHOUT: ["smooth-quant"]}),
)}
DEFAULT_CONFIGS = ("u8s8_minmax", "u8s8_minmax_pc", "u8s8_percentile", "u8s8_entropy", "default")
MIXED_FRACTION = 0.05   # share of activation tensors promoted to 16 bits in the mixed-precision column
MIXED_TYPE = "uint16"


# -- child processes ---------------------------------------------------------------------------------


def _child(side: str, model_path: str, calib_dir: str, samples: int, cfg, out_path: str, log_path: str, conn):
    """Quantize in this (spawned) process; send back seconds, peak RSS and errors."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    result: dict = {"side": side}
    try:
        data = bench_models.Samples(Path(calib_dir), samples)
        if side == "ort":
            from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

            extra = dict(cfg["extra_options"])
            if "TensorQuantOverrides" in extra:
                extra["TensorQuantOverrides"] = {
                    k: [{**o, "quant_type": getattr(QuantType, o["quant_type"])} if "quant_type" in o else o
                        for o in v] for k, v in extra["TensorQuantOverrides"].items()}
            args = dict(quant_format=QuantFormat.QDQ, per_channel=cfg["per_channel"],
                        activation_type=getattr(QuantType, cfg["activation_type"]),
                        weight_type=getattr(QuantType, cfg["weight_type"]),
                        calibrate_method=getattr(CalibrationMethod, cfg["calibrate_method"]),
                        extra_options=extra)
            result["rss_base_mb"] = peak_rss_mb()
            start = time.perf_counter()
            quantize_static(model_path, out_path, bench_models.FeedReader(data), **args)
            result["seconds"] = time.perf_counter() - start
        else:
            from qpasses.core.pipeline import QUANTIZE_PIPELINE

            qpasses, modules = bench_models.import_qpasses()   # imports are excluded, like onnxruntime's
            without = set((cfg or {}).get(WITHOUT, ()))
            cfg = {k: v for k, v in cfg.items() if k != WITHOUT} if cfg else cfg
            passes = ",".join(p for p in QUANTIZE_PIPELINE.split(",") if p not in without) if without else None
            result["rss_base_mb"] = peak_rss_mb()
            start = time.perf_counter()
            model, records = qpasses.run_pipeline(model_path, passes, config=cfg, calibration_data=data)
            qpasses.save(model, out_path)
            result["seconds"] = time.perf_counter() - start
            result["imported_in_timed_run"] = bench_models.imported_since(modules)
            result["passes"] = [[r.text, round(r.seconds, 3), r.modified] for r in records]
        result["ok"] = True
    except BaseException as exc:  # report anything, the parent goes on
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        traceback.print_exc()
    result["rss_mb"] = peak_rss_mb()
    conn.send(result)
    conn.close()


def run_child(side, bm, samples, cfg, out_path: Path, timeout: float) -> dict:
    log_path = out_path.with_suffix(".log")
    result = bench_models.run_spawned(_child, (side, str(bm.path), str(bm.calib_dir), samples, cfg, str(out_path),
                                               str(log_path)), timeout, log_path, {"side": side})
    result["path"] = str(out_path) if result.get("ok") else None
    return result


# -- measurements in the parent ----------------------------------------------------------------------
def _session(path, single_thread: bool):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if single_thread:
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def validate(path: Path) -> dict:
    """onnx.checker (full check) and an onnxruntime load; returns error lines (None = ok)."""
    import onnx

    out = {"checker": None, "ort_load": None}
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:
        out["checker"] = _one_line(exc)
    try:
        _session(path, single_thread=False)
    except Exception as exc:
        out["ort_load"] = _one_line(exc)
    return out


def _one_line(exc) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:240]


def qdq_counts(path: Path) -> tuple[int, int]:
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    ops = [n.op_type for n in m.graph.node]
    return ops.count("QuantizeLinear"), ops.count("DequantizeLinear")


def float_pass_seconds(bm, samples: int) -> float:
    """Seconds to run the float model once over the calibration samples (2 threads, session made
    beforehand): the floor of any calibration that runs every sample, as both sides do."""
    sess = _session(bm.path, single_thread=False)
    feeds = list(bm.samples("calib", samples))
    sess.run(None, feeds[0])
    start = time.perf_counter()
    for feed in feeds:
        sess.run(None, feed)
    return time.perf_counter() - start


def float_outputs(bm) -> tuple[list[str], list[list[np.ndarray]]]:
    sess = _session(bm.path, single_thread=False)
    names = [o.name for o in sess.get_outputs()]
    return names, [sess.run(names, feed) for feed in bm.samples("eval")]


def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    ref, test = np.asarray(ref, np.float64), np.asarray(test, np.float64)
    err, sig = float(np.sum((ref - test) ** 2)), float(np.sum(ref**2))
    if not math.isfinite(err):
        return float("nan")
    if err == 0.0:
        return math.inf
    return 10.0 * math.log10(sig / err) if sig > 0 else -math.inf


def model_snr(path: Path, bm, refs) -> tuple[float, dict]:
    """(SNR: the lowest over outputs, over all eval samples; per eval sample and output, the sums
    of ref^2 and of (ref - test)^2, from which ``delta_spread`` tells how much the SNR owes to
    which samples were drawn)."""
    names, ref_runs = refs
    sess = _session(path, single_thread=False)
    runs = [sess.run(names, feed) for feed in bm.samples("eval")]
    per_output = [snr_db(np.concatenate([r[i].ravel() for r in ref_runs]),
                         np.concatenate([q[i].ravel() for q in runs])) for i in range(len(names))]
    parts = {"signal": [[float(np.sum(np.square(np.asarray(r[i], np.float64)))) for i in range(len(names))]
                        for r in ref_runs],
             "error": [[float(np.sum(np.square(np.asarray(r[i], np.float64) - np.asarray(q[i], np.float64))))
                        for i in range(len(names))] for r, q in zip(ref_runs, runs)]}
    return min(per_output), parts


def delta_spread(qp_parts: dict, ort_parts: dict) -> float | None:
    """Jackknife standard error, over the eval samples, of SNR(qpasses) - SNR(onnxruntime) (paired:
    the same samples on both sides). None with fewer than 3 samples or non-finite SNRs."""
    sig = np.asarray(qp_parts["signal"], np.float64)
    errs = [np.asarray(p["error"], np.float64) for p in (qp_parts, ort_parts)]
    n = len(sig)
    if n < 3 or any(e.shape != sig.shape for e in errs):
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        loo = [np.min(10 * np.log10((sig.sum(0) - sig) / (e.sum(0) - e)), axis=1) for e in errs]
    diff = loo[0] - loo[1]
    if not np.all(np.isfinite(diff)):
        return None
    return float(np.sqrt((n - 1) / n * np.sum((diff - diff.mean()) ** 2)))


def latencies(paths: list[Path], feed: dict, runs: int) -> list[float]:
    """Median single-thread latency (ms) of each model; runs are interleaved so that load from
    other processes hits every model alike."""
    sessions = [_session(p, single_thread=True) for p in paths]
    for s in sessions:
        for _ in range(2):
            s.run(None, feed)
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(runs):
        for s, t in zip(sessions, times):
            start = time.perf_counter()
            s.run(None, feed)
            t.append(1000.0 * (time.perf_counter() - start))
    return [statistics.median(t) for t in times]


# -- mixed precision ---------------------------------------------------------------------------------
def sensitive_activations(bm, qdq_path: Path, fraction: float = MIXED_FRACTION, samples: int = 4,
                          method: str = "local") -> list[str]:
    """The ``fraction`` of quantized activation tensors with the lowest SNR vs float, worst first.

    Linear cost, a few calibration samples. ``local``: one float run exposing every quantized
    activation; each is fake-quantized with its scale/zero point from the 8-bit QDQ model, so the
    score is the tensor's own rounding/clipping error. ``accumulated``: the QDQ model's dequantized
    value of each activation vs float, i.e. including the error of everything upstream."""
    import onnx
    from onnx import numpy_helper

    qm = onnx.load(str(qdq_path))
    fm = onnx.load(str(bm.path))
    inits = {t.name: t for t in qm.graph.initializer}
    float_tensors = ({o for n in fm.graph.node if n.op_type != "Constant" for o in n.output}
                     | {i.name for i in fm.graph.input}) - {t.name for t in fm.graph.initializer}
    dq_of = {n.input[0]: n.output[0] for n in qm.graph.node if n.op_type == "DequantizeLinear"}
    params = {}  # activation -> (scale, zero point, qmin, qmax, dequantized tensor in the QDQ model)
    for node in qm.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] not in float_tensors or node.input[0] in params:
            continue
        if len(node.input) < 3 or node.input[1] not in inits or node.input[2] not in inits:
            continue
        scale = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64)
        zp = numpy_helper.to_array(inits[node.input[2]])
        if scale.size == 1 and node.output[0] in dq_of:
            info = np.iinfo(zp.dtype)
            params[node.input[0]] = (float(scale.reshape(-1)[0]), int(zp.reshape(-1)[0]), info.min, info.max,
                                     dq_of[node.output[0]])
    if not params:
        return []
    names = sorted(params)
    feeds = list(bm.samples("calib", samples))
    ref = _intermediates(fm, names, feeds)
    if method == "accumulated":
        test = _intermediates(qm, [params[n][4] for n in names], feeds, optimize=False)
    else:
        test = {}
        for n in names:
            s, zp, lo, hi, _ = params[n]
            test[params[n][4]] = [(np.clip(np.round(v / s) + zp, lo, hi) - zp) * s for v in ref[n]]
    score = {n: snr_db(np.concatenate([v.ravel() for v in ref[n]]),
                       np.concatenate([v.ravel() for v in test[params[n][4]]])) for n in names}
    ranked = sorted(names, key=lambda n: (score[n] if not math.isnan(score[n]) else -math.inf, n))
    return ranked[: max(1, math.ceil(fraction * len(ranked)))]


def _intermediates(model, names: list[str], feeds: list[dict], optimize: bool = True) -> dict:
    """Values of the given tensors (as float64 arrays, per feed) from one onnxruntime session."""
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for n in names:
        if n not in existing:
            probe.graph.output.add().name = n
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not optimize:  # keep Q/DQ pairs as they are (no QDQ fusion)
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in sess.get_inputs()}
    out: dict = {n: [] for n in names}
    for feed in feeds:
        for n, v in zip(names, sess.run(names, {k: v for k, v in feed.items() if k in inputs})):
            out[n].append(np.asarray(v, np.float64))
    return out


# -- one model ---------------------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    config: str
    samples: int
    ort: dict = field(default_factory=dict)
    qp: dict = field(default_factory=dict)
    mixed: dict = field(default_factory=dict)
    float_s: float | None = None   # one float inference pass over the calibration samples


def _measure(result: dict, bm, refs) -> None:
    """Fill checks, Q/DQ counts and SNR into a child result (in place)."""
    if not result.get("ok"):
        return
    path = Path(result["path"])
    result.update(validate(path))
    result["q"], result["dq"] = qdq_counts(path)
    if result["ort_load"] is None:
        try:
            result["snr"], result["snr_parts"] = model_snr(path, bm, refs)
        except Exception as exc:
            result["run_error"] = _one_line(exc)


def _model_sig(bm) -> str:
    st = bm.path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _load_cached(out_path: Path, samples: int, sig: str, cfg):
    meta = out_path.with_suffix(".json")
    if out_path.is_file() and meta.is_file():
        data = json.loads(meta.read_text())
        if data.get("ok") and (data.get("samples"), data.get("model_sig"), data.get("cfg")) == (samples, sig, cfg):
            data["reused"] = True
            return data
    return None


def _side(side, bm, samples, cfg, out_path: Path, args) -> dict:
    sig = _model_sig(bm)
    if side == "ort" and args.reuse_ort:
        cached = _load_cached(out_path, samples, sig, cfg)
        if cached:
            return cached
    runs = [run_child(side, bm, samples, cfg, out_path, args.timeout) for _ in range(max(1, args.repeats))]
    ok = [r for r in runs if r.get("ok")]   # the fastest of --repeats runs (the same output every time)
    result = min(ok, key=lambda r: r["seconds"]) if ok else runs[-1]
    if len(runs) > 1:
        result["all_seconds"] = [round(r["seconds"], 3) for r in ok]
    result.update(samples=samples, model_sig=sig, cfg=cfg)
    if side == "ort":
        out_path.with_suffix(".json").write_text(json.dumps(result, indent=1))
    return result


def bench_model(bm, configs: list[Config], args, log) -> list[Row]:
    refs = float_outputs(bm)
    n_calib = len(bm.samples("calib", args.samples))
    out_dir = args.out / bm.name
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, ort_by_args = [], {}
    first_eval = bm.samples("eval")[0]
    floor = min(float_pass_seconds(bm, args.samples) for _ in range(max(1, args.repeats)))
    for cfg in configs:
        row = Row(bm.name, cfg.name, n_calib, float_s=floor)
        key = json.dumps(cfg.ort, sort_keys=True)
        if key in ort_by_args:
            previous = ort_by_args[key]  # same onnxruntime run; latency is measured again beside qpasses
            row.ort = {k: v for k, v in previous.items() if k != "lat_ms"} | {"reused_from": previous["config"]}
        elif "ort" in args.sides:
            row.ort = _side("ort", bm, n_calib, cfg.ort, out_dir / f"{cfg.name}.ort.onnx", args)
            row.ort["config"] = cfg.name
            _measure(row.ort, bm, refs)
            ort_by_args[key] = row.ort
        if "qp" in args.sides:
            row.qp = _side("qp", bm, n_calib, cfg.qp, out_dir / f"{cfg.name}.qp.onnx", args)
            _measure(row.qp, bm, refs)
        _latency(row, first_eval, args.latency_runs)
        if cfg.name == "default" and bm.real and args.mixed:
            row.mixed = _mixed(bm, row, n_calib, out_dir, refs, args)
        log(format_row(row))
        rows.append(row)
    return rows


def _latency(row: Row, feed: dict, runs: int) -> None:
    sides = [r for r in (row.ort, row.qp) if r.get("snr") is not None and "lat_ms" not in r]
    if not sides or runs <= 0:
        return
    try:
        for r, ms in zip(sides, latencies([Path(r["path"]) for r in sides], feed, runs)):
            r["lat_ms"] = ms
    except Exception as exc:
        for r in sides:
            r["lat_error"] = _one_line(exc)


def _mixed(bm, row: Row, n_calib, out_dir: Path, refs, args) -> dict:
    """Promote the most error-sensitive activations to 16 bits on both sides; SNR of the result."""
    source = row.qp if row.qp.get("snr") is not None else row.ort
    if source.get("snr") is None:
        return {"error": "no 8-bit model to rank activations"}
    try:
        promoted = sensitive_activations(bm, Path(source["path"]), method=args.mp_rank)
    except Exception as exc:
        return {"error": f"ranking: {_one_line(exc)}"}
    out = {"ranked_on": "qp" if source is row.qp else "ort", "rank_method": args.mp_rank, "promoted": promoted}
    if "qp" in args.sides:
        cfg = {"mixed_precision": {t: MIXED_TYPE for t in promoted}}
        out["qp"] = _side("qp", bm, n_calib, cfg, out_dir / "mixed.qp.onnx", args)
        _measure(out["qp"], bm, refs)
    if "ort" in args.sides:
        overrides = {t: [{"quant_type": "QUInt16"}] for t in promoted}
        out["ort"] = _side("ort", bm, n_calib, _ort(TensorQuantOverrides=overrides), out_dir / "mixed.ort.onnx", args)
        _measure(out["ort"], bm, refs)
    return out


# -- report ------------------------------------------------------------------------------------------
COLUMNS = ["model", "config", "t_ort s", "t_qp s", "t ratio", "rss_ort MB", "rss_qp MB", "rss ratio",
           "snr_ort", "snr_qp", "delta", "lat_ort ms", "lat_qp ms", "lat ratio", "Q/DQ ort", "Q/DQ qp",
           "snr_mp_qp", "snr_mp_ort"]


def _f(v, digits=1):
    if v is None:
        return "—"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return f"{v:.{digits}f}"


def _ratio(a, b):
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def _delta(qp, ort):
    if qp is None or ort is None:
        return None
    if math.isinf(qp) and math.isinf(ort) and (qp > 0) == (ort > 0):
        return 0.0
    return qp - ort


def _status(r: dict) -> str | None:
    """Short failure text for a side, or None when it produced a working model."""
    if not r:
        return "not run"
    if not r.get("ok"):
        return "ERR " + r.get("error", "?")
    if r.get("ort_load"):
        return "no ORT load: " + r["ort_load"]
    if r.get("run_error"):
        return "run failed: " + r["run_error"]
    return None


def cells(row: Row) -> list[str]:
    o, q = ({k: v for k, v in r.items() if r.get("ok") or k not in ("seconds", "rss_mb")}
            for r in (row.ort, row.qp))
    qdq = lambda r: f"{r['q']}/{r['dq']}" if "q" in r else "—"  # noqa: E731
    mixed = lambda r: _f(r.get("snr")) if r and r.get("snr") is not None else ("—" if not r else "ERR")  # noqa: E731
    return [row.model, row.config,
            _f(o.get("seconds"), 2), _f(q.get("seconds"), 2), _f(_ratio(q.get("seconds"), o.get("seconds")), 2),
            _f(o.get("rss_mb"), 0), _f(q.get("rss_mb"), 0), _f(_ratio(q.get("rss_mb"), o.get("rss_mb")), 2),
            _f(o.get("snr"), 2), _f(q.get("snr"), 2), _f(_delta(q.get("snr"), o.get("snr")), 2),
            _f(o.get("lat_ms"), 2), _f(q.get("lat_ms"), 2), _f(_ratio(q.get("lat_ms"), o.get("lat_ms")), 2),
            qdq(o), qdq(q), mixed(row.mixed.get("qp")), mixed(row.mixed.get("ort"))]


def format_row(row: Row) -> str:
    return "| " + " | ".join(cells(row)) + " |"


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += [format_row(r) for r in rows]
    notes = []
    for r in rows:
        for side, d in (("ort", r.ort), ("qp", r.qp), ("mixed qp", r.mixed.get("qp")),
                        ("mixed ort", r.mixed.get("ort"))):
            if d is None or (side.startswith("mixed") and not d):
                continue
            s = _status(d)
            if s and s != "not run":
                notes.append(f"- {r.model} / {r.config} / {side}: {s}")
            elif d.get("checker"):
                notes.append(f"- {r.model} / {r.config} / {side}: onnx.checker: {d['checker']}")
        if r.mixed.get("error"):
            notes.append(f"- {r.model} / mixed precision: {r.mixed['error']}")
    if notes:
        lines += ["", "Failures and checker findings:", *notes]
    return "\n".join(lines)


def _spread(row: Row) -> str:
    """', 2 SE x.xx' for a cell whose eval samples allow it (see delta_spread)."""
    if "snr_parts" not in row.qp or "snr_parts" not in row.ort:
        return ""
    se = delta_spread(row.qp["snr_parts"], row.ort["snr_parts"])
    return f", 2 SE {2 * se:.2f}" if se is not None else ""


def summary(rows: list[Row], samples: int) -> str:
    out = ["", "Targets:"]
    compared = [(r, r.qp.get("snr"), r.ort.get("snr")) for r in rows if r.ort.get("snr") is not None]
    ok = [r for r, q, o in compared if q is not None and (math.isnan(o) or _delta(q, o) >= -0.1)]
    bad = [f"{r.model}/{r.config} ({_f(_delta(q, o), 2)}{_spread(r)})" for r, q, o in compared
           if q is not None and r not in ok]
    missing = sum(q is None for _, q, _ in compared)
    out.append(f"- SNR >= ORT - 0.1 dB: {len(ok)}/{len(compared)} model-configs"
               + (f"; short: {', '.join(bad)}" if bad else "")
               + (f"; {missing} without a working qpasses model" if missing else ""))
    gains = [_delta(r.qp["snr"], r.ort["snr"]) for r in rows if r.config == "default"
             and r.qp.get("snr") is not None and r.ort.get("snr") is not None]
    gains = [g for g in gains if math.isfinite(g)]
    out.append(f"- qpasses default vs ORT default, median SNR gain: "
               f"{_f(statistics.median(gains), 2) + ' dB' if gains else '—'} over {len(gains)} models (target >= 3 dB)")
    for label, key, target in (("wall time", "seconds", 0.5), ("peak RSS", "rss_mb", None), ("QDQ latency", "lat_ms", 1.05)):
        ratios = [_ratio(r.qp.get(key), r.ort.get(key)) for r in rows if r.qp.get("ok") and r.ort.get("ok")]
        ratios = [x for x in ratios if x is not None]
        if ratios:
            tgt = f" (target <= {target}" + (f", measured with {samples} samples)" if key == "seconds" else ")") \
                if target else ""
            out.append(f"- {label} ratio qp/ort: median {statistics.median(ratios):.2f}, "
                       f"max {max(ratios):.2f} over {len(ratios)} cells{tgt}")
        else:
            out.append(f"- {label} ratio qp/ort: — (no qpasses cells yet)")
    floors = [(r.model, r.float_s / r.ort["seconds"]) for r in rows
              if r.config == "u8s8_minmax" and r.float_s and r.ort.get("ok") and r.ort.get("seconds")]
    if floors:
        out.append("- floor: one float inference pass over the calibration samples, as a share of ORT's "
                   "U8S8 minmax time (no calibrator that runs every sample can go below it): "
                   + ", ".join(f"{m} {x:.2f}" for m, x in floors))
    for r in rows:
        if r.mixed and not r.mixed.get("error"):
            m = r.mixed
            out.append(f"- mixed precision {r.model} ({len(m['promoted'])} activations at {MIXED_TYPE}): "
                       f"qpasses {_f(r.qp.get('snr'), 2)} -> {_f(m.get('qp', {}).get('snr'), 2)} dB, "
                       f"onnxruntime {_f(r.ort.get('snr'), 2)} -> {_f(m.get('ort', {}).get('snr'), 2)} dB")
    out.append("- Timings come from a 2-core machine shared with other jobs: expect +-20 % noise.")
    return "\n".join(out)


# -- RSS vs samples ----------------------------------------------------------------------------------
def rss_vs_samples(args, log) -> dict:
    name = args.models[0] if args.models else "light_resnet50_rand"
    bm = bench_models.prepare(name, args.cache, args.corpus)
    out_dir = args.out / bm.name / "rss"
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = (16, 64)
    results = {}
    lines = [f"Peak RSS (MB) vs calibration samples on {name}:", "",
             "| config | side | " + " | ".join(f"{n} samples" for n in counts) + " | growth MB |",
             "|---|---|" + "---|" * (len(counts) + 1)]
    for cname in ("u8s8_percentile", "u8s8_entropy"):
        cfg = CONFIGS[cname]
        for side in [s for s in ("ort", "qp") if s in args.sides]:
            vals = []
            for n in counts:
                n_eff = len(bm.samples("calib", n))
                r = run_child(side, bm, n_eff, cfg.ort if side == "ort" else cfg.qp,
                              out_dir / f"{cname}.{side}.{n}.onnx", args.timeout)
                results[f"{cname}/{side}/{n}"] = r
                vals.append(r.get("rss_mb") if r.get("ok") else None)
            growth = vals[-1] - vals[0] if None not in vals else None
            lines.append(f"| {cname} | {side} | " + " | ".join(_f(v, 0) if v is not None else "ERR" for v in vals)
                         + f" | {_f(growth, 0)} |")
            log(lines[-1])
    print("\n".join(lines))
    return results


# -- main --------------------------------------------------------------------------------------------
TIMED_PASSES = ("smooth-quant", "calibrate", "select-by-snr", "search-precision")


def pass_table(rows: list[Row]) -> str:
    """qpasses' seconds per pass (the costly ones; the rest together), beside onnxruntime's and the floor."""
    out = ["", "| model | config | floor s | t_ort s | t_qp s | " + " | ".join(TIMED_PASSES) + " | rest |",
           "|---|---|---|---|---|" + "---|" * (len(TIMED_PASSES) + 1)]
    for r in rows:
        if not r.qp.get("passes"):
            continue
        seconds = {name.split("{")[0]: 0.0 for name in TIMED_PASSES}
        for text, sec, _ in r.qp["passes"]:
            name = text.split("{")[0]
            if name in seconds:
                seconds[name] += sec
        rest = r.qp["seconds"] - sum(seconds.values())
        out.append(f"| {r.model} | {r.config} | {r.float_s:.2f} | {r.ort.get('seconds', float('nan')):.2f} | "
                   f"{r.qp['seconds']:.2f} | " + " | ".join(f"{seconds[n]:.2f}" for n in TIMED_PASSES)
                   + f" | {rest:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=lambda s: [x for x in s.split(",") if x], default=None,
                    help=f"comma-separated subset (default: {','.join(bench_models.DEFAULT_MODELS)}; "
                         f"all: {','.join(bench_models.all_names())})")
    ap.add_argument("--configs", type=lambda s: [x for x in s.split(",") if x], default=None,
                    help=f"comma-separated, of {','.join(CONFIGS)} (default: {','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--samples", type=int, default=None, help="calibration samples (default 64, --quick 16)")
    ap.add_argument("--quick", action="store_true", help=f"models {','.join(bench_models.QUICK_MODELS)}, 16 samples")
    ap.add_argument("--sides", default="ort,qp", help="ort, qp or ort,qp")
    ap.add_argument("--reuse-ort", action="store_true",
                    help="reuse onnxruntime results of an earlier run (same model, config, samples)")
    ap.add_argument("--no-mixed", dest="mixed", action="store_false", help="skip the mixed-precision column")
    ap.add_argument("--mp-rank", choices=("local", "accumulated"), default="local",
                    help="mixed-precision ranking: each activation's own quantization error (local) or "
                         "the QDQ model's error at that tensor including upstream (accumulated)")
    ap.add_argument("--latency-runs", type=int, default=20, help="timed runs per QDQ model (0: skip latency)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per quantization child")
    ap.add_argument("--repeats", type=int, default=1,
                    help="quantize each cell (and time the float pass) this many times, keep the fastest")
    ap.add_argument("--pass-times", action="store_true", help="also print qpasses' seconds per pass")
    ap.add_argument("--qp-default", type=json.loads, default=None, metavar="JSON",
                    help="qpasses config for the 'default' row instead of the built-in defaults "
                         "(to try a candidate default, e.g. '{\"calibration\": {\"method\": \"mse\"}}')")
    ap.add_argument("--json", type=Path, help="write all measurements to this JSON file")
    ap.add_argument("--corpus", type=Path, default=bench_models.DEFAULT_CORPUS)
    ap.add_argument("--cache", type=Path, default=bench_models.DEFAULT_CACHE,
                    help="prepared float models and data")
    ap.add_argument("--out", type=Path, default=None, help="quantized models (default CACHE/out)")
    ap.add_argument("--rss-vs-samples", action="store_true",
                    help="only measure peak RSS of percentile/entropy with 16 vs 64 samples on one model "
                         "(the first of --models; default light_resnet50_rand)")
    args = ap.parse_args(argv)
    args.sides = {s.strip() for s in args.sides.split(",")}
    args.out = args.out or args.cache / "out"
    samples = args.samples or (16 if args.quick else 64)
    args.samples = samples

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if args.rss_vs_samples:
        results = rss_vs_samples(args, log)
        if args.json:
            args.json.write_text(json.dumps({"rss_vs_samples": results}, indent=1, default=str))
        return 0
    names = args.models or list(bench_models.QUICK_MODELS if args.quick else bench_models.DEFAULT_MODELS)
    unknown = [c for c in (args.configs or []) if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    configs = [CONFIGS[c] for c in (args.configs or DEFAULT_CONFIGS)]
    if args.qp_default is not None:
        configs = [replace(c, qp=args.qp_default) if c.name == "default" else c for c in configs]
    rows, skipped, start = [], [], time.perf_counter()
    log("| " + " | ".join(COLUMNS) + " |")
    for name in names:
        try:
            bm = bench_models.prepare(name, args.cache, args.corpus)
        except FileNotFoundError as exc:
            skipped.append(f"{name}: {exc}")
            log(f"skipping {name}: {exc}")
            continue
        rows += bench_model(bm, configs, args, log)
    print(table(rows))
    if args.pass_times:
        print(pass_table(rows))
    print(summary(rows, samples))
    for s in skipped:
        print(f"- skipped {s}")
    print(f"- total benchmark time {time.perf_counter() - start:.0f} s; SNR = min over outputs of "
          f"10*log10(sum ref^2 / sum err^2) over all eval samples; latency = median of "
          f"{args.latency_runs} single-thread runs")
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "rows": [r.__dict__ for r in rows],
                                         "skipped": skipped}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
