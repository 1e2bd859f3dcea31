"""The RTN blocks of bench_formats.py: the two sides' runs alternated, the RTN arithmetic alone on
each side (onnxruntime's compiled quantize_matmul_4bits against ours, and whether its bytes could
stand in for ours), and where each side's RTN time goes (ModelProto in, ModelProto out)."""
from __future__ import annotations

import copy
import time

import numpy as np
from onnx import numpy_helper

from qpasses.core.context import RunContext


def timed_pair(a, b, repeats: int, cpu: list | None = None):
    """timed() of two functions, their calls alternating (a load change falls on both sides alike).
    With a ``cpu`` list, the two sides' median process CPU times (every thread's) are appended to it."""
    if repeats > 1:
        a(), b()
    runs, cpus = [], [[], []]

    def call(i, fn):
        t = time.process_time()
        out = fn()
        cpus[i].append(time.process_time() - t)
        return out
    for r in range(repeats):
        runs.append((call(0, a), call(1, b)) if r % 2 == 0 else tuple(reversed((call(1, b), call(0, a)))))
    if cpu is not None:
        cpu.extend(float(np.median(c)) for c in cpus)
    return [(runs[-1][j][0], float(np.median([r[j][1] for r in runs]))) for j in (0, 1)]


def ort_kernel(w: np.ndarray):
    """onnxruntime's compiled symmetric int4 block-32 RTN (what its DEFAULT algorithm calls): B, scales."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    k, n = w.shape
    blocks = -(-k // 32)
    b, scales = np.zeros((n, blocks, 16), np.uint8), np.zeros((n, blocks), np.float32)
    quantize_matmul_4bits(b, w, scales, np.zeros((n, (blocks + 1) // 2), np.uint8), 32, n, k, True)
    return b, scales


def kernel_lines(proto, repeats: int) -> list[str]:
    """The RTN arithmetic alone on each side (the MatMul weights as arrays in, B and scales out),
    and how onnxruntime's compiled kernel's bytes compare with our RTN's (plain and refitted)."""
    from qpasses.weightonly.matmulnbits import nbits_inputs
    from qpasses.weightonly.rtn import quantize_rtn

    names = {n.input[1] for n in proto.graph.node if n.op_type == "MatMul"}
    ws = [numpy_helper.to_array(t) for t in proto.graph.initializer if t.name in names and len(t.dims) == 2]
    plain = same = scales_moved = blocks = codes_moved = codes = 0
    for w in ws:
        b, s = ort_kernel(w)
        p0, p1 = (nbits_inputs(quantize_rtn(w, 4, 32, True, refine=r, pack=True)) for r in (0, 1))
        plain += int(np.sum(p0["B"] != b))
        same += np.array_equal(p0["scales"], s.reshape(-1))
        scales_moved += int(np.sum(p1["scales"] != s.reshape(-1)))
        blocks, codes = blocks + s.size, codes + 2 * b.size
        codes_moved += int(np.sum((p1["B"] & 15) != (b & 15)) + np.sum((p1["B"] >> 4) != (b >> 4)))

    def mine_fn():
        return [nbits_inputs(quantize_rtn(w, 4, 32, True, pack=True)) for w in ws]

    def ort_fn():
        return [ort_kernel(w) for w in ws]
    (_, mine), (_, ort) = timed_pair(lambda: (None, _clock(mine_fn)), lambda: (None, _clock(ort_fn)), repeats)
    return [f"RTN arithmetic alone ({len(ws)} MatMul weights, {sum(w.size for w in ws) / 1e6:.2f} M values as arrays "
            f"in, B and scales out; median of {repeats}): ours {mine * 1e3:.1f} ms, onnxruntime's compiled "
            f"quantize_matmul_4bits {ort * 1e3:.1f} ms, ratio {mine / ort:.2f}. Its bytes against our plain RTN "
            f"(refine 0): scales {'identical' if same == len(ws) else 'differ'}, {plain} B bytes differ; against our "
            f"default RTN (one least-squares refit): {scales_moved} of {blocks} scales and {codes_moved} of {codes} "
            f"codes differ, so it is no fast path for ours."]


def phase_lines(proto, repeats: int) -> list[str]:
    """Where each side's RTN time goes (medians of ``repeats``; the same start and end as the table:
    ModelProto in, ModelProto out). The inner parts are timed by wrapping the functions that do
    them; ours on one thread (with the pool, the wrapped times would add up the threads')."""
    import onnx_graphsurgeon as gs
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    from qpasses.core.pipeline import PassManager
    from qpasses.ir import model as ir
    from qpasses.passes import quantize_weights as qw
    from qpasses.executors import threads as parallel
    from qpasses.weightonly import targets

    spent: dict[str, float] = {}

    def wrapped(module, name):
        inner = getattr(module, name)

        def timed_call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return inner, timed_call

    patches = [(m, n, *wrapped(m, n)) for m, n in ((ir, "validate_proto"), (gs, "import_onnx"),
                                                    (targets, "read_values"), (qw, "quantize_rtn"),
                                                    (mq, "quantize_matmul_4bits"))]
    cfg = {"mode": "weight_only", "weight_only": {"algorithm": "rtn", "format": "matmulnbits", "block_size": 32}}
    rows: list[list[float]] = []
    patches.append((parallel, "THREADS", parallel.THREADS, 1))
    for m, n, _, new in patches:
        setattr(m, n, new)
    try:
        for _ in range(repeats + 1):
            spent.clear()
            t1 = time.perf_counter()
            model = ir.load(proto)   # validates, then imports into gs
            t2 = time.perf_counter()
            PassManager("quantize-weights").run(model, RunContext(cfg))
            t3 = time.perf_counter()
            model.to_proto(metadata=False)
            t4 = time.perf_counter()
            theirs = copy.deepcopy(proto)
            t5 = time.perf_counter()
            q = mq.MatMulNBitsQuantizer(theirs, block_size=32, is_symmetric=True, bits=4,
                                        algo_config=mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True))
            q.process()
            t6 = time.perf_counter()
            check, imp, read, rtn, kernel = (spent.get(k, 0.0) for k in ("validate_proto", "import_onnx", "read_values",
                                                                         "quantize_rtn", "quantize_matmul_4bits"))
            rows.append([check, imp, t2 - t1 - check - imp, read, rtn, t3 - t2 - read - rtn, t4 - t3, t4 - t1,
                         kernel, t6 - t5 - kernel, t6 - t5])
    finally:
        for m, n, old, _ in patches:
            setattr(m, n, old)
    med = np.median(rows[1:], axis=0) * 1e3
    names = ["ours (one thread): validate_proto", "ours: gs import", "ours: rest of the load (node names, sort, metadata)",
             "ours: weights out of the proto (one copy each)", "ours: RTN arithmetic and B packing",
             "ours: rest of the pass (targets, graph edits, cleanup)", "ours: export to a ModelProto", "ours: total",
             "onnxruntime: compiled kernel", "onnxruntime: rest (proto walk, tensors in and out)", "onnxruntime: total"]
    return ["| phase (ms) | median |", "|---|---|"] + [f"| {a} | {b:.1f} |" for a, b in zip(names, med)]


def _clock(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
