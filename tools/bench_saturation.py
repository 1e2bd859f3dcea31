"""int16 pair-sum saturation (issue 35): what protecting every x86-64 CPU costs, and what it saves.

onnxruntime's uint8 x int8 kernels on x86-64 CPUs without VNNI sum weight pairs in int16 and
saturate (qpasses.analysis.saturation). qpasses' default (``cpu: x86-64``) gives the layers at
risk whose pair sums on the calibration data come near the int16 bound int8 grids on which no pair
of codes can saturate (protect-pair-sums), run by the int8 kernels on every CPU. Per model (issue
35's layer, then the bench models of bench_accuracy.py):

* ``sim``: the task metric (or output SNR) in onnxruntime's QDQ simulation (no graph
  optimizations: what a VNNI or ARM CPU computes) of qpasses protecting every layer at risk
  (``qpasses_all``: ``protect-pair-sums{data=false}``), the default (``qpasses``: judged on the
  calibration data), the same layers with uint8 weights (``qpasses_uint8``, with ``--variants``:
  ``protect-pair-sums{fix=uint8}``: exact, uint8 x uint8 kernels), unprotected (``cpu: x86-64-vnni``), and onnxruntime's quantize_static
  (per-channel MinMax; ``--variants`` adds ``ort_reduce_range``: 7-bit weights, onnxruntime's
  advice for these CPUs);
* ``haswell`` (``--qemu``): the same models in the int8 kernels under ``qemu-x86_64 -cpu Haswell``
  (AVX2, no VNNI; Debian package qemu-user; 5-20x slower), onnxruntime's with ``--qemu-ort``;
* the layers at risk (of the uint8 x int8 layers of the unprotected model) and those each qpasses
  variant protects, the default's emulation time (s), and each model's latency
  on this CPU (ms, median of ``--runs`` single-thread runs, interleaved) and as a ratio to ort's.

    python tools/bench_saturation.py                                # all models, no qemu (~15 min)
    python tools/bench_saturation.py --qemu --models layer,ppocr_v2_cls --eval-samples 8
    python tools/bench_saturation.py --qemu --eval-dir ~/.cache/qp-bench/eval128 --eval-samples 128
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import accuracy_models as acc  # noqa: E402
from bench_accuracy import ALL_MODELS, DEFAULT_CORPUS, bench_model, output_snr  # noqa: E402
from models import FeedReader  # noqa: E402

VARIANTS = ("qpasses_all", "qpasses", "qpasses_uint8", "qpasses_unprotected", "ort", "ort_reduce_range")
DEFAULT_VARIANTS = "qpasses_all,qpasses,qpasses_unprotected,ort"
RUN_OUTPUTS = r"""
import sys, numpy as np, onnxruntime as ort
opts = ort.SessionOptions()
opts.log_severity_level = 3
s = ort.InferenceSession(sys.argv[1], opts, providers=["CPUExecutionProvider"])
with np.load(sys.argv[2]) as z:
    feeds = [{k: z[k][i] for k in z.files} for i in range(len(z[z.files[0]]))]
outs = [s.run(None, f) for f in feeds]
np.savez(sys.argv[3], **{f"{i}_{j}": o for i, out in enumerate(outs) for j, o in enumerate(out)})
"""


class Layer:
    """Issue 35's layer (qpasses.testing.bn_conv_layer), scored by output SNR."""

    name = "layer"

    def __init__(self, folder: Path):
        import onnx
        from qpasses.testing import bn_conv_data, bn_conv_layer

        self.path = folder / "layer.onnx"
        onnx.save(bn_conv_layer(), self.path)
        self._feeds = {"calib": bn_conv_data(16, 1), "eval": bn_conv_data(16, 7)}

    def feeds(self, which: str, limit: int | None = None) -> list[dict]:
        return [{"x": x} for x in self._feeds[which][:limit]]

    def metric(self, outs_f, outs_q) -> tuple[str, float]:
        return "output SNR dB", output_snr(outs_f, outs_q)


def quantize(variant: str, model_path, feeds: list[dict], out: Path) -> dict:
    """Quantize ``model_path`` as ``variant`` into ``out``; qpasses' pair-sum decision (or {})."""
    if variant.startswith("ort"):
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

        quantize_static(str(model_path), str(out), FeedReader(feeds), quant_format=QuantFormat.QDQ, per_channel=True,
                        reduce_range=variant == "ort_reduce_range", activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax)
        return {}
    import qpasses
    from qpasses.core.pipeline import default_pipeline

    config = {"cpu": "x86-64-vnni"} if variant == "qpasses_unprotected" else None
    option = {"qpasses_all": "{data=false}", "qpasses_uint8": "{fix=uint8}"}.get(variant)
    passes = default_pipeline(True).replace("protect-pair-sums", "protect-pair-sums" + option) if option else None
    model, records = qpasses.run_pipeline(str(model_path), passes, config=config, calibration_data=feeds)
    qpasses.save(model, str(out))
    seconds = next((r.seconds for r in records if r.name == "protect-pair-sums"), None)
    return {**model.decisions.get("pair_sums", {}), "emulation_s": seconds}   # the whole pass's time


QEMU_BATCH = 16   # feeds per emulated process: onnxruntime's memory under qemu grows with every run (13 GB
                  # for ~100 yolo_detector feeds, then the OOM killer)


def outputs(path: Path, feeds: list[dict], *, qemu: bool, tmp: Path) -> list[list]:
    """Every feed's outputs: the QDQ simulation here, or the int8 kernels under qemu Haswell."""
    if not qemu:
        from qpasses.evaluation.evaluate import session

        sess = session(str(path), optimize=False)
        return [sess.run(None, f) for f in feeds]
    return [o for start in range(0, len(feeds), QEMU_BATCH) for o in _emulated(path, feeds[start:start + QEMU_BATCH], tmp)]


