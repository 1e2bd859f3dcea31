"""Calibration memory and time: qpasses' streaming collectors vs onnxruntime's calibrators.

Builds a ResNet-18-like CNN (224x224 input, seeded He-normal weights, ~11.7M parameters) with
onnx.helper, then for every method and sample count runs calibration in a fresh child process and
prints the child's peak RSS (VmHWM from /proc, else resource.getrusage) and wall seconds, for qpasses' `calibrate` pass and
for onnxruntime.quantization's calibrator of the same method (create_calibrator + collect_data +
compute_data) in the same run. Method mapping: minmax/pow2 -> MinMax, percentile -> Percentile,
entropy -> Entropy, mse -> Distribution (onnxruntime has no MSE calibrator; Distribution is its
other histogram one). Samples are generated one at a time in the child (smooth seeded images), so
the figures are the calibrators' own memory.

    python tools/bench_calib_memory.py [--samples 8,16,32,64] [--methods minmax,entropy] [--width 64]
           [--quantize]   # also time the whole default quantize pipeline vs quantize_static (64 samples)
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ORT_METHOD = {"minmax": "MinMax", "pow2": "MinMax", "percentile": "Percentile", "entropy": "Entropy",
              "mse": "Distribution"}

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procstats import peak_rss_mb  # noqa: E402  (tools/procstats.py)


def resnet_like(width: int = 64, seed: int = 0) -> onnx.ModelProto:
    """ResNet-18 layout: 7x7/2 stem, max pool, 4 stages of 2 basic blocks (width, 2w, 4w, 8w), GAP, FC."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    counter = iter(range(10**6))

    def conv(x, cin, cout, k, stride, relu=True):
        i = next(counter)
        w = rng.normal(0, np.sqrt(2.0 / (cin * k * k)), (cout, cin, k, k)).astype(np.float32)
        b = rng.normal(0, 0.05, cout).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")])
        y = f"conv{i}"
        nodes.append(helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [y], name=y, strides=[stride] * 2,
                                      pads=[k // 2] * 4))
        if relu:
            nodes.append(helper.make_node("Relu", [y], [f"relu{i}"], name=f"relu{i}"))
            return f"relu{i}"
        return y

    def block(x, cin, cout, stride):
        h = conv(x, cin, cout, 3, stride)
        h = conv(h, cout, cout, 3, 1, relu=False)
        skip = conv(x, cin, cout, 1, stride, relu=False) if (stride != 1 or cin != cout) else x
        i = next(counter)
        nodes.append(helper.make_node("Add", [h, skip], [f"add{i}"], name=f"add{i}"))
        nodes.append(helper.make_node("Relu", [f"add{i}"], [f"out{i}"], name=f"out{i}"))
        return f"out{i}"

    x = conv("input", 3, width, 7, 2)
    nodes.append(helper.make_node("MaxPool", [x], ["pool"], name="pool", kernel_shape=[3, 3], strides=[2, 2],
                                  pads=[1, 1, 1, 1]))
    x, cin = "pool", width
    for stage, mult in enumerate((1, 2, 4, 8)):
        for j in range(2):
            x = block(x, cin, width * mult, 2 if (j == 0 and stage > 0) else 1)
            cin = width * mult
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], name="flat"))
    inits.append(numpy_helper.from_array(rng.normal(0, np.sqrt(1.0 / cin), (1000, cin)).astype(np.float32), "fc_w"))
    inits.append(numpy_helper.from_array(np.zeros(1000, np.float32), "fc_b"))
    nodes.append(helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(nodes, "resnet_like",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 224, 224])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1000])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def sample(i: int) -> dict[str, np.ndarray]:
    """A smooth seeded image (low-frequency waves plus noise), normalised like ImageNet inputs."""
    rng = np.random.default_rng(1000 + i)
    yy, xx = np.mgrid[0:224, 0:224] / 224.0
    img = np.empty((1, 3, 224, 224), np.float32)
    for c in range(3):
        fx, fy, phase = rng.uniform(0.5, 4, 3)
        img[0, c] = np.sin(2 * np.pi * (fx * xx + fy * yy) + 6 * phase) + rng.normal(0, 0.3, (224, 224))
    return {"input": img}


