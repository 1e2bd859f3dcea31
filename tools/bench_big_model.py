"""A float model past the 2 GB protobuf limit through qpasses: load -> quantize (8 samples) -> save.

    python tools/bench_big_model.py                  # 36 MatMul layers of 4096x4096 (2.42 GB of weights)
    python tools/bench_big_model.py --layers 40 --width 4096 --keep /tmp/big   # keep the files there

The model (a chain MatMul -> Add -> Relu per layer over a [1, width] input) is written straight
to external data in a temporary folder, one weight at a time, so building it needs little memory.
A child process then runs ``qpasses.load`` (external data read in) -> ``qpasses.quantize`` (default
config, 8 samples) -> ``qpasses.save`` (written with external data: the quantized weights are
still past qpasses' threshold only for very large models, so ``external_data=True`` is asked
explicitly), and reports its time per step and its peak RSS (VmHWM) against the size of the
weights, overall and per pass (the high-water mark is reset before each pass through
/proc/self/clear_refs, and the overall peak is the largest of the parts). The parent then loads the output in onnxruntime from its path, runs it on held-out
samples and compares with the float model (SNR), and deletes the files.
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
import onnx
from onnx import TensorProto, helper

SAMPLES = 8

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procstats import status_mb  # noqa: E402  (tools/procstats.py)


def build(folder: Path, layers: int, width: int, seed: int = 0) -> tuple[Path, int]:
    """Write ``model.onnx`` + ``model.onnx.data`` into ``folder``; returns (path, weight bytes)."""
    rng = np.random.default_rng(seed)
    data_name = "model.onnx.data"
    nodes, inits, x, offset = [], [], "input", 0
    with open(folder / data_name, "wb") as data:
        for i in range(layers):
            for name, shape, std in ((f"w{i}", (width, width), np.sqrt(2.0 / width)), (f"b{i}", (width,), 0.02)):
                array = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
                data.write(array.tobytes())
                tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
                tensor.data_location = TensorProto.EXTERNAL
                for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(array.nbytes))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, value
                offset += array.nbytes
                inits.append(tensor)
                del array
            nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"], name=f"mm{i}"),
                      helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"add{i}"], name=f"add{i}"),
                      helper.make_node("Relu", [f"add{i}"], [f"relu{i}"], name=f"relu{i}")]
            x = f"relu{i}"
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = folder / "model.onnx"
    onnx.save_model(model, str(path))   # tensors already external: only the graph is written here
    return path, offset


def samples(width: int, count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input": rng.standard_normal((1, width), dtype=np.float32)} for _ in range(count)]


# -- child: the measured process ---------------------------------------------------------------------
def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (False where the kernel does not allow it)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(src: str, dst: str, width: int) -> dict:
    import qpasses
    from qpasses.core.instruments import TimePasses

    class PeakPerPass(TimePasses):
        """Pass times, plus each pass's own peak RSS (VmHWM reset before it); passes a pass runs
        on a copy (select-by-snr's ``then``, ctx.depth > 0) count in their parent's peak."""

        def __init__(self):
            super().__init__()
            self.peaks: list[float] = []
            self.before_peak = 0.0    # the largest peak of what ran before the passes, or between them

        def before(self, index, p, model, ctx):
            if not ctx.depth:
                self.before_peak = max(self.before_peak, status_mb("VmHWM"))
                _reset_peak()

        def after(self, index, p, model, record, ctx):
            super().after(index, p, model, record, ctx)
            if not ctx.depth:
                self.peaks.append(status_mb("VmHWM"))

    row = {"rss_base_mb": status_mb("VmHWM")}
    timer = PeakPerPass()
    start = time.perf_counter()
    cpu = time.process_time()
    model = qpasses.load(src)
    row["load_s"], row["rss_after_load_mb"] = time.perf_counter() - start, status_mb("VmRSS")
    t = time.perf_counter()
    qpasses.run_pipeline(model, None, calibration_data=samples(width, SAMPLES, 0), time_passes=timer)
    row["quantize_s"], row["rss_after_quantize_mb"] = time.perf_counter() - t, status_mb("VmRSS")
    t = time.perf_counter()
    qpasses.save(model, dst, external_data=True)
    row["save_s"] = time.perf_counter() - t
    row["total_s"], row["cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
    top = [r for r in timer.rows if not r[4]]   # (text, seconds, modified, stats, depth) of the user's pipeline
    row["passes"] = [[text, round(sec, 2), round(peak)] for (text, sec, *_), peak in zip(top, timer.peaks, strict=True)]
    row["peak_rss_mb"] = max([status_mb("VmHWM"), timer.before_peak] + timer.peaks)
    return row


# -- parent ------------------------------------------------------------------------------------------
def check_output(src: Path, dst: Path, width: int) -> dict:
    """Load the quantized model in onnxruntime from its path, run it and compare with the float model."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    feeds = samples(width, 4, 1)
    out = {}
    q = ort.InferenceSession(str(dst), opts, providers=["CPUExecutionProvider"])
    got = [q.run(None, f)[0] for f in feeds]
    del q
    f = ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"])
    ref = [f.run(None, x)[0] for x in feeds]
    del f
    ref, got = np.concatenate(ref), np.concatenate(got)
    out["snr_db"] = float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / max(np.sum((ref - got) ** 2.0), 1e-30)))
    proto = onnx.load(str(dst), load_external_data=False)
    ops = [n.op_type for n in proto.graph.node]
    out["q_nodes"], out["dq_nodes"] = ops.count("QuantizeLinear"), ops.count("DequantizeLinear")
    out["int8_weights"] = sum(t.data_type == TensorProto.INT8 for t in proto.graph.initializer)
    out["external"] = sum(t.data_location == TensorProto.EXTERNAL for t in proto.graph.initializer)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--keep", help="build in this folder and keep the files")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    ctx = tempfile.TemporaryDirectory(prefix="qp-big-") if not args.keep else None
    folder = Path(ctx.name if ctx else args.keep)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        src, nbytes = build(folder, args.layers, args.width)
        print(f"built {src} in {time.perf_counter() - t:.1f} s: {args.layers} x MatMul {args.width}x{args.width}, "
              f"weights {nbytes / 1e9:.2f} GB ({nbytes / 2**30:.2f} GiB) in external data", flush=True)
        dst = folder / "model.qdq.onnx"
        load = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, __file__, "--child", str(src), str(dst), str(args.width)],
                              capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return 1
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        mb = nbytes / 2**20
        print(f"qpasses load {row['load_s']:.1f} s, quantize {row['quantize_s']:.1f} s, save {row['save_s']:.1f} s: "
              f"total {row['total_s']:.1f} s wall, {row['cpu_s']:.1f} s CPU (load avg {load:.1f} -> {os.getloadavg()[0]:.1f})")
        print("  passes (s, peak RSS / weights): " + ", ".join(
            f"{name.split('{')[0]} {sec} {peak / (nbytes / 2**20):.2f}x" for name, sec, peak in row["passes"]))
        print(f"peak RSS {row['peak_rss_mb']:.0f} MB = {row['peak_rss_mb'] / mb:.2f} x the weights ({mb:.0f} MB); "
              f"after load {row['rss_after_load_mb']:.0f} MB, after quantize {row['rss_after_quantize_mb']:.0f} MB, "
              f"interpreter + libraries {row['rss_base_mb']:.0f} MB")
        sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.name.startswith("model.qdq")}
        print("output files: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(sizes.items())))
        check = check_output(src, dst, args.width)
        print(f"onnxruntime loads {dst.name} from its path and runs it: SNR {check['snr_db']:.1f} dB vs float; "
              f"{check['q_nodes']} Q / {check['dq_nodes']} DQ nodes, {check['int8_weights']} int8 initializers, "
              f"{check['external']} initializers in external data")
        return 0
    finally:
        if ctx is not None:
            ctx.cleanup()


if __name__ == "__main__":
    sys.exit(main())
