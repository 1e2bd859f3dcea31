"""Weight-only int4 (block 32) side by side with onnxruntime's matmul_nbits_quantizer, in one run.

    python tools/bench_formats.py [--models decoder,encoder_block] [--layers 4] [--algorithms rtn,hqq,gptq,awq]
                                  [--tables nbits,mx] [--cores 1] [--repeats 5] [--slow-repeats 1]

Models: ``decoder``, a GPT-2-small-shaped pre-LN decoder stack built here with onnx.helper (d 768,
12 heads, MLP 3072, causal attention, tanh-free erf GELU, ``--layers`` layers, seeded weights; the
LayerNorm gains of 3 residual channels are 20-60x the others, as the outlier dimensions of trained
GPT-2) and ``encoder_block`` (tools/models.py). Per algorithm: output SNR on held-out data, the
time to quantize (ModelProto in, ModelProto out, both sides; onnxruntime's quantizer edits its
input, so it is given a copy made before its timer starts) and its ratio to onnxruntime's, and the
median latency of the MatMulNBits models (ours / onnxruntime's RTN, runs interleaved). RTN times are
the median of ``--repeats`` runs after a warm-up (first-call imports excluded on both sides); the
slower algorithms run ``--slow-repeats`` times (default once). ``--cores 1`` runs both sides on one
CPU (onnxruntime's RTN uses a thread pool over every core, ours a thread per core from 4 M weight
values). numpy's BLAS runs on one thread on both sides (OPENBLAS_NUM_THREADS=1 unless set): on 2
shared cores its threads thrash (a 1024 x 1024 Cholesky took 2.5 s threaded, 0.1 s on one thread).
onnxruntime's RTN is its DEFAULT algorithm (C++), HQQ and GPTQ its own implementations; AWQ has no
onnxruntime CPU counterpart (nvidia_awq needs ModelOpt and a tokenizer) and is compared with our
RTN. ``--tables mx`` adds the MX schemes (tools/bench_formats_mx.py). Needs onnx-ir (onnxruntime's
quantizer imports it) and torch (its HQQ).
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # both sides' numpy/LAPACK on one thread (2 shared cores)

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import FeedReader  # noqa: E402  (tools/models.py)
os.environ.setdefault("QPASSES_NO_PROGRESS", "1")
logging.disable(logging.WARNING)

from qpasses.api import run_pipeline  # noqa: E402
from qpasses.context import RunContext  # noqa: E402

D, HEADS, FF, SEQ = 768, 12, 3072, 64


def decoder(layers: int, seed: int = 0) -> onnx.ModelProto:
    """A pre-LN GPT-2-shaped decoder stack: input ``hidden`` (1, SEQ, D) -> output ``out`` (1, SEQ, D)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, ins, name, **attrs):
        nodes.append(helper.make_node(op, ins, [name], name=name, **attrs))
        return name

    def linear(x, k, n, name):
        w = const(f"{name}.w", (rng.standard_normal((k, n)) * 0.02).astype(np.float32))
        b = const(f"{name}.b", (rng.standard_normal(n) * 0.01).astype(np.float32))
        return node("Add", [node("MatMul", [x, w], f"{name}.mm"), b], f"{name}.out")

    def layernorm(x, name):
        gain = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        gain[[11, 373, 590]] = [20.0, 40.0, 60.0]   # trained-like outlier channels
        return node("LayerNormalization", [x, const(f"{name}.g", gain), const(f"{name}.b", np.zeros(D, np.float32))],
                    f"{name}.out", axis=-1, epsilon=1e-5)

    heads = const("heads_shape", np.array([1, SEQ, HEADS, D // HEADS], np.int64))
    merged = const("merged_shape", np.array([1, SEQ, D], np.int64))
    mask = const("causal", np.triu(np.full((SEQ, SEQ), -1e4, np.float32), 1))
    scale = const("attn_scale", np.array(1 / np.sqrt(D // HEADS), np.float32))
    half, one, sqrt2 = const("half", np.array(0.5, np.float32)), const("one", np.array(1, np.float32)), \
        const("sqrt2", np.array(np.sqrt(2), np.float32))
    x = "hidden"
    for i in range(layers):
        p = f"h{i}"
        qkv = linear(layernorm(x, f"{p}.ln1"), D, 3 * D, f"{p}.qkv")
        parts = [f"{p}.{t}" for t in "qkv"]
        nodes.append(helper.make_node("Split", [qkv, const(f"{p}.split", np.array([D] * 3, np.int64))], parts,
                                      name=f"{p}.split", axis=-1))
        q, k, v = (node("Transpose", [node("Reshape", [t, heads], f"{t}.r")], f"{t}.t", perm=[0, 2, 1, 3])
                   for t in parts)
        kt = node("Transpose", [k], f"{p}.kt", perm=[0, 1, 3, 2])
        scores = node("Add", [node("Mul", [node("MatMul", [q, kt], f"{p}.qk"), scale], f"{p}.sc"), mask], f"{p}.masked")
        ctx = node("MatMul", [node("Softmax", [scores], f"{p}.probs", axis=-1), v], f"{p}.ctx")
        ctx = node("Reshape", [node("Transpose", [ctx], f"{p}.ctx.t", perm=[0, 2, 1, 3]), merged], f"{p}.ctx.m")
        x = node("Add", [x, linear(ctx, D, D, f"{p}.proj")], f"{p}.res1")
        h = linear(layernorm(x, f"{p}.ln2"), D, FF, f"{p}.fc")
        gelu = node("Mul", [node("Mul", [h, half], f"{p}.gh"),
                            node("Add", [node("Erf", [node("Div", [h, sqrt2], f"{p}.gd")], f"{p}.ge"), one], f"{p}.ga")],
                    f"{p}.gelu")
        x = node("Add", [x, linear(gelu, FF, D, f"{p}.fc2")], f"{p}.res2")
    nodes.append(helper.make_node("Identity", [x], ["out"], name="out"))
    graph = helper.make_graph(nodes, "decoder", [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, SEQ, D])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, SEQ, D])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def decoder_data(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"hidden": rng.standard_normal((1, SEQ, D)).astype(np.float32)} for _ in range(count)]


def load(name: str, layers: int):
    if name == "decoder":
        return decoder(layers), decoder_data(32, 1), decoder_data(8, 2)
    from models import encoder_block, encoder_data   # tools/models.py

    def split(d):
        return [{k: v[i] for k, v in d.items()} for i in range(len(next(iter(d.values()))))]
    return encoder_block(), split(encoder_data(16, 1)), split(encoder_data(8, 2))


def session(proto):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def outputs(proto, feeds):
    s = session(proto)
    return [s.run(None, f)[0] for f in feeds]


def snr(ref, out) -> float:
    num = sum(float(np.sum(r.astype(np.float64) ** 2)) for r in ref)
    den = sum(float(np.sum((r.astype(np.float64) - o) ** 2)) for r, o in zip(ref, out))
    return 10 * np.log10(num / den)


def latencies(protos, feed, repeats: int = 100) -> list[float]:
    """Median seconds per run of each model (1 thread), runs interleaved round-robin after 5
    warm-up runs each, so a change of machine load falls on every model alike."""
    sessions = [session(p) for p in protos]
    for s in sessions:
        for _ in range(5):
            s.run(None, feed)
    times = [[] for _ in sessions]
    for r in range(repeats):
        order = range(len(sessions)) if r % 2 == 0 else reversed(range(len(sessions)))
        for i in order:
            t = time.perf_counter()
            sessions[i].run(None, feed)
            times[i].append(time.perf_counter() - t)
    return [float(np.median(t)) for t in times]


def timed(fn, repeats: int):
    """(result, median seconds) of ``repeats`` calls after one untimed call when repeats > 1."""
    if repeats > 1:
        fn()
    results = [fn() for _ in range(repeats)]
    return results[-1][0], float(np.median([r[1] for r in results]))


def timed_pair(a, b, repeats: int):
    """timed() of two functions, their calls alternating (a load change falls on both sides alike)."""
    if repeats > 1:
        a(), b()
    runs = [(a(), b()) if i % 2 == 0 else tuple(reversed((b(), a()))) for i in range(repeats)]
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
    ModelProto in, ModelProto out). The inner parts are timed by wrapping the functions that do them."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    from qpasses import ir
    from qpasses.passes import quantize_weights as qw
    from qpasses.pipeline import PassManager
    from qpasses.validate import validate_proto
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

    patches = [(m, n, *wrapped(m, n)) for m, n in ((targets, "read_values"), (qw, "quantize_rtn"),
                                                    (mq, "quantize_matmul_4bits"))]
    cfg = {"mode": "weight_only", "weight_only": {"algorithm": "rtn", "format": "matmulnbits", "block_size": 32}}
    rows: list[list[float]] = []
    for m, n, _, new in patches:
        setattr(m, n, new)
    try:
        for _ in range(repeats + 1):
            spent.clear()
            t0 = time.perf_counter()
            validate_proto(proto)
            t1 = time.perf_counter()
            model = ir.load(proto)   # validates again, then imports into gs
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
            read, rtn, kernel = (spent.get(k, 0.0) for k in ("read_values", "quantize_rtn", "quantize_matmul_4bits"))
            rows.append([t1 - t0, t2 - t1 - (t1 - t0), read, rtn, t3 - t2 - read - rtn, t4 - t3, t4 - t1,
                         kernel, t6 - t5 - kernel, t6 - t5])
    finally:
        for m, n, old, _ in patches:
            setattr(m, n, old)
    med = np.median(rows[1:], axis=0) * 1e3
    names = ["ours: validate_proto", "ours: gs import", "ours: weights out of the proto (one copy each)",
             "ours: RTN arithmetic and B packing", "ours: rest of the pass (targets, graph edits, cleanup)",
             "ours: export to a ModelProto", "ours: total", "onnxruntime: compiled kernel",
             "onnxruntime: rest (proto walk, tensors in and out)", "onnxruntime: total"]
    return ["| phase (ms) | median |", "|---|---|"] + [f"| {a} | {b:.1f} |" for a, b in zip(names, med)]


def _clock(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ours(proto, algorithm, fmt, calib, **extra):
    extra = {"bits": 4, **extra} if "scheme" not in extra else extra   # an MX scheme fixes its element bits
    cfg = {"mode": "weight_only", "weight_only": {"algorithm": algorithm, "format": fmt, "block_size": 32, **extra}}
    t = time.perf_counter()   # qpasses reads the proto without changing it: no copy
    model, _ = run_pipeline(proto, "quantize-weights", ctx=RunContext(cfg, calib))
    out = model.to_proto(metadata=False)
    return out, time.perf_counter() - t


def theirs(proto, algorithm, calib):
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    config = {"rtn": lambda: mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, bits=4),
              "hqq": lambda: mq.HQQWeightOnlyQuantConfig(block_size=32, bits=4),
              "gptq": lambda: mq.GPTQWeightOnlyQuantConfig(calibration_data_reader=FeedReader(calib))}[algorithm]()
    proto = copy.deepcopy(proto)   # onnxruntime's quantizer edits the proto it is given: copied untimed
    t = time.perf_counter()
    q = mq.MatMulNBitsQuantizer(proto, block_size=32, is_symmetric=True, bits=4, algo_config=config)
    q.process()
    out = q.model.model
    return out, time.perf_counter() - t


def _secs(x: float) -> str:
    return f"{x:.4f}" if x < 0.1 else f"{x:.3f}" if x < 1 else f"{x:.2f}"


def run(name: str, layers: int, algorithms: list[str], repeats: int, slow_repeats: int = 1) -> list[str]:
    proto, calib, evald = load(name, layers)
    ref = outputs(proto, evald)
    rows, models = [], {}
    for alg in algorithms:
        if alg == "rtn":   # the sides alternate, so a change of machine load falls on both
            (q, secs), (tq, tsecs) = timed_pair(lambda: ours(proto, alg, "matmulnbits", calib),
                                                lambda: theirs(proto, alg, calib), repeats)
        else:              # the others run for seconds to minutes
            q, secs = timed(lambda: ours(proto, alg, "matmulnbits", calib), slow_repeats)
        models[alg] = q
        row = {"alg": alg, "snr": snr(ref, outputs(q, evald)), "secs": secs}
        if alg != "awq":
            try:
                if alg != "rtn":
                    tq, tsecs = timed(lambda: theirs(proto, alg, calib), slow_repeats)
                row.update(ort_snr=snr(ref, outputs(tq, evald)), ort_secs=tsecs)
                models[f"ort_{alg}"] = tq
            except Exception as exc:   # an onnxruntime algorithm that cannot run here: say so
                row["ort_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        rows.append(row)
    qdq, _ = ours(proto, "rtn", "qdq", calib)
    lines = [f"### {name}" + (f" ({layers} layers)" if name == "decoder" else ""), "",
             "| algorithm | SNR ours (dB) | SNR onnxruntime (dB) | ours - ort (dB) | time ours (s) | time ort (s) | time ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ort_snr" in r:
            lines.append(f"| {r['alg']} | {r['snr']:.2f} | {r['ort_snr']:.2f} | {r['snr'] - r['ort_snr']:+.2f} | "
                         f"{_secs(r['secs'])} | {_secs(r['ort_secs'])} | {r['secs'] / r['ort_secs']:.2f} |")
        else:
            rtn = next((x["snr"] for x in rows if x["alg"] == "rtn"), float("nan"))
            note = f"vs our rtn {r['snr'] - rtn:+.2f}" if r["alg"] == "awq" else r.get("ort_error", "")
            lines.append(f"| {r['alg']} | {r['snr']:.2f} | - | {note} | {_secs(r['secs'])} | - | - |")
    lines.append(f"| rtn as QDQ (DequantizeLinear block 32) | {snr(ref, outputs(qdq, evald)):.2f} | | | | | |")
    if "rtn" in algorithms:
        lines += [""] + kernel_lines(proto, repeats) + [""] + phase_lines(proto, repeats)
    if "rtn" in models and "ort_rtn" in models:
        a, b, f, d = latencies([models["rtn"], models["ort_rtn"], proto, qdq], evald[0])
        lines += ["", f"MatMulNBits latency (1 thread, median of 100 interleaved runs): ours {a * 1e3:.2f} ms, "
                      f"onnxruntime's {b * 1e3:.2f} ms, ratio {a / b:.3f}; float {f * 1e3:.2f} ms; QDQ rtn {d * 1e3:.2f} ms"]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="decoder,encoder_block")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--algorithms", default="rtn,hqq,gptq,awq")
    ap.add_argument("--tables", default="nbits,mx", help="nbits: int4 against onnxruntime's quantizer; "
                    "mx: the MX schemes beside int8 per channel and int4 block 32 (tools/bench_formats_mx.py)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rtn runs per side (median, after one warm-up)")
    ap.add_argument("--slow-repeats", type=int, default=1, help="timed hqq/gptq/awq runs per side (median, "
                    "after one warm-up when > 1)")
    ap.add_argument("--cores", type=int, default=0, help="run both sides on this many CPUs (default: all; "
                    "onnxruntime's RTN is C++ on a thread pool, ours numpy on a thread per core)")
    args = ap.parse_args(argv)
    if args.cores:
        cpus = sorted(os.sched_getaffinity(0))
        if not 0 < args.cores <= len(cpus):
            print(f"bench_formats: --cores must be 1..{len(cpus)}", file=sys.stderr)
            return 2
        os.sched_setaffinity(0, cpus[:args.cores])
    try:
        import onnx_ir  # noqa: F401
    except ImportError:
        print("bench_formats: onnxruntime's matmul_nbits_quantizer needs onnx-ir: pip install onnx-ir", file=sys.stderr)
        return 2
    print(f"CPUs: {len(os.sched_getaffinity(0))} of {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}\n", flush=True)
    tables = args.tables.split(",")
    for name in args.models.split(","):
        if "nbits" in tables:
            print("\n".join(run(name, args.layers, args.algorithms.split(","), args.repeats, args.slow_repeats)),
                  flush=True)
            print()
        if "mx" in tables:
            from bench_formats_mx import mx_table   # tools/bench_formats_mx.py
            print("\n".join(mx_table(name, *load(name, args.layers), ours, outputs, snr, args.layers)), flush=True)
            print()
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
