"""Scaling of the full quantization pipeline (calibration with 8 samples included).

    python tools/bench_quant_scale.py                       # both parts (ORT at 3,200 nodes takes ~4+ min)
    python tools/bench_quant_scale.py chains [800,1600]     # Conv+Relu chains, qpasses vs quantize_static
    python tools/bench_quant_scale.py chains --skip-ort     # qpasses side only
    python tools/bench_quant_scale.py synthetic [25000,50000]   # default pipeline on synthetic graphs
    python tools/bench_quant_scale.py --profile 100000      # cProfile of one synthetic size
    ... --json results.json

Part 1, chains: a chain of N/2 Conv(3x3, 8->8 channels)+Relu pairs over a [1, 8, 8, 8] input
(N nodes). onnxruntime.quantization.quantize_static (QDQ) and qpasses run the same config, U8
activations, S8 weights, MinMax per-tensor, on the same 8 calibration samples (an .npz written
once), each in its own child process; the time is quantize + save (imports excluded). Target:
qpasses >= 50x faster than onnxruntime at 3,200 nodes.

Part 2, synthetic: the residual graphs of tools/bench_scale.py (Conv+Relu, MatMul+Add, Concat+Conv,
foldable weights, dead nodes; tiny activations, so the cost is per node) through
load -> default pipeline (default config, 8 samples) -> save, one child process per size; seconds
per pass (TimePasses). Targets: 100k nodes <= 60 s end to end, t(200k)/t(100k) <= 2.2.

Every row also gives CPU seconds of the child (process_time: all its threads) and its peak RSS
(VmHWM). The machine is shared: the 1-minute load average is printed before and after each row;
with load > cores, wall times are inflated and CPU seconds are the steadier figure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale  # noqa: E402  (tools/bench_scale.py: the synthetic graphs)
from procstats import peak_rss_mb  # noqa: E402  (tools/procstats.py)

CHAIN_SIZES = (800, 1_600, 3_200)
SYNTHETIC_SIZES = (25_000, 50_000, 100_000, 200_000)
SAMPLES = 8
CHAIN_SHAPE = (1, 8, 8, 8)
QP_MINMAX = {"activation_type": "uint8", "weight_type": "int8", "per_channel": False,
             "calibration": {"method": "minmax"}}
TIMEOUT = 3600


# -- models and data ---------------------------------------------------------------------------------
def conv_relu_chain(n_nodes: int, seed: int = 0) -> onnx.ModelProto:
    """``n_nodes / 2`` Conv(3x3, pad 1)+Relu pairs; weights scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    c = CHAIN_SHAPE[1]
    nodes, inits, x = [], [], "input"
    for i in range(n_nodes // 2):
        w = (rng.standard_normal((c, c, 3, 3)) * np.sqrt(2.0 / (9 * c))).astype(np.float32)
        b = (rng.standard_normal(c) * 0.05).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"conv{i}_w"), numpy_helper.from_array(b, f"conv{i}_b")]
        nodes.append(helper.make_node("Conv", [x, f"conv{i}_w", f"conv{i}_b"], [f"conv{i}"], name=f"conv{i}",
                                      pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"conv{i}"], [f"relu{i}"], name=f"relu{i}"))
        x = f"relu{i}"
    graph = helper.make_graph(nodes, f"chain{n_nodes}",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, list(CHAIN_SHAPE))],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, list(CHAIN_SHAPE))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def write_samples(path: Path, shape, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    np.savez(path, input=rng.standard_normal((SAMPLES, *shape)).astype(np.float32))


# -- child processes ---------------------------------------------------------------------------------
class Clock:
    """Wall and CPU seconds of a block, added to ``out[key]`` / ``out[key + '_cpu']``."""

    def __init__(self, out: dict, key: str):
        self.out, self.key = out, key

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        self.out[self.key] = time.perf_counter() - self.wall
        self.out[self.key + "_cpu"] = time.process_time() - self.cpu


def child_ort(model: str, data: str, out: str) -> dict:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    arrays = np.load(data)["input"]

    class Reader:
        def __init__(self):
            self.i = 0

        def get_next(self):
            if self.i >= len(arrays):
                return None
            self.i += 1
            return {"input": arrays[self.i - 1]}

        def rewind(self):
            self.i = 0

    row: dict = {"rss_base_mb": peak_rss_mb()}
    with Clock(row, "total"):
        quantize_static(model, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=False,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax)
    return row


def child_qp(model: str, data, out: str, config, profile: bool = False) -> dict:
    import qpasses
    from qpasses.core.instruments import TimePasses

    row: dict = {"rss_base_mb": peak_rss_mb()}
    timer = TimePasses()
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    with Clock(row, "total"):
        with Clock(row, "load"):
            qmodel = qpasses.load(model)
        with Clock(row, "passes"):
            qpasses.run_pipeline(qmodel, None, config=config, calibration_data=data, time_passes=timer)
        with Clock(row, "save"):
            qpasses.save(qmodel, out)
    if profiler is not None:
        import pstats

        profiler.disable()
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(60)
    # the user's pipeline only (depth 0): passes a pass runs on a copy count in their parent's time
    row["pass_seconds"] = [[text, round(sec, 3)] for text, sec, _, _, depth in timer.rows if not depth]
    row["nodes_out"] = len(onnx.load(out, load_external_data=False).graph.node)
    return row


def _child_main(argv: list[str]) -> int:
    kind, model, data, out = argv[:4]
    if kind == "ort":
        row = child_ort(model, data, out)
    else:
        config = json.loads(argv[4]) if len(argv) > 4 and argv[4] != "null" else None
        row = child_qp(model, data, out, config, profile="--profile" in argv)
    row["rss_mb"] = peak_rss_mb()
    print(json.dumps(row))
    return 0


def run_child(kind: str, model: Path, data: Path, out: Path, config=None, profile=False) -> dict:
    """Run one side in a fresh interpreter; returns its row (``error`` set on failure)."""
    args = [sys.executable, __file__, "--child", kind, str(model), str(data), str(out), json.dumps(config)]
    if profile:
        args.append("--profile")
    load_before = os.getloadavg()[0]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {TIMEOUT} s", "loadavg": [load_before, os.getloadavg()[0]]}
    if profile:
        print(proc.stderr, file=sys.stderr)
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": tail[:300], "loadavg": [load_before, os.getloadavg()[0]]}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["loadavg"] = [load_before, os.getloadavg()[0]]
    return row


# -- part 1: chains ----------------------------------------------------------------------------------
def bench_chains(sizes, skip_ort: bool) -> list[dict]:
    print(f"\n## Conv+Relu chains: qpasses vs onnxruntime quantize_static (U8S8 minmax per-tensor, "
          f"{SAMPLES} samples, {CHAIN_SHAPE} input)\n")
    print("| nodes | ORT s (CPU s) | qpasses s (CPU s) | ratio wall | ratio CPU | ORT / qp peak RSS MB | load avg |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            model, data = tmp / "chain.onnx", tmp / "calib.npz"
            onnx.save(conv_relu_chain(n), model)
            write_samples(data, CHAIN_SHAPE)
            qp = run_child("qp", model, data, tmp / "qp.onnx", QP_MINMAX)
            ort = {"skipped": True} if skip_ort else run_child("ort", model, data, tmp / "ort.onnx")
        row = {"nodes": n, "qp": qp, "ort": ort}
        rows.append(row)
        print(_chain_line(row), flush=True)
    return rows


def _cell(side: dict, key: str = "total") -> str:
    if "error" in side:
        return "error: " + side["error"][:60]
    if side.get("skipped"):
        return "-"
    return f"{side[key]:.2f} ({side[key + '_cpu']:.2f})"


def _chain_line(row: dict) -> str:
    qp, ort = row["qp"], row["ort"]
    ok = "total" in qp and "total" in ort
    ratio = f"{ort['total'] / qp['total']:.0f}x" if ok else "-"
    ratio_cpu = f"{ort['total_cpu'] / qp['total_cpu']:.0f}x" if ok else "-"
    rss = f"{ort.get('rss_mb', 0):.0f} / {qp.get('rss_mb', 0):.0f}"
    loads = "/".join(f"{v:.1f}" for v in qp.get("loadavg", []) + ort.get("loadavg", [])[1:])
    return f"| {row['nodes']:,} | {_cell(ort)} | {_cell(qp)} | {ratio} | {ratio_cpu} | {rss} | {loads} |"


# -- part 2: synthetic graphs ------------------------------------------------------------------------
def bench_synthetic(sizes, profile: int | None = None) -> list[dict]:
    print(f"\n## Synthetic graphs: load -> default pipeline ({SAMPLES} samples) -> save\n")
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            model, data = tmp / "in.onnx", tmp / "calib.npz"
            onnx.save(bench_scale.build(n), model)
            write_samples(data, (1, 4, 4, 4))
            row = run_child("qp", model, data, tmp / "out.onnx", None, profile=profile is not None)
        row["nodes"] = n
        rows.append(row)
        if "error" in row:
            print(f"{n:,} nodes: {row['error']}", flush=True)
            continue
        print(f"### {n:,} nodes -> {row['nodes_out']:,}: {row['total']:.1f} s wall, {row['total_cpu']:.1f} s CPU, "
              f"peak RSS {row['rss_mb']:.0f} MB, load avg {row['loadavg'][0]:.1f} -> {row['loadavg'][1]:.1f}")
        cells = [f"load {_fmt(row, 'load')}"]
        cells += [f"{text.split('{')[0]} {sec:.2f}" for text, sec in row["pass_seconds"]]
        cells.append(f"save {_fmt(row, 'save')}")
        print("    " + " | ".join(cells), flush=True)
    _synthetic_table(rows)
    return rows


def _fmt(row: dict, key: str) -> str:
    return f"{row[key]:.2f}"


def _synthetic_table(rows: list[dict]) -> None:
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return
    passes = [text.split("{")[0] for text, _ in ok[0]["pass_seconds"]]
    print("\n| seconds | " + " | ".join(f"{r['nodes']:,}" for r in ok) + " |")
    print("|---|" + "---:|" * len(ok))
    print("| load | " + " | ".join(_fmt(r, "load") for r in ok) + " |")
    for i, name in enumerate(passes):
        print(f"| {name} | " + " | ".join(f"{r['pass_seconds'][i][1]:.2f}" for r in ok) + " |")
    print("| save | " + " | ".join(_fmt(r, "save") for r in ok) + " |")
    print("| **total wall** | " + " | ".join(f"**{r['total']:.1f}**" for r in ok) + " |")
    print("| total CPU | " + " | ".join(f"{r['total_cpu']:.1f}" for r in ok) + " |")
    print("| peak RSS MB | " + " | ".join(f"{r['rss_mb']:.0f}" for r in ok) + " |")
    print("| load avg | " + " | ".join(f"{r['loadavg'][0]:.1f}-{r['loadavg'][1]:.1f}" for r in ok) + " |")
    by = {r["nodes"]: r for r in ok}
    if 100_000 in by and 200_000 in by:
        a, b = by[100_000], by[200_000]
        print(f"\nt(200k)/t(100k) = {b['total'] / a['total']:.2f} wall, {b['total_cpu'] / a['total_cpu']:.2f} CPU "
              f"(target <= 2.2);  100k: {a['total']:.1f} s wall, {a['total_cpu']:.1f} s CPU (target <= 60 s)")


# -- main --------------------------------------------------------------------------------------------
def _sizes(argv: list[str], default) -> list[int]:
    for a in argv:
        if a[:1].isdigit():
            return [int(s.replace("_", "")) for s in a.split(",")]
    return list(default)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--child":
        return _child_main(argv[1:])
    json_path = argv[argv.index("--json") + 1] if "--json" in argv else None
    if "--profile" in argv:
        bench_synthetic([int(argv[argv.index("--profile") + 1])], profile=0)
        return 0
    print(f"# qpasses quantization scaling ({os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f})")
    results = {}
    parts = [a for a in argv if a in ("chains", "synthetic")] or ["chains", "synthetic"]
    if "chains" in parts:
        results["chains"] = bench_chains(_sizes(argv, CHAIN_SIZES), "--skip-ort" in argv)
    if "synthetic" in parts:
        results["synthetic"] = bench_synthetic(_sizes(argv, SYNTHETIC_SIZES))
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
