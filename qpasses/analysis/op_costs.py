"""What keeping a weighted op float costs: the latency onnxruntime loses against its int8 kernel.

An op's *pattern* is its kind (a Conv by kernel: 1x1, up to 3x3, larger; depthwise 3x3 or larger;
ConvTranspose; MatMul/Gemm) with its input channels, output channels and positions (a Conv's output
positions, a ConvTranspose's input positions, a MatMul's rows) in three buckets each. A pattern's
cost is picoseconds lost per multiply-accumulate: the one-op model as qpasses leaves it float
(the op reads the float tensor, as insert-qdq makes a float weight's reader do, so that onnxruntime
does not requantize the weight; a QuantizeLinear after a Conv) against its int8 QDQ form (uint8 in,
DequantizeLinear, U8S8 per-channel weights, int32 bias, as onnxruntime's quantize_static makes it
and fuses into QLinearConv / MatMulIntegerToFloat), one thread, runs interleaved. The table shipped
(``op_costs.json``, written by tools/measure_op_costs.py, which says the machine) is the default, so
decisions do not depend on timings; ``measured`` times the patterns a model holds on this machine
instead, cached per CPU and onnxruntime version. A negative cost (int8 slower, as depthwise Convs
run) counts as nothing.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper

from ..ir.graphutil import weight_positions
from ..quant.oprules import WEIGHTED_OPS

SHIPPED = Path(__file__).with_name("op_costs.json")
KINDS = ("conv1x1", "conv3x3", "convkxk", "depthwise3x3", "depthwisekxk", "convtranspose", "matmul")
# bucket edges (a value up to the first edge is bucket 0) and each bucket's representative size
CHANNELS = ((16, 96), (12, 48, 192))
FEATURES = ((128, 512), (64, 256, 768))   # a MatMul's reduction and output columns
POSITIONS = ((32 * 32, 96 * 96), (16 * 16, 56 * 56, 128 * 128))   # reps are squares
ROWS = ((16, 256), (8, 128, 512))


def _bucket(value: float | None, edges: tuple) -> int:
    if value is None:
        return len(edges) // 2   # unknown: the middle
    return sum(value > e for e in edges)


def key(kind: str, cin: int, cout: int, pos: int) -> str:
    return f"{kind}|{cin}|{cout}|{pos}"


def pattern(node: gs.Node) -> str | None:
    """The pattern of a weighted op with a constant weight (None: not one)."""
    if node.op not in WEIGHTED_OPS or len(node.inputs) < 2 \
            or not isinstance(node.inputs[1], gs.Constant):
        return None
    w = node.inputs[1].values
    positions = weight_positions(node)
    if node.op in ("Gemm", "MatMul"):
        if w.ndim < 2:
            return None
        k, n = w.shape[-2:]
        if node.op == "Gemm" and node.attrs.get("transB", 0):
            k, n = n, k
        return key("matmul", _bucket(k, FEATURES[0]), _bucket(n, FEATURES[0]), _bucket(positions, ROWS[0]))
    if w.ndim < 3:
        return None
    group = int(node.attrs.get("group", 1))
    kernel = int(np.prod(w.shape[2:]))
    pos = _bucket(positions, POSITIONS[0])
    if node.op == "ConvTranspose":
        return key("convtranspose", _bucket(w.shape[0] // group, CHANNELS[0]), _bucket(w.shape[1], CHANNELS[0]), pos)
    if group > 1 and w.shape[1] == 1:
        return key("depthwise3x3" if kernel <= 9 else "depthwisekxk", 0, _bucket(w.shape[0], CHANNELS[0]), pos)
    kind = "conv1x1" if kernel == 1 else "conv3x3" if kernel <= 9 else "convkxk"
    return key(kind, _bucket(w.shape[1], CHANNELS[0]), _bucket(w.shape[0] // group, CHANNELS[0]), pos)


def grid() -> list[str]:
    """Every pattern (the table's rows)."""
    out = []
    for kind in KINDS:
        for cin in range(3):
            if kind.startswith("depthwise") and cin:
                continue
            out += [key(kind, cin, cout, pos) for cout in range(3) for pos in range(3)]
    return out


def ps_per_mac(table: dict, name: str) -> float:
    """The table's cost of pattern ``name``, never below 0; a pattern it lacks: the nearest one of
    the same kind (bucket steps; ties by name), else the median of the table (0 when empty)."""
    if name in table:
        return max(0.0, float(table[name]))
    kind, *at = name.split("|")
    same = [k for k in table if k.split("|")[0] == kind]
    if same:
        near = min(same, key=lambda k: (sum(abs(int(a) - int(b)) for a, b in zip(at, k.split("|")[1:])), k))
        return max(0.0, float(table[near]))
    return max(0.0, statistics.median(map(float, table.values()))) if table else 0.0


@lru_cache(maxsize=1)
def shipped() -> dict:
    """Pattern -> picoseconds lost per multiply-accumulate, from the table shipped."""
    return dict(json.loads(SHIPPED.read_text())["ps_per_mac"])


def costs(nodes: list[gs.Node], macs: dict[int, float], table: dict) -> dict[int, float]:
    """id(node) -> picoseconds lost per run if it runs float, for weighted ops with ``macs``."""
    return {id(node): ps_per_mac(table, pattern(node) or "") * macs[id(node)] for node in nodes}


# measuring

def one_op_models(name: str, seed: int = 0) -> tuple[bytes, bytes, tuple[dict, dict], float]:
    """(float form, int8 QDQ form, their feeds, multiply-accumulates) of the representative op of
    pattern ``name``."""
    kind, cin_b, cout_b, pos_b = name.split("|")
    cin_b, cout_b, pos_b = int(cin_b), int(cout_b), int(pos_b)
    rng = np.random.default_rng(seed)
    if kind == "matmul":
        k, n, rows = FEATURES[1][cin_b], FEATURES[1][cout_b], ROWS[1][pos_b]
        x_shape, w_shape, y_shape, axis, macs = [rows, k], [k, n], [rows, n], 1, float(rows * k * n)
        op, attrs, out_q = "MatMul", {}, False
    else:
        side = int(math.isqrt(POSITIONS[1][pos_b]))
        cout = CHANNELS[1][cout_b]
        if kind == "convtranspose":
            cin = CHANNELS[1][cin_b]
            x_shape, w_shape, y_shape, axis = [1, cin, side, side], [cin, cout, 2, 2], [1, cout, 2 * side, 2 * side], 1
            op, attrs, macs = "ConvTranspose", {"strides": [2, 2]}, float(cin * cout * 4 * side * side)
        else:
            k = 1 if kind == "conv1x1" else 3 if kind in ("conv3x3", "depthwise3x3") else 5
            depthwise = kind.startswith("depthwise")
            cin = cout if depthwise else CHANNELS[1][cin_b]
            x_shape, w_shape, axis = [1, cin, side, side], [cout, 1 if depthwise else cin, k, k], 0
            y_shape = [1, cout, side, side]
            op, attrs = "Conv", {"pads": [k // 2] * 4, **({"group": cout} if depthwise else {})}
            macs = float(w_shape[0] * w_shape[1] * k * k * side * side)
        out_q = True
    w = rng.standard_normal(w_shape).astype(np.float32) * 0.05
    channels = w_shape[axis]
    reduce = tuple(i for i in range(w.ndim) if i != axis)
    w_scale = (np.abs(w).max(axis=reduce) / 127).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = channels
    w_q = np.clip(np.round(w / w_scale.reshape(shape)), -127, 127).astype(np.int8)
    x_scale, bias = np.float32(0.02), (rng.standard_normal(channels) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(x_scale, "xs"), numpy_helper.from_array(np.uint8(128), "xz"),
             numpy_helper.from_array(np.float32(0.05), "ys"), numpy_helper.from_array(np.uint8(128), "yz")]
    out = "yf" if out_q else "y"

    def model(x_type, weight_nodes, weight_inits, inputs):
        body = weight_nodes + [helper.make_node(op, inputs, [out], **attrs)]
        body += [helper.make_node("QuantizeLinear", ["yf", "ys", "yz"], ["y"])] if out_q else []
        if x_type == TensorProto.UINT8:
            body.insert(0, helper.make_node("DequantizeLinear", ["x", "xs", "xz"], ["xf"]))
        graph = helper.make_graph(body, "one_op", [helper.make_tensor_value_info("x", x_type, x_shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.UINT8 if out_q else TensorProto.FLOAT,
                                                                 y_shape)], inits + weight_inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()

    with_bias = op != "MatMul"
    floated = model(TensorProto.FLOAT, [], [numpy_helper.from_array(w, "w")]
                    + ([numpy_helper.from_array(bias, "b")] if with_bias else []), ["x", "w"] + (["b"] if with_bias else []))
    b_scale = (x_scale * w_scale).astype(np.float32)
    q_inits = [numpy_helper.from_array(w_q, "wq"), numpy_helper.from_array(w_scale, "ws"),
               numpy_helper.from_array(np.zeros(channels, np.int8), "wz")]
    q_nodes = [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=axis)]
    if with_bias:
        q_inits += [numpy_helper.from_array(np.round(bias / b_scale).astype(np.int32), "bq"),
                    numpy_helper.from_array(b_scale, "bs"), numpy_helper.from_array(np.zeros(channels, np.int32), "bz")]
        q_nodes += [helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["b"], axis=0)]
    quantized = model(TensorProto.UINT8, q_nodes, q_inits, ["xf", "w"] + (["b"] if with_bias else []))
    codes = rng.integers(0, 256, x_shape, dtype=np.uint8)
    feeds = ({"x": ((codes.astype(np.float32) - 128) * x_scale)}, {"x": codes})
    return floated, quantized, feeds, macs


def measure(name: str, seconds: float = 0.3, least: int = 5) -> float:
    """Picoseconds per multiply-accumulate pattern ``name``'s float form loses against its int8 form:
    medians of one-thread runs, interleaved, at least ``least`` each and ``seconds`` of both."""
    from ..calibration.sessions import ort_session

    floated, quantized, feeds, macs = one_op_models(name)
    runs = [ort_session(m, optimization="all", threads=1) for m in (floated, quantized)]
    times: list[list[float]] = [[], []]
    for sess, feed in zip(runs, feeds):   # warm-up
        sess.run(None, feed)
    began = time.perf_counter()
    while len(times[0]) < least or time.perf_counter() - began < seconds:
        for sess, feed, spent in zip(runs, feeds, times):
            start = time.perf_counter()
            sess.run(None, feed)
            spent.append(time.perf_counter() - start)
        if len(times[0]) >= 200:
            break
    return (statistics.median(times[0]) - statistics.median(times[1])) * 1e12 / macs


def machine() -> dict:
    """What a measurement depends on: the CPU's model and flags, onnxruntime's version."""
    import onnxruntime

    cpu, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("", platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        pass
    return {"cpu": cpu, "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "onnxruntime": onnxruntime.__version__}


def cache_path() -> Path:
    """~/.cache/qpasses/op-costs/<CPU flags and onnxruntime version>.json (XDG_CACHE_HOME honoured)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    about = machine()
    tag = hashlib.sha256(f"{about['flags_sha256']} {about['onnxruntime']}".encode()).hexdigest()[:16]
    return base / "qpasses" / "op-costs" / f"{tag}.json"


def measured(names, path: Path | None = None) -> dict:
    """Pattern -> picoseconds per multiply-accumulate on this machine for ``names``, read from the
    cache at ``path`` (cache_path()) where it holds them, else measured and added to it. A cache that
    cannot be read is measured again; one that cannot be written is not kept."""
    path = cache_path() if path is None else path
    try:
        known = json.loads(path.read_text())["ps_per_mac"]
        known = {str(k): float(v) for k, v in known.items() if math.isfinite(float(v))}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        known = {}
    wanted = sorted(set(names))
    missing = [n for n in wanted if n not in known]
    for name in missing:
        known[name] = measure(name)
    if missing:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
                json.dump({"machine": machine(), "ps_per_mac": known}, f, indent=1, sort_keys=True)
            os.replace(f.name, path)
        except OSError:
            pass
    return {n: known[n] for n in wanted}
