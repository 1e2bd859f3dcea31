"""Scaling benchmark: load -> fold-constants -> cleanup -> save on synthetic graphs of growing size.

    python tools/bench_scale.py                 # 25k 50k 100k 200k nodes
    python tools/bench_scale.py 10000 20000     # chosen sizes
    python tools/bench_scale.py --profile 100000   # cProfile of one size (top functions)

Each size runs in a fresh subprocess. The graph is a residual chain of blocks over a small
[1, 4, 4, 4] activation: Conv+Relu, MatMul+Add, a two-branch Concat+Conv, and every fourth
block a Conv whose weight is a foldable ConstantOfShape->Mul subgraph (plus a dead node for
cleanup). Weights are tiny so the cost measured is per node, not per byte. Prints seconds per
stage and the ratio t(200k)/t(100k) of the end-to-end time (targets: 100k <= 30 s, ratio <= 2.2).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DEFAULT_SIZES = (25_000, 50_000, 100_000, 200_000)
STAGES = ("load", "gs_import", "fold-constants", "cleanup", "save", "gs_export")


def build(n_nodes: int, seed: int = 0) -> onnx.ModelProto:
    """A synthetic model with about ``n_nodes`` nodes."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def weight(name, *shape):
        inits.append(numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name))
        return name

    def node(op, inputs, output, **attrs):
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    shape4 = "weight_shape"
    inits.append(numpy_helper.from_array(np.array([4, 4, 1, 1], np.int64), shape4))
    x, i = "input", 0
    while len(nodes) < n_nodes:
        p = f"b{i}"
        kind = i % 4
        if kind == 0:
            y = node("Relu", [node("Conv", [x, weight(f"{p}_w", 4, 4, 1, 1), weight(f"{p}_b", 4)], f"{p}_conv")],
                     f"{p}_relu")
        elif kind == 1:
            y = node("Add", [node("MatMul", [x, weight(f"{p}_w", 4, 4)], f"{p}_mm"), weight(f"{p}_b", 4)], f"{p}_add")
        elif kind == 2:
            left = node("Relu", [x], f"{p}_l")
            right = node("Neg", [x], f"{p}_r")
            cat = node("Concat", [left, right], f"{p}_cat", axis=1)
            y = node("Conv", [cat, weight(f"{p}_w", 4, 8, 1, 1)], f"{p}_conv")
        else:  # foldable weight: ConstantOfShape -> Mul, and a dead node
            filled = node("ConstantOfShape", [shape4], f"{p}_fill",
                          value=numpy_helper.from_array(np.array([0.1], np.float32)))
            w = node("Mul", [filled, weight(f"{p}_scale", 4, 1, 1, 1)], f"{p}_w")
            y = node("Conv", [x, w], f"{p}_conv")
            node("Sigmoid", [y], f"{p}_dead")
        x = node("Add", [x, y], f"{p}_res")
        i += 1
    graph = helper.make_graph(nodes, "bench_scale",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 4, 4, 4])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 4, 4, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def measure(src: Path, profile: bool = False) -> dict:
    """Time each stage on the model at ``src`` (in this process)."""
    import onnx_graphsurgeon as gs

    import qpasses
    from qpasses.core.context import RunContext
    from qpasses.core.pipeline import make_pass
    from qpasses.ir import model as ir

    spent = {"gs_import": 0.0, "gs_export": 0.0}

    def timed(key, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        return wrapper

    class Clock:
        """Wall and CPU seconds of a block (CPU time is robust to other processes on the machine)."""

        def __init__(self, key):
            self.key = key

        def __enter__(self):
            self.wall, self.cpu = time.perf_counter(), time.process_time()

        def __exit__(self, *exc):
            times[self.key] = time.perf_counter() - self.wall
            cpu[self.key] = time.process_time() - self.cpu

    ir.gs.import_onnx = timed("gs_import", gs.import_onnx)
    ir.gs.export_onnx = timed("gs_export", gs.export_onnx)
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "out.onnx"
        profiler = None
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        times, cpu, stats = {}, {}, {}
        with Clock("load"):
            model = qpasses.load(src)
        for name in ("fold-constants", "cleanup"):
            with Clock(name):
                result = make_pass(name).run(model, RunContext())
                model.touch()
            stats[name] = result.stats
        with Clock("save"):
            qpasses.save(model, dst)
        if profiler is not None:
            import pstats

            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(35)
        out_nodes = len(onnx.load(dst, load_external_data=False).graph.node)
    nodes = len(onnx.load(src, load_external_data=False).graph.node)
    times.update(spent)
    times["total"] = times["load"] + times["fold-constants"] + times["cleanup"] + times["save"]
    cpu["total"] = cpu["load"] + cpu["fold-constants"] + cpu["cleanup"] + cpu["save"]
    return {"nodes": nodes, "out_nodes": out_nodes, "times": times, "cpu": cpu, "stats": stats}


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--one":
        print(json.dumps(measure(Path(argv[1]))))
        return 0
    if argv and argv[0] == "--profile":
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "in.onnx"
            onnx.save(build(int(argv[1]) if len(argv) > 1 else 100_000), src)
            print(json.dumps(measure(src, profile=True)))
        return 0
    sizes = [int(a) for a in argv] or list(DEFAULT_SIZES)
    print("wall seconds per stage [CPU seconds of this process in brackets]")
    print(f"{'nodes':>8} " + " ".join(f"{s:>16}" for s in STAGES) + f" {'total':>16}  out_nodes")
    rows = {}
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "in.onnx"
            onnx.save(build(size), src)   # built here so the measured process starts clean
            out = subprocess.run([sys.executable, __file__, "--one", str(src)], capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return 1
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows[size] = row
        t, c = row["times"], row["cpu"]
        print(f"{row['nodes']:>8} " + " ".join(f"{t[s]:>7.2f} [{c[s]:>6.2f}]" if s in c else f"{t[s]:>16.2f}"
                                               for s in STAGES)
              + f" {t['total']:>7.2f} [{c['total']:>6.2f}]  {row['out_nodes']}", flush=True)
    print("(gs_import is inside load, gs_export inside save)")
    if 100_000 in rows and 200_000 in rows:
        wall = rows[200_000]["times"]["total"] / rows[100_000]["times"]["total"]
        cpu = rows[200_000]["cpu"]["total"] / rows[100_000]["cpu"]["total"]
        print(f"t(200k)/t(100k) = {wall:.2f} wall, {cpu:.2f} CPU   "
              f"100k total = {rows[100_000]['times']['total']:.1f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