def _emulated(path: Path, feeds: list[dict], tmp: Path) -> list[list]:
    data, out = tmp / "feeds.npz", tmp / "outs.npz"
    np.savez(data, **{k: np.stack([f[k] for f in feeds]) for k in feeds[0]})
    done = subprocess.run([shutil.which("qemu-x86_64"), "-cpu", "Haswell", sys.executable, "-c", RUN_OUTPUTS,
                           str(path), str(data), str(out)], capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in done.stderr.strip().splitlines() if "TCG doesn't support" not in line]
        raise RuntimeError(lines[-1] if lines else f"qemu exit status {done.returncode}")
    with np.load(out) as z:
        n = len({k.split("_")[0] for k in z.files})
        return [[z[f"{i}_{j}"] for j in range(len(z.files) // n)] for i in range(n)]


def at_risk(path: Path) -> str:
    import onnx
    from qpasses.analysis.saturation import qdq_layers, risks
    from qpasses.ir.model import from_proto

    model = from_proto(onnx.load(str(path)))
    layers = qdq_layers(model)
    return f"{len(risks(layers))}/{len(layers)}"


def bench(bm, args, tmp: Path) -> dict:
    from bench_vs_ort import latencies   # tools/bench_vs_ort.py

    calib, evals = bm.feeds("calib", args.calib_samples), bm.feeds("eval", args.eval_samples)
    float_outs = outputs(Path(bm.path), evals, qemu=False, tmp=tmp)
    row = {"model": bm.name, "eval_samples": len(evals), "variants": {}}
    for variant in args.variants.split(","):
        path = tmp / f"{bm.name}.{variant}.onnx"
        cell = row["variants"][variant] = {}
        try:
            record = quantize(variant, bm.path, calib, path)
            if variant.startswith("qpasses"):
                fixes = [r.get("fix") for r in record.get("layers", {}).values()]
                cell["protected"] = fixes.count("uint8") + fixes.count("grid")
                cell["emulation_s"] = record.get("emulation_s")
            cell["path"] = str(path)
            cell["metric"], cell["sim"] = bm.metric(float_outs, outputs(path, evals, qemu=False, tmp=tmp))
            if args.qemu and (variant.startswith("qpasses") or args.qemu_ort):
                cell["haswell"] = bm.metric(float_outs, outputs(path, evals, qemu=True, tmp=tmp))[1]
            cell["at_risk"] = at_risk(path)
        except Exception as exc:   # one variant failing is a row's cell, not the end of the run
            cell["error"] = str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else type(exc).__name__
    timed = [v for v in row["variants"].values() if "path" in v and "error" not in v]
    if args.runs and timed:
        for cell, ms in zip(timed, latencies([Path(v["path"]) for v in timed], evals[0], args.runs)):
            cell["latency_ms"] = ms
    return row


def table(rows: list[dict], qemu: bool) -> str:
    def fmt(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    variants = [v for v in VARIANTS if any(v in r["variants"] for r in rows)]
    head = ["model", "metric"] + [f"{v} {k}" for v in variants for k in (("sim", "haswell") if qemu else ("sim",))]
    head += ["at risk", "protected all / default", "emulation s"] + [f"{v} ms" for v in variants]
    head += [f"{v} x ort" for v in variants if v != "ort"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        v = {name: r["variants"].get(name, {}) for name in variants}
        metric = next((c.get("metric") for c in v.values() if c.get("metric")), "-")
        cells = [r["model"], metric]
        for name in variants:
            c = v[name]
            cells += [c.get("error", "failed")[:40] if "error" in c else fmt(c.get("sim"))]
            if qemu:
                cells.append(fmt(c.get("haswell")))
        cells.append(v.get("qpasses_unprotected", {}).get("at_risk", "-"))
        cells.append(f"{fmt(v.get('qpasses_all', {}).get('protected'))} / {fmt(v.get('qpasses', {}).get('protected'))}")
        cells.append(fmt(v.get("qpasses", {}).get("emulation_s")))
        cells += [fmt(v[name].get("latency_ms")) for name in variants]
        base = v.get("ort", {}).get("latency_ms")
        cells += [f"{v[name]['latency_ms'] / base:.2f}" if base and v[name].get("latency_ms") else "-"
                  for name in variants if name != "ort"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="layer," + ",".join(ALL_MODELS))
    ap.add_argument("--qemu", action="store_true", help="also score qpasses' int8 kernels under qemu-x86_64 -cpu Haswell")
    ap.add_argument("--qemu-ort", action="store_true", help="with --qemu, onnxruntime's models too")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--runs", type=int, default=20, help="latency runs per model (0: none)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--eval-dir", type=Path, metavar="DIR",
                    help="eval sets DIR/<model>.npz instead of the models' own (tools/build_eval_sets.py)")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.qemu and not shutil.which("qemu-x86_64"):
        print("bench_saturation: --qemu needs qemu-x86_64 (apt-get install qemu-user)", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in args.models.split(","):
            bm = Layer(tmp) if name == "layer" else bench_model(name, args.corpus, acc.DEFAULT_CACHE)
            if args.eval_dir and (args.eval_dir / f"{name}.npz").is_file():
                bm.eval = args.eval_dir / f"{name}.npz"
            rows.append(bench(bm, args, tmp))
            print(table(rows[-1:], args.qemu).splitlines()[-1], flush=True)
    print(table(rows, args.qemu))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
