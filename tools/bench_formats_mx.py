"""The MX table of bench_formats.py (``--tables mx``): weight-only MX schemes beside int8 per
channel and int4 / int8 block-32 RTN, on the same model and held-out data, qpasses only.

Rows: int8 per channel (symmetric amax / 127, RTN, a per-axis DequantizeLinear built here as the
plain reference), our int4 and int8 block-32 RTN (QDQ), then each MX scheme with the spec's block
exponent only (``mx.NEIGHBOURS = (0,)``), with the neighbouring exponents searched (the default),
GPTQ and AWQ. SNR with graph optimizations off (the weights' own error) and at onnxruntime's default
level (see unfused_outputs); times are one run each (qpasses, ModelProto in and out). Size is the serialized model; bits per weight count the elements plus a float32 scale
per block (an E8M0 scale would be 8 bits: 0.25 bit per weight fewer at block 32)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from qpasses.weightonly import mx


def per_channel_int8(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Every constant 2-D MatMul weight as int8 per output channel behind a DequantizeLinear(axis 1)."""
    out = onnx.ModelProto.FromString(proto.SerializeToString())
    inits = {i.name: i for i in out.graph.initializer}
    nodes = []
    for node in out.graph.node:
        name = node.input[1] if node.op_type == "MatMul" else None
        if name in inits and len(inits[name].dims) == 2:
            w = numpy_helper.to_array(inits[name]).astype(np.float32)
            scale = (np.abs(w).max(axis=0) / 127).astype(np.float32)
            q = np.clip(np.rint(w / np.where(scale == 0, 1, scale)), -127, 127).astype(np.int8)
            inits[name].CopyFrom(numpy_helper.from_array(q, name))
            out.graph.initializer.append(numpy_helper.from_array(scale, f"{name}_scale"))
            nodes.append(helper.make_node("DequantizeLinear", [name, f"{name}_scale"], [f"{name}_dq"], axis=1))
            node.input[1] = f"{name}_dq"
        nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.opset_import[0].version = max(out.opset_import[0].version, 13)
    return out


def unfused_outputs(proto, feeds):
    """Outputs with graph optimizations off: the weights' own error (at the default level onnxruntime
    fuses an int4/int8 block-wise DequantizeLinear + MatMul into MatMulNBits with accuracy_level 4,
    which also quantizes the activations to int8 per block)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return [s.run(None, f)[0] for f in feeds]


def _row(label, model, ref, evald, outputs, snr, secs, bits, base_mb) -> str:
    mb = len(model.SerializeToString()) / 1e6
    return (f"| {label} | {snr(ref, unfused_outputs(model, evald)):.2f} | {snr(ref, outputs(model, evald)):.2f} | "
            f"{mb:.2f} | {mb / base_mb:.3f} | {bits} | {'-' if secs is None else f'{secs:.3f}'} |")


def mx_table(name, proto, calib, evald, ours, outputs, snr, layers) -> list[str]:
    ref = outputs(proto, evald)
    base_mb = len(proto.SerializeToString()) / 1e6
    head = [f"### {name}: MX schemes" + (f" ({layers} layers)" if name == "decoder" else ""), "",
            f"float model {base_mb:.2f} MB; size ratio = quantized / float model",
            "", "| weights | SNR unfused (dB) | SNR default level (dB) | size (MB) | size ratio | bits per weight | "
            "time (s) |", "|---|---|---|---|---|---|---|"]
    ours(proto, "rtn", "qdq", calib)   # warm-up: first-call imports are not timed
    rows = [_row("int8 per channel, RTN", per_channel_int8(proto), ref, evald, outputs, snr, None, "8", base_mb)]
    for bits in (4, 8):
        q, secs = ours(proto, "rtn", "qdq", calib, bits=bits)
        rows.append(_row(f"int{bits} block 32, rtn", q, ref, evald, outputs, snr, secs, f"{bits} + 1", base_mb))
    saved = mx.NEIGHBOURS
    try:
        for scheme, element in mx.ELEMENTS.items():
            stored = 8 if scheme == "mxfp4" else element.bits
            for label, alg, neighbours in (("rtn, spec exponent", "rtn", (0,)), ("rtn, best of 3 exponents", "rtn", saved),
                                           ("gptq, best of 3 exponents", "gptq", saved),
                                           ("awq, best of 3 exponents", "awq", saved)):
                mx.NEIGHBOURS = neighbours
                q, secs = ours(proto, alg, "qdq", calib, scheme=scheme)
                rows.append(_row(f"{scheme} {label}", q, ref, evald, outputs, snr, secs,
                                 f"{stored} + 1" + (" (E2M1 in float8)" if scheme == "mxfp4" else ""), base_mb))
    finally:
        mx.NEIGHBOURS = saved
    return head + rows
