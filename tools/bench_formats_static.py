"""Formats beside onnxruntime, in one run: dynamic quantization vs quantize_dynamic, FP8 beside
int8, QOperator vs QDQ.

    python tools/bench_formats_static.py [--models example,light_squeezenet,...] [--repeats 5] [--parts dynamic,fp8,qoperator]

Per model it prints (markdown):
- dynamic: output SNR of qpasses `mode: dynamic` and of onnxruntime's quantize_dynamic (per channel,
  QInt8) on the same float model, their difference, and the latency ratio qpasses / onnxruntime;
  also the `quantize-dynamic{form=qdq}` variant's latency ratio;
- FP8: output SNR of the static pipeline with float8e4m3fn and float8e5m2 (activations and weights,
  per channel) beside the default uint8/int8;
- QOperator: the largest output difference (in output LSBs) between `format: qoperator` and the
  QDQ model run with ORT_ENABLE_ALL, and the latency ratio QOperator / QDQ.
Latency: one thread, median over ``--repeats`` rounds of one pass over the evaluation feeds, the
models measured in turn within each round.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import qpasses  # noqa: E402
from qpasses.evaluation.evaluate import snr_db  # noqa: E402

DEFAULT = ("example", "light_squeezenet", "ppocr_v2_cls", "ppocr_v4_rec", "encoder_block")
CALIB = 16   # calibration feeds for the static pipelines (FP8, int8, QOperator)


def load(name: str):
    """(float ModelProto, calibration feeds, evaluation feeds)."""
    if name == "example":
        from qpasses.cli.examples import example_data, example_model

        calib, evald = example_data(CALIB, seed=1), example_data(16, seed=2)
        split = lambda d: [{k: v[i] for k, v in d.items()} for i in range(len(next(iter(d.values()))))]
        return example_model(), split(calib), split(evald)
    import models

    bm = models.prepare(name)
    return onnx.load(str(bm.path)), list(bm.samples("calib", CALIB)), list(bm.samples("eval", 16))


def session(proto, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    opts = ort.SessionOptions()
    opts.graph_optimization_level, opts.log_severity_level = level, 3
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    data = proto if isinstance(proto, (str, bytes)) else proto.SerializeToString()
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


def outputs(sess, feeds):
    names = {i.name for i in sess.get_inputs()}
    return [sess.run(None, {k: v for k, v in f.items() if k in names}) for f in feeds]


def worst_snr(ref, got) -> float:
    """The worst output's SNR over all feeds (dB)."""
    return min(snr_db(np.concatenate([r[i].ravel() for r in ref]), np.concatenate([g[i].ravel() for g in got]))
               for i in range(len(ref[0])))


def latency(sessions: dict, feeds, repeats: int) -> dict[str, float]:
    """Median seconds of one pass over ``feeds`` per session, measured in turn each round."""
    times = {k: [] for k in sessions}
    for _ in range(repeats):
        for key, sess in sessions.items():
            names = {i.name for i in sess.get_inputs()}
            start = time.perf_counter()
            for f in feeds:
                sess.run(None, {k: v for k, v in f.items() if k in names})
            times[key].append(time.perf_counter() - start)
    return {k: float(np.median(v)) for k, v in times.items()}


def max_lsb(qdq, qop, feeds) -> float:
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    made = {o: n for n in qdq.graph.node for o in n.output}
    a, b = outputs(session(qdq), feeds), outputs(session(qop), feeds)
    worst = 0.0
    for ra, rb in zip(a, b):
        for out, x, y in zip(qdq.graph.output, ra, rb):
            node = made.get(out.name)
            step = float(inits[node.input[1]].max()) if node is not None and node.op_type == "DequantizeLinear" else 0
            diff = float(np.abs(x.astype(np.float64) - y).max())
            worst = max(worst, diff / step if step else (0.0 if diff == 0 else float("inf")))
    return worst


