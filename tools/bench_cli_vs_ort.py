"""The same work as onnxruntime, timed as a user runs both: the `qpasses run` process against a
script calling onnxruntime's quantizer, each a fresh process, wall time of the whole process
(interpreter start, imports, loading, quantizing, saving; the CLI also checks that the output loads
and prints its SNR line).

    python tools/bench_cli_vs_ort.py                          # everything below, 3 repeats (~5 min)
    python tools/bench_cli_vs_ort.py --parts static --models bert_encoder,ppocr_v2_cls --repeats 5
    python tools/bench_cli_vs_ort.py --parts chain,rtn --json cli.json

Parts:
* static: quantize_static (QDQ, QUInt8 activations, QInt8 weights, per tensor, MinMax) against
  `qpasses run --config` with onnxruntime's config in qpasses' spelling (ORT_CONFIG: its symmetric
  QInt8 weight grid, weights held in Constant nodes quantized as activations as it does, accuracy
  target 0: no search) on the accuracy models (tools/accuracy_models.py)
  and any corpus model named; output SNR of both on the eval set (worst output), measured here.
* chain: the 3,200-node Conv+Relu chain of bench_quant_scale.py through `qpasses run` with the
  default config (mse histograms), 8 samples (target <= 5 s; quantize_static needs minutes: not run).
* rtn: weight-only int4 RTN (block 32, symmetric) of bert_encoder: MatMulNBitsQuantizer against
  `qpasses run` with the weight_only config (RTN_CONFIG).

Floors beside each row: `startup`, a process that imports numpy and onnxruntime and exits (both
sides pay it); `float pass`, one float inference pass over the calibration samples in a session
made beforehand (any calibration that runs every sample pays it). Each cell is the fastest of
``--repeats`` runs after an untimed one, the sides interleaved; CPU seconds (all threads) of that
run in brackets. The children cache bytecode as a user's Python does (PYTHONDONTWRITEBYTECODE,
if set here, is dropped; the cache is a folder of the run).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]

ORT_CONFIG = {"activation_type": "uint8", "weight_type": "int8", "per_channel": False, "weight_symmetric": True,
              "calibration": {"method": "minmax"}, "accuracy": {"target": 0}, "smooth_quant": False,
              "computed_weights": "activation"}
RTN_CONFIG = {"mode": "weight_only", "weight_only": {"bits": 4, "block_size": 32, "symmetric": True, "algorithm": "rtn", "format": "matmulnbits"}}
ACC_MODELS = ("bert_encoder", "byte_classifier", "crnn_lstm")
CHAIN_NODES, CHAIN_SAMPLES = 3200, 8

ORT_STATIC = """
import sys, numpy as np
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
model, calib, out = sys.argv[1:4]
data = np.load(calib)
names, n = data.files, len(data[data.files[0]])
class Reader:
    def __init__(self): self.i = 0
    def get_next(self):
        self.i += 1
        return {k: data[k][self.i - 1] for k in names} if self.i <= n else None
    def rewind(self): self.i = 0
quantize_static(model, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=False,
                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax)
"""
ORT_RTN = """
import sys, onnx
from onnxruntime.quantization import matmul_nbits_quantizer as mq
model, out = sys.argv[1:3]
q = mq.MatMulNBitsQuantizer(onnx.load(model), block_size=32, is_symmetric=True, bits=4,
                            algo_config=mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, bits=4))
q.process()
q.model.save_model_to_file(out)
"""
STARTUP = "import numpy, onnxruntime"


# as a user's Python runs: bytecode cached (here in a folder of the run, warmed by an untimed first
# run of each side), so neither side compiles its sources each time; --qpasses-rev adds PYTHONPATH
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"QPASSES_NO_PROGRESS": "1"}


def timed(args: list[str]) -> dict:
    """Run a process; its wall and CPU seconds, stderr, and an error line if it failed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env=ENV, cwd=ENV["PYTHONPYCACHEPREFIX"])
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row = {"wall": wall, "cpu": cpu, "stderr": proc.stderr}
    if proc.returncode:
        row["error"] = (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1][:200]
    return row