class Reader:
    """An onnxruntime-style CalibrationDataReader generating samples on the fly."""

    def __init__(self, count: int):
        self.count, self.i = count, 0

    def get_next(self):
        if self.i >= self.count:
            return None
        self.i += 1
        return sample(self.i - 1)

    def rewind(self):
        self.i = 0


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(tool: str, method: str, samples: int, model_path: str) -> dict:
    """Runs in a fresh process: one calibration, returns peak RSS before/after and seconds."""
    import onnxruntime  # noqa: F401  (imported before the baseline so both tools pay the same)
    import onnxruntime.quantization  # noqa: F401

    import qpasses.passes.calibrate  # noqa: F401

    if tool == "qpasses":
        from qpasses.core.context import RunContext
        from qpasses.ir.model import load
        from qpasses.passes.calibrate import Calibrate

        base, cpu0 = peak_rss_mb(), _cpu_seconds()
        start = time.perf_counter()
        model = load(model_path)
        result = Calibrate(method=method).run(model, RunContext(None, Reader(samples)))
        seconds = time.perf_counter() - start
        tensors = result.stats["tensors"]
    elif tool == "ort":
        from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

        base, cpu0 = peak_rss_mb(), _cpu_seconds()
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            extra = {"num_bins": 2048} if method in ("entropy", "percentile", "mse") else {}
            cal = create_calibrator(model_path, [], augmented_model_path=str(Path(tmp) / "aug.onnx"),
                                    calibrate_method=getattr(CalibrationMethod, ORT_METHOD[method]),
                                    extra_options=extra)
            cal.collect_data(Reader(samples))
            tensors = len(cal.compute_data().data)
        seconds = time.perf_counter() - start
    elif tool in ("qpasses-quantize", "ort-quantize"):
        base, cpu0 = peak_rss_mb(), _cpu_seconds()
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            if tool == "qpasses-quantize":
                from qpasses import quantize, save

                save(quantize(model_path, Reader(samples), config={"calibration": {"method": method}}),
                     Path(tmp) / "q.onnx")
            else:
                from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

                quantize_static(model_path, str(Path(tmp) / "q.onnx"), Reader(samples), quant_format=QuantFormat.QDQ,
                                calibrate_method=getattr(CalibrationMethod, ORT_METHOD[method]))
        seconds, tensors = time.perf_counter() - start, 0
    else:
        raise SystemExit(f"unknown tool {tool}")
    return {"base_mb": base, "peak_mb": peak_rss_mb(), "seconds": seconds, "cpu": _cpu_seconds() - cpu0,
            "tensors": tensors}


def run_child(tool: str, method: str, samples: int, model_path: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", tool, method, str(samples), str(model_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ,
                                                                    "QPASSES_NO_PROGRESS": "1"})
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", default="8,16,32,64")
    p.add_argument("--methods", default="minmax,percentile,entropy,mse,pow2")
    p.add_argument("--width", type=int, default=64, help="channels of the first stage (64: ResNet-18)")
    p.add_argument("--quantize", action="store_true", help="also time the whole quantize vs quantize_static")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        tool, method, samples, path = args.child
        print(json.dumps(child(tool, method, int(samples), path)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "resnet_like.onnx"
        onnx.save(resnet_like(args.width), path)
        params = sum(int(np.prod(t.dims)) for t in onnx.load(path).graph.initializer)
        print(f"model: ResNet-18-like, width {args.width}, {params / 1e6:.1f}M parameters, input 1x3x224x224")
        print(f"{'method':<11}{'samples':>8}{'qp MB':>8}{'ort MB':>8}{'qp +MB':>8}{'ort +MB':>8}"
              f"{'mem x':>7}{'qp s':>8}{'ort s':>8}{'time x':>7}{'qp cpu':>8}{'ort cpu':>8}{'cpu x':>7}")
        for method in args.methods.split(","):
            for n in map(int, args.samples.split(",")):
                ours, theirs = run_child("qpasses", method, n, path), run_child("ort", method, n, path)
                if "error" in ours or "error" in theirs:
                    print(f"{method:<11}{n:>8}  error: {ours.get('error') or theirs.get('error')}")
                    continue
                grow_q, grow_o = ours["peak_mb"] - ours["base_mb"], theirs["peak_mb"] - theirs["base_mb"]
                print(f"{method:<11}{n:>8}{ours['peak_mb']:>8.0f}{theirs['peak_mb']:>8.0f}{grow_q:>8.0f}"
                      f"{grow_o:>8.0f}{theirs['peak_mb'] / ours['peak_mb']:>7.2f}{ours['seconds']:>8.2f}"
                      f"{theirs['seconds']:>8.2f}{ours['seconds'] / theirs['seconds']:>7.2f}{ours['cpu']:>8.2f}"
                      f"{theirs['cpu']:>8.2f}{ours['cpu'] / theirs['cpu']:>7.2f}", flush=True)
        if args.quantize:
            print("\nwhole quantize, 64 samples (qpasses default pipeline vs quantize_static QDQ):")
            for method in args.methods.split(","):
                ours, theirs = (run_child("qpasses-quantize", method, 64, path),
                                run_child("ort-quantize", method, 64, path))
                if "error" in ours or "error" in theirs:
                    print(f"{method:<11} error: {ours.get('error') or theirs.get('error')}")
                    continue
                print(f"{method:<11} qpasses {ours['seconds']:.2f} s ({ours['cpu']:.2f} cpu), {ours['peak_mb']:.0f} MB;"
                      f" onnxruntime {theirs['seconds']:.2f} s ({theirs['cpu']:.2f} cpu), {theirs['peak_mb']:.0f} MB;"
                      f" time ratio {ours['seconds'] / theirs['seconds']:.2f}, cpu ratio "
                      f"{ours['cpu'] / theirs['cpu']:.2f}", flush=True)
    print("\nMB: peak RSS of the child; +MB: growth during calibration (from after imports); mem x: "
          "onnxruntime/qpasses peak; time x, cpu x: qpasses/onnxruntime wall and cpu (user+sys) seconds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