def _ort_dynamic(src: Path, dst: Path) -> bool:
    """onnxruntime's quantize_dynamic (per channel, QInt8); False (with a note) when it fails."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    try:
        quantize_dynamic(src, dst, per_channel=True, weight_type=QuantType.QInt8)
        return True
    except Exception as exc:   # its failures are assorted
        print(f"note: onnxruntime quantize_dynamic failed on {src.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return False


def quiet_quantize(proto, feeds, config, passes=None):
    return qpasses.run_pipeline(proto, passes, config=config, calibration_data=feeds, notify=lambda line: None)[0]


def bench(name: str, repeats: int, tmp: Path, parts=("dynamic", "fp8", "qoperator")) -> dict:
    proto, calib, evald = load(name)
    ref = outputs(session(proto, ort.GraphOptimizationLevel.ORT_DISABLE_ALL), evald)
    row = {"model": name}
    if "dynamic" in parts:
        row.update(bench_dynamic(name, proto, ref, evald, repeats, tmp))
    if "fp8" in parts or "qoperator" in parts:
        row.update(bench_static(proto, ref, calib, evald, repeats, parts))
    return row


def bench_dynamic(name, proto, ref, evald, repeats: int, tmp: Path) -> dict:
    row = {}
    src, theirs = tmp / f"{name}.onnx", tmp / f"{name}.ortdyn.onnx"
    onnx.save(proto, src)
    mine = qpasses.run_pipeline(str(src), config={"mode": "dynamic"}, notify=lambda line: None)[0].to_proto(metadata=False)
    # onnxruntime on the model as qpasses' folding passes leave it (what its quant_pre_process gives)
    folded, theirs_folded = tmp / f"{name}.folded.onnx", tmp / f"{name}.ortdyn.folded.onnx"
    onnx.save(qpasses.run_pipeline(str(src), "fold-constants,fold-batchnorm,cleanup")[0].to_proto(metadata=False), folded)
    row["dyn_snr_ort"], row["dyn_snr_ort_folded"] = (
        worst_snr(ref, outputs(session(str(out)), evald)) if _ort_dynamic(inp, out) else float("nan")
        for inp, out in ((src, theirs), (folded, theirs_folded)))
    if not theirs_folded.is_file():   # onnxruntime failed on this model: time against the float model
        theirs_folded = src
    qdq_form = qpasses.run_pipeline(str(src), "fold-constants,fold-batchnorm,cleanup,quantize-dynamic{form=qdq},cleanup",
                                    config={"mode": "dynamic"}, notify=lambda line: None)[0].to_proto(metadata=False)
    s_ort, s_mine, s_qdq = session(str(theirs_folded)), session(mine), session(qdq_form)
    row["dyn_snr_qp"] = worst_snr(ref, outputs(s_mine, evald))
    t = latency({"ort": s_ort, "qp": s_mine, "qdq": s_qdq}, evald, repeats)
    row["dyn_lat"], row["dyn_qdq_lat"] = t["qp"] / t["ort"], t["qdq"] / t["ort"]
    row["dyn_snr_qdq"] = worst_snr(ref, outputs(s_qdq, evald))
    return row


def bench_static(proto, ref, calib, evald, repeats: int, parts) -> dict:
    """FP8 beside int8 (static pipeline) and the int8 model lowered to QOperator."""
    row = {}
    fp8 = (("e4m3", {"activation_type": "float8e4m3fn", "weight_type": "float8e4m3fn"}),
           ("e5m2", {"activation_type": "float8e5m2", "weight_type": "float8e5m2"})) if "fp8" in parts else ()
    for key, cfg in (("int8", {}),) + fp8:
        start = time.perf_counter()
        q = quiet_quantize(proto, calib, cfg)
        row[f"{key}_s"] = time.perf_counter() - start
        qp = q.to_proto(metadata=False)
        row[f"snr_{key}"] = worst_snr(ref, outputs(session(qp), evald))
        if key == "int8" and "qoperator" in parts:
            lowered = qpasses.run_pipeline(q, "lower-qoperator,cleanup", notify=lambda line: None)[0]
            qop = lowered.to_proto(metadata=False)
            row["qop_lsb"] = max_lsb(qp, qop, evald)
            t = latency({"qdq": session(qp), "qop": session(qop)}, evald, repeats)
            row["qop_lat"] = t["qop"] / t["qdq"]
            row["qop_ops"] = sum(n.op_type.startswith("QLinear") or n.op_type == "QGemm" for n in qop.graph.node)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parts", default="dynamic,fp8,qoperator", help="which comparisons to run")
    args = ap.parse_args(argv)
    parts = tuple(args.parts.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            try:
                rows.append(bench(name, args.repeats, Path(tmp), parts))
            except FileNotFoundError as exc:
                print(f"skipped {name}: {exc}", file=sys.stderr)
                continue
            print(f"done {name}", file=sys.stderr, flush=True)
    return report(rows, parts)


def report(rows: list[dict], parts) -> int:
    if "dynamic" in parts:
        print_dynamic(rows)
    if "fp8" in parts:
        print_fp8(rows)
    if "qoperator" in parts:
        print_qoperator(rows)
    checks = []
    if "dynamic" in parts:
        checks += [("dynamic SNR >= quantize_dynamic - 0.1 dB (same folded input)",
                    all(r["dyn_snr_qp"] >= r["dyn_snr_ort_folded"] - 0.1 for r in rows)),
                   ("dynamic latency <= 1.0x (5 % noise margin)", all(r["dyn_lat"] <= 1.05 for r in rows))]
    if "qoperator" in parts:
        checks += [("QOperator <= 1 LSB", all(r["qop_lsb"] <= 1.0 for r in rows)),
                   ("QOperator latency <= 1.0x (5 % noise margin)", all(r["qop_lat"] <= 1.05 for r in rows))]
    print("\n" + "\n".join(f"- {'PASS' if ok else 'FAIL'}: {text}" for text, ok in checks))
    return 0


def print_dynamic(rows) -> None:
    print("\n### Dynamic: qpasses `mode: dynamic` vs onnxruntime quantize_dynamic (per channel, QInt8)\n")
    print("| model | SNR qpasses dB | SNR ort dB (same folded input) | SNR ort dB (raw input) | latency qpasses / ort (folded) "
          "| form=qdq: SNR dB, latency / ort |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['dyn_snr_qp']:.2f} | {r['dyn_snr_ort_folded']:.2f} | {r['dyn_snr_ort']:.2f} "
              f"| {r['dyn_lat']:.2f} | {r['dyn_snr_qdq']:.2f}, {r['dyn_qdq_lat']:.2f} |")


def print_fp8(rows) -> None:
    print("\n### FP8 beside int8 (static pipeline, per-channel weights)\n")
    print("| model | uint8/int8 SNR dB | float8e4m3fn SNR dB | float8e5m2 SNR dB | pipeline s (int8 / e4m3) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['snr_int8']:.2f} | {r['snr_e4m3']:.2f} | {r['snr_e5m2']:.2f} "
              f"| {r['int8_s']:.1f} / {r['e4m3_s']:.1f} |")


def print_qoperator(rows) -> None:
    print("\n### QOperator vs QDQ (default uint8/int8 pipeline; QDQ run with ORT_ENABLE_ALL)\n")
    print("| model | QLinear/QGemm nodes | max diff (output LSB) | latency QOperator / QDQ |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['qop_ops']} | {r['qop_lsb']:.2f} | {r['qop_lat']:.2f} |")


if __name__ == "__main__":
    raise SystemExit(main())