def fastest(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    return min(ok, key=lambda r: r["wall"]) if ok else runs[-1]


def interleaved(sides: dict[str, list[str]], repeats: int) -> dict[str, dict]:
    """The fastest of ``repeats`` runs of each side, the sides alternating, after one untimed run."""
    runs: dict[str, list] = {name: [] for name in sides}
    for args in sides.values():
        timed(args)
    for _ in range(repeats):
        for name, args in sides.items():
            runs[name].append(timed(args))
    return {name: fastest(r) for name, r in runs.items()}


def cli(model: Path, out: Path, config: Path | None, calib: Path | None = None) -> list[str]:
    args = [sys.executable, "-m", "qpasses", "run", str(model), "-o", str(out), "--time-passes"]
    args += ["--calib", str(calib)] if calib else []
    return args + (["--config", str(config)] if config else [])


def cli_lines(stderr: str) -> dict:
    """What the CLI said: its SNR line's value and the pipeline's seconds (--time-passes)."""
    snr = re.search(r"output SNR vs float: ([-\d.inf]+) dB over ([^(,\n]*)", stderr)
    total = re.search(r"^\s*([\d.]+)\s+100\.0\s+total", stderr, re.M)
    passes = {m.group(2): float(m.group(1)) for m in re.finditer(r"^\s*([\d.]+)\s+[\d.]+\s+([a-z-]+)", stderr, re.M)}
    return {"cli_snr": float(snr.group(1)) if snr else None, "cli_samples": snr.group(2).strip() if snr else None,
            "passes_s": float(total.group(1)) if total else None, "pass_s": passes}


# -- measured in this process -------------------------------------------------------------------------
def _session(path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def feeds(path: Path) -> list[dict]:
    data = np.load(path)
    return [{k: data[k][i] for k in data.files} for i in range(len(data[data.files[0]]))]


def float_pass(model: Path, calib: Path, repeats: int) -> float:
    sess, samples = _session(model), feeds(calib)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for feed in samples:
            sess.run(None, feed)
        best = min(best, time.perf_counter() - start)
    return best


def snr_db(model: Path, quantized: Path, evald: Path) -> float | None:
    """The worst output's SNR of ``quantized`` against ``model`` over the eval samples."""
    from qpasses.evaluation.evaluate import snr_db as snr

    if not quantized.is_file():
        return None
    samples = feeds(evald)
    ref, test = _session(model), _session(quantized)
    names = [o.name for o in ref.get_outputs()]
    r = [ref.run(names, f) for f in samples]
    t = [test.run(names, f) for f in samples]
    return min(snr(np.concatenate([np.ravel(x[k]) for x in r]), np.concatenate([np.ravel(x[k]) for x in t]))
               for k in range(len(names)))


# -- the parts ----------------------------------------------------------------------------------------
def model_files(name: str, corpus: Path) -> tuple[Path, Path, Path]:
    if (corpus / "models" / f"{name}.onnx").is_file():
        return corpus / "models" / f"{name}.onnx", corpus / "calib" / f"{name}.npz", corpus / "eval" / f"{name}.npz"
    import accuracy_models

    folder = accuracy_models.prepare(name, accuracy_models.DEFAULT_CACHE)
    return folder / "model.onnx", folder / "calib.npz", folder / "eval.npz"


def static_row(name: str, corpus: Path, tmp: Path, repeats: int, startup: float) -> dict:
    model, calib, evald = model_files(name, corpus)
    config = tmp / "ort_config.json"
    config.write_text(json.dumps(ORT_CONFIG))
    out = {"ort": tmp / f"{name}.ort.onnx", "qp": tmp / f"{name}.qp.onnx"}
    best = interleaved({"ort": [sys.executable, "-c", ORT_STATIC, str(model), str(calib), str(out["ort"])],
                        "qp": cli(model, out["qp"], config, calib)}, repeats)
    return {"part": "static", "model": name, "startup": startup, "floor": float_pass(model, calib, repeats),
            "samples": len(feeds(calib)), **{side: _side(best[side], model, out[side], evald) for side in out}}


def chain_row(tmp: Path, repeats: int, startup: float) -> dict:
    import onnx

    import bench_quant_scale

    model, calib = tmp / "chain.onnx", tmp / "chain_calib.npz"
    onnx.save(bench_quant_scale.conv_relu_chain(CHAIN_NODES), model)
    bench_quant_scale.write_samples(calib, bench_quant_scale.CHAIN_SHAPE)
    out = tmp / "chain.qp.onnx"
    best = interleaved({"qp": cli(model, out, None, calib)}, repeats)
    return {"part": "chain", "model": f"conv_relu_chain_{CHAIN_NODES}", "startup": startup,
            "floor": float_pass(model, calib, repeats), "samples": CHAIN_SAMPLES,
            "qp": _side(best["qp"], model, out, calib)}


def rtn_row(corpus: Path, tmp: Path, repeats: int, startup: float) -> dict:
    model, _, evald = model_files("bert_encoder", corpus)
    config = tmp / "rtn_config.json"
    config.write_text(json.dumps(RTN_CONFIG))
    out = {"ort": tmp / "rtn.ort.onnx", "qp": tmp / "rtn.qp.onnx"}
    best = interleaved({"ort": [sys.executable, "-c", ORT_RTN, str(model), str(out["ort"])],
                        "qp": cli(model, out["qp"], config)}, repeats)
    return {"part": "rtn", "model": "bert_encoder", "startup": startup, "floor": None,
            **{side: _side(best[side], model, out[side], evald) for side in out}}


def _side(run: dict, model: Path, out: Path, evald: Path) -> dict:
    row = {k: v for k, v in run.items() if k != "stderr"} | cli_lines(run["stderr"])
    row["snr"] = None if "error" in run else snr_db(model, out, evald)
    return row


# -- the table ----------------------------------------------------------------------------------------
TARGETS = {"static": "<= 1.0x", "chain": "<= 5 s", "rtn": "<= 1.0x"}


def table(rows: list[dict]) -> list[str]:
    lines = ["| work | model | startup s | float pass s | onnxruntime s (CPU) | qpasses CLI s (CPU; pipeline) | "
             "ratio | SNR dB onnxruntime / qpasses | target |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        qp, ort = r["qp"], r.get("ort")
        ratio = f"**{qp['wall'] / ort['wall']:.2f}x**" if ort and "error" not in ort and "error" not in qp else "-"
        lines.append(f"| {r['part']} | {r['model']} | {r['startup']:.2f} | "
                     f"{'-' if r['floor'] is None else format(r['floor'], '.3f')} | {_cell(ort)} | "
                     f"{_cell(qp, pipeline=True)} | {ratio} | {_snr(ort)} / {_snr(qp)} | {TARGETS[r['part']]} |")
    return lines


def _cell(side: dict | None, pipeline: bool = False) -> str:
    if side is None:
        return "-"
    if "error" in side:
        return "error: " + side["error"][:60]
    extra = f"; {side['passes_s']:.2f}" if pipeline and side.get("passes_s") is not None else ""
    return f"{side['wall']:.2f} ({side['cpu']:.2f}{extra})"


def _snr(side: dict | None) -> str:
    return "-" if side is None or side.get("snr") is None else f"{side['snr']:.2f}"


def checks(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        qp, ort = r["qp"], r.get("ort")
        if "error" in qp or (ort and "error" in ort):
            out.append(f"- FAIL: {r['part']} {r['model']}: a side failed")
            continue
        if r["part"] == "chain":
            ok, what = qp["wall"] <= 5.0, f"{qp['wall']:.2f} s end to end (target <= 5 s)"
        else:
            ratio = qp["wall"] / ort["wall"]
            ok, what = ratio <= 1.0, f"{ratio:.2f}x onnxruntime's time (target <= 1.0x)"
            if r["part"] == "static" and qp["snr"] is not None and ort["snr"] is not None:
                what += f"; SNR {qp['snr']:.2f} vs {ort['snr']:.2f} dB"
                ok = ok and qp["snr"] >= ort["snr"]
        out.append(f"- {'PASS' if ok else 'FAIL'}: {r['part']} {r['model']}: {what}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="static,chain,rtn", help="comma list of static, chain, rtn")
    ap.add_argument("--models", default=",".join(ACC_MODELS),
                    help="static part: accuracy models (tools/accuracy_models.py) and corpus models")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell, the fastest kept (sides interleaved)")
    ap.add_argument("--corpus", type=Path, default=Path("~/.cache/qp-corpus").expanduser())
    ap.add_argument("--qpasses-rev", help="run qpasses from this git revision (exported to a temp dir), "
                                          "not the work tree other engineers edit")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.qpasses_rev or "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    print(f"# qpasses CLI vs onnxruntime, one process each ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"{args.repeats} repeats; qpasses {rev}{'' if args.qpasses_rev else ' + work tree'})", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ENV["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")   # also the children's working folder
        (tmp / "pycache").mkdir()
        if args.qpasses_rev:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.qpasses_rev, "qpasses"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
            ENV["PYTHONPATH"] = str(tmp)
        startup = fastest([timed([sys.executable, "-c", STARTUP]) for _ in range(args.repeats + 1)])["wall"]
        jobs = ([lambda m=m: static_row(m, args.corpus, tmp, args.repeats, startup) for m in args.models.split(",")]
                if "static" in parts else [])
        jobs += [lambda: chain_row(tmp, args.repeats, startup)] if "chain" in parts else []
        jobs += [lambda: rtn_row(args.corpus, tmp, args.repeats, startup)] if "rtn" in parts else []
        for job in jobs:
            rows.append(job())
            print(table(rows[-1:])[-1], file=sys.stderr, flush=True)
    print("\n".join(table(rows) + [""] + checks(rows)))
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
