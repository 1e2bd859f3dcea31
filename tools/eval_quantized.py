"""Task metric of quantized model files as this CPU's onnxruntime kernels run them (issue 32).

The same file computes differently on x86-64 CPUs with VNNI and without (AVX2: onnxruntime's U8S8
kernels sum pairs in int16 and can saturate). Run this under ``qemu-x86_64 -cpu Haswell`` to score
the AVX2 path here; the header says which path onnxruntime took (a one-MatMul probe whose pair sums
saturate without VNNI), not what /proc/cpuinfo claims (qemu user mode passes the host's through).

    python tools/eval_quantized.py ppocr_v2_cls out/ppocr_v2_cls/{ort,qpasses}.onnx --eval-dir ~/.cache/qp-bench/eval128
    qemu-x86_64 -cpu Haswell .venv/bin/python tools/eval_quantized.py ppocr_v2_cls out/ppocr_v2_cls/ort.onnx \\
        --eval-dir ~/.cache/qp-bench/eval128 --samples 64 --range 0:16 --work /tmp/evq

Sessions: CPUExecutionProvider at onnxruntime's default optimization level, one intra-op thread.
With ``--work DIR`` every sample's outputs are kept (``DIR/<model>/<file stem>.<sha256 prefix>.<path>/<i>.npz``,
the float model's under ``float.<path>``) and reused: ``--range a:b`` runs only those samples
(qemu runs in chunks: a chunk of 32 samples of two files peaked at 0.7 GB RSS on ppocr_v4_rec), and the
metric is printed once every sample is there (``--kernels avx2`` scores an emulated run's outputs
natively). The float model's outputs come from ``float.vnni`` when complete (computing them natively
first keeps the float kernels out of the comparison), else are run here.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import accuracy_models as acc  # noqa: E402
from bench_accuracy import DEFAULT_CORPUS, bench_model, jackknife_se  # noqa: E402


def session(model):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def kernel_path() -> str:
    """``vnni`` when onnxruntime's U8S8 MatMul sums 255 x 127 pairs exactly, ``avx2`` when they
    saturate at int16 (the probe's exact sum is 2,072,640; saturated 32 x 32,767)."""
    from onnx import TensorProto, helper, numpy_helper

    k, n = 64, 16
    inits = [numpy_helper.from_array(np.full((k, n), 127, np.int8), "wq"),
             numpy_helper.from_array(np.array(1.0, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.uint8), "zx"), numpy_helper.from_array(np.array(0, np.int8), "zw")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "s", "zw"], ["wd"]),
             helper.make_node("MatMul", ["xd", "wd"], ["y"])]
    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    y = session(model.SerializeToString()).run(None, {"x": np.full((4, k), 255, np.float32)})[0]
    return "vnni" if float(y[0, 0]) == k * 255 * 127 else "avx2"


def cached_outputs(model_path: Path, feeds: list[dict], indices, folder: Path | None) -> dict:
    """Outputs of ``indices`` (sample -> list of arrays): read from ``folder`` where present, else
    run here (and written to ``folder``)."""
    outs, sess = {}, None
    for i in indices:
        if folder is not None and (folder / f"{i}.npz").is_file():
            with np.load(folder / f"{i}.npz") as z:
                outs[i] = [z[f"o{j}"] for j in range(len(z.files))]
            continue
        sess = sess or session(str(model_path))
        outs[i] = sess.run(None, feeds[i])
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            np.savez(folder / f"{i}.npz", **{f"o{j}": o for j, o in enumerate(outs[i])})
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a bench_accuracy model name (ppocr_v4_rec, yolo_detector, ...)")
    ap.add_argument("quantized", nargs="+", type=Path, help="quantized model files of that model")
    ap.add_argument("--eval-dir", type=Path, help="eval sets DIR/<model>.npz (default: the model's own)")
    ap.add_argument("--samples", type=int, help="the first N eval samples (default: all)")
    ap.add_argument("--range", help="a:b: run only samples a..b-1 (needs --work); score once all are there")
    ap.add_argument("--work", type=Path, help="keep every sample's outputs here and reuse them")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--cache", type=Path, default=acc.DEFAULT_CACHE)
    ap.add_argument("--kernels", choices=("vnni", "avx2"),
                    help="score the outputs --work holds from that kernel path (e.g. an emulated run's, natively: "
                         "the metric under qemu is slow); default: this CPU's")
    ap.add_argument("--json", type=Path, help="append one JSON line per quantized file")
    args = ap.parse_args(argv)
    if (args.range or args.kernels) and not args.work:
        print("eval_quantized: --range and --kernels need --work", file=sys.stderr)
        return 2

    bm = bench_model(args.model, args.corpus, args.cache)
    if args.eval_dir:
        bm.eval = args.eval_dir / f"{args.model}.npz"
    feeds = bm.feeds("eval", args.samples)
    n = len(feeds)
    a, b = (int(v) for v in args.range.split(":")) if args.range else (0, n)
    todo = range(max(0, a), min(b, n))
    here = kernel_path()
    path = args.kernels or here
    print(f"# {args.model}: onnxruntime's int8 kernels here: {here}; {path} outputs scored; {n} eval samples of {bm.eval}",
          flush=True)
    work = args.work / args.model if args.work else None
    for q in args.quantized:
        start = time.perf_counter()
        q_dir = work / f"{q.stem}.{hashlib.sha256(q.read_bytes()).hexdigest()[:8]}.{path}" if work else None
        absent = [i for i in todo if not (q_dir / f"{i}.npz").is_file()] if work else []
        if path != here and absent:
            print(f"eval_quantized: {q_dir} lacks {len(absent)} samples, which only a CPU with {path} kernels can run",
                  file=sys.stderr)
            return 2
        cached_outputs(q, feeds, todo, q_dir)
        seconds = time.perf_counter() - start
        if work and (missing := [i for i in range(n) if not (q_dir / f"{i}.npz").is_file()]):
            print(f"{q}: samples {todo.start}..{todo.stop - 1} done in {seconds:.0f} s; {len(missing)} of {n} "
                  "still missing", flush=True)
            continue
        outs_q = cached_outputs(q, feeds, range(n), q_dir)
        outs_q = [outs_q[i] for i in range(n)]
        # the float model's outputs: computed natively where they are (float.vnni), else here
        complete = [d for d in (work / "float.vnni", work / "float.avx2") if (d / f"{n - 1}.npz").is_file()] if work else []
        float_dir = complete[0] if complete else (work / f"float.{here}" if work else None)
        float_from = float_dir.name.split(".")[1] if float_dir else here
        outs_f = cached_outputs(bm.path, feeds, range(n), float_dir)
        outs_f = [outs_f[i] for i in range(n)]
        name, value = bm.metric(outs_f, outs_q)
        se = jackknife_se(lambda f, qq: bm.metric(f, qq)[1], outs_f, outs_q)
        line = {"model": args.model, "file": str(q), "kernels": path, "float_outputs": float_from, "samples": n,
                "metric": name, "value": value, "se": se, "run_seconds": round(seconds, 1)}
        print(f"{args.model:14s} {q.stem:12s} {path:4s} {name}: {value:.4f} ± {se:.4f}  ({n} samples, float outputs "
              f"{float_from}, {seconds:.0f} s)", flush=True)
        if args.json:
            with args.json.open("a") as fh:
                fh.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
