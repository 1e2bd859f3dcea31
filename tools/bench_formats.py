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
slower algorithms run ``--slow-repeats`` times (default once); the two sides' runs alternate, and
their process CPU time (every thread) is printed beside, with the load average at each model's start. With
rtn, two more blocks: the RTN arithmetic alone on each side (onnxruntime's compiled kernel against
ours, and whether its bytes could stand in for ours) and where each side's RTN time goes. ``--cores 1`` runs both sides on one
CPU (onnxruntime's RTN uses a thread pool over every core, ours a thread per free core from 4 M weight
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
from qpasses.core.context import RunContext  # noqa: E402

from bench_formats_rtn import kernel_lines, phase_lines, timed_pair  # noqa: E402  (tools/bench_formats_rtn.py)

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
    started = os.getloadavg()[0]
    rows, models = [], {}
    for alg in algorithms:
        times = repeats if alg == "rtn" else slow_repeats   # the others run for seconds to minutes

        def mine(alg=alg):
            return ours(proto, alg, "matmulnbits", calib)
        row, theirs_out = {"alg": alg}, None
        if alg != "awq":
            try:   # the sides alternate, so a change of machine load falls on both
                cpu = []
                (q, secs), (theirs_out, tsecs) = timed_pair(mine, lambda: theirs(proto, alg, calib), times, cpu)
            except Exception as exc:   # an onnxruntime algorithm that cannot run here: say so
                row["ort_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        if theirs_out is None:
            q, secs = timed(mine, times)
        else:
            row.update(ort_snr=snr(ref, outputs(theirs_out, evald)), ort_secs=tsecs, cpu=cpu)
            models[f"ort_{alg}"] = theirs_out
        models[alg] = q
        row.update(snr=snr(ref, outputs(q, evald)), secs=secs)
        rows.append(row)
    qdq, _ = ours(proto, "rtn", "qdq", calib)
    lines = [f"### {name}" + (f" ({layers} layers)" if name == "decoder" else ""), "",
             f"Load average {started:.1f} when this model's timed runs began.", "",
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
    lines += ["", "Process CPU time (every thread; medians of the same runs): " + "; ".join(
        f"{r['alg']} ours {r['cpu'][0] * 1e3:.1f} ms, onnxruntime {r['cpu'][1] * 1e3:.1f} ms, ratio "
        f"{r['cpu'][0] / r['cpu'][1]:.2f}" for r in rows if r.get("cpu"))]
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
                    "onnxruntime's RTN is C++ on a thread pool, ours numpy on a thread per free core)")
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
