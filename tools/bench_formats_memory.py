"""Peak RSS of weight-only quantization on a model past 2 GB (external data), in a child process.

    python tools/bench_formats_memory.py [--layers 36] [--width 4096] [--algorithm rtn] [--format matmulnbits]

The model is bench_big_model.py's chain of MatMul -> Add -> Relu layers (36 x 4096 x 4096 float32:
2.42 GB of weights), written straight to external data. A child process runs ``qpasses.load`` ->
``mode: weight_only`` (int4, block 32) -> ``qpasses.save(external_data=True)`` and reports its
peak RSS (VmHWM) against the size of the weights, and where the peak was reached (after load,
after quantize, after save). The parent loads the output in onnxruntime from its path and compares
it with the float model on 4 samples (SNR); the files are deleted unless ``--keep``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's qpasses, in the child too
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_big_model import build, samples  # noqa: E402
from procstats import status_mb  # noqa: E402


def child(src: str, dst: str, algorithm: str, fmt: str, width: int) -> dict:
    import qpasses
    os.environ.setdefault("QPASSES_NO_PROGRESS", "1")
    row = {"rss_base_mb": status_mb("VmHWM")}
    t = time.perf_counter()
    model = qpasses.load(src)
    row.update(load_s=time.perf_counter() - t, peak_after_load_mb=status_mb("VmHWM"))
    t = time.perf_counter()
    config = {"mode": "weight_only", "weight_only": {"algorithm": algorithm, "format": fmt}}
    calib = samples(width, 4, 0) if algorithm in ("gptq", "awq") else None
    model, _ = qpasses.run_pipeline(model, config=config, calibration_data=calib)
    row.update(quantize_s=time.perf_counter() - t, peak_after_quantize_mb=status_mb("VmHWM"))
    t = time.perf_counter()
    qpasses.save(model, dst, external_data=True)
    row.update(save_s=time.perf_counter() - t, peak_rss_mb=status_mb("VmHWM"))
    return row


def check(src: Path, dst: Path, width: int) -> float:
    import onnxruntime as ort
    feeds = samples(width, 4, 1)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    ref = ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"])
    ref_out = [ref.run(None, f)[0] for f in feeds]
    del ref
    q = ort.InferenceSession(str(dst), opts, providers=["CPUExecutionProvider"])
    out = [q.run(None, f)[0] for f in feeds]
    num = sum(float(np.sum(r.astype(np.float64) ** 2)) for r in ref_out)
    den = sum(float(np.sum((r.astype(np.float64) - o) ** 2)) for r, o in zip(ref_out, out))
    return 10 * np.log10(num / den)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--algorithm", default="rtn")
    ap.add_argument("--format", default="matmulnbits")
    ap.add_argument("--keep", help="build in this folder and keep the files")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        src, dst, alg, fmt, width = args.child
        print(json.dumps(child(src, dst, alg, fmt, int(width))))
        return 0
    ctx = tempfile.TemporaryDirectory(prefix="qp-wo-big-") if not args.keep else None
    folder = Path(ctx.name if ctx else args.keep)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        src, nbytes = build(folder, args.layers, args.width)
        mb = nbytes / 2**20
        print(f"built {args.layers} x MatMul {args.width}x{args.width}: weights {nbytes / 1e9:.2f} GB in external data")
        dst = folder / "model.int4.onnx"
        proc = subprocess.run([sys.executable, __file__, "--child", str(src), str(dst), args.algorithm, args.format,
                               str(args.width)], capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return 1
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{args.algorithm} -> {args.format}: load {row['load_s']:.1f} s, quantize {row['quantize_s']:.1f} s, "
              f"save {row['save_s']:.1f} s")
        print(f"peak RSS {row['peak_rss_mb']:.0f} MB = {row['peak_rss_mb'] / mb:.2f} x the weights ({mb:.0f} MB); "
              f"peak after load {row['peak_after_load_mb'] / mb:.2f}x, after quantize "
              f"{row['peak_after_quantize_mb'] / mb:.2f}x; interpreter + libraries {row['rss_base_mb']:.0f} MB")
        sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.name.startswith("model.int4")}
        print("output files: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(sizes.items())))
        print(f"onnxruntime runs it from its path: SNR {check(src, dst, args.width):.1f} dB vs float")
        return 0
    finally:
        if ctx is not None:
            ctx.cleanup()


if __name__ == "__main__":
    sys.exit(main())
