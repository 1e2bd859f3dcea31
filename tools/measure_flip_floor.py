"""The floor under a classifier's int8 top-1 agreement (issue 32): how many eval samples flip top-1
against the float model (onnxruntime's default session) under perturbations of known size.

Rows, run unoptimized: ``bn-fold`` the model after onnxruntime's basic optimizations (BatchNorm and
Constants folded into initializers: rounding order only), the base of the others; ``fp16-w`` its
initializers rounded to float16; ``int8-w`` Conv/ConvTranspose/Gemm/MatMul weights int8 symmetric per
output channel, nearest; ``u8-act-in`` those ops' data inputs fake-quantized uint8 per tensor
(calibration min/max, 0 included), ``u8-act`` every float activation so, ``int8-w+u8-act`` both;
``noise-E`` the input plus Gaussian noise of E times its RMS. For each row and each quantized model
given: agreement, output SNR (of the softmax of logits), flipped samples with their float top-1
margin (softmax top-1 minus top-2). With ``--task NAME`` (a tools/accuracy_models.py model: any
model, a detector or OCR too) each row gives that task metric against the float model instead.

    python tools/measure_flip_floor.py MODEL.onnx CALIB.npz EVAL.npz [QUANTIZED.onnx ...]
    python tools/measure_flip_floor.py MODEL.onnx CALIB.npz EVAL.npz --task crnn_lstm
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

WEIGHTED = {"Conv": 0, "ConvTranspose": 1, "MatMul": -1, "Gemm": None}   # the weight's output-channel axis


def load_feeds(path):
    arrays = dict(np.load(path))
    return [{k: a[i] for k, a in arrays.items()} for i in range(min(len(a) for a in arrays.values()))]


def session(model, level=None, out=""):
    """A file in onnxruntime's default session; a model built here without optimizations."""
    opts, given = ort.SessionOptions(), isinstance(model, str)
    opts.log_severity_level, opts.optimized_model_filepath = 3, out
    opts.graph_optimization_level = level if level is not None else \
        getattr(ort.GraphOptimizationLevel, "ORT_ENABLE_ALL" if given else "ORT_DISABLE_ALL")
    return ort.InferenceSession(model if given else model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def first_output(model, feeds):   # (samples, rows, classes)
    sess = session(model)
    outs = [np.asarray(sess.run(None, f)[0], np.float64) for f in feeds]
    return np.stack([o.reshape(-1, o.shape[-1]) for o in outs])


def noisy(feeds, eps, seed):
    rng = np.random.default_rng(seed)
    return [{k: (v + eps * np.sqrt(np.mean(v.astype(np.float64) ** 2)) * rng.standard_normal(v.shape)).astype(v.dtype)
             for k, v in f.items()} for f in feeds]


def with_inits(model, change):
    m = copy.deepcopy(model)
    for init in m.graph.initializer:
        new = change(init.name, numpy_helper.to_array(init))
        if new is not None:
            init.CopyFrom(numpy_helper.from_array(new.astype(np.float32), init.name))
    return m


def int8_weights(model):
    axes = {n.input[1]: WEIGHTED[n.op_type] if n.op_type != "Gemm"   # Gemm: by transB
            else int(not any(a.name == "transB" and a.i for a in n.attribute))
            for n in model.graph.node if n.op_type in WEIGHTED}

    def change(name, w):
        if name not in axes or w.dtype != np.float32 or w.ndim < 2:
            return None
        axis = axes[name] % w.ndim
        amax = np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i != axis), keepdims=True)
        scale = np.where(amax > 0, amax / 127.0, 1.0)
        return np.clip(np.round(w / scale), -128, 127) * scale
    return with_inits(model, change)


def fake_quant_acts(model, calib, inputs_only):
    names = ({n.input[0] for n in model.graph.node if n.op_type in WEIGHTED} if inputs_only else
             {o for n in model.graph.node for o in n.output} - {o.name for o in model.graph.output}
             | {i.name for i in model.graph.input})
    probe, names = copy.deepcopy(model), sorted(names - {i.name for i in model.graph.initializer})
    probe.graph.output.extend(helper.make_empty_tensor_value_info(t) for t in names)
    sess = session(probe)
    lo, hi = {}, {}
    for f in calib:
        for t, v in zip(names, sess.run(names, f)):
            if np.asarray(v).dtype == np.float32:
                lo[t], hi[t] = min(lo.get(t, 0.0), float(v.min())), max(hi.get(t, 0.0), float(v.max()))
    m, pairs = copy.deepcopy(model), {}
    for t in lo:
        scale = max(hi[t] - lo[t], 1e-12) / 255.0
        zp = int(np.clip(np.round(-lo[t] / scale), 0, 255))
        m.graph.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), t + "_fq_s"),
                                    numpy_helper.from_array(np.array(zp, np.uint8), t + "_fq_z")])
        pairs[t] = [helper.make_node("QuantizeLinear", [t, t + "_fq_s", t + "_fq_z"], [t + "_fq_q"]),
                    helper.make_node("DequantizeLinear", [t + "_fq_q", t + "_fq_s", t + "_fq_z"], [t + "_fq"])]
    order = [q for i in m.graph.input for q in pairs.get(i.name, ())]
    for n in m.graph.node:   # each pair right after its producer: the order stays topological
        n.input[:] = [x + "_fq" if x in lo else x for x in n.input]
        order += [n] + [q for o in n.output for q in pairs.get(o, ())]
    del m.graph.node[:]
    m.graph.node.extend(order)
    return m, len(lo)


def perturbed(args, calib) -> list:
    """(label, model, (noise, seed) or None) per row."""
    with tempfile.TemporaryDirectory() as tmp:
        session(args.model, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, os.path.join(tmp, "basic.onnx"))
        base = onnx.load(os.path.join(tmp, "basic.onnx"))
    rows = [("bn-fold", base, None), ("int8-w", int8_weights(base), None),
            ("fp16-w", with_inits(base, lambda n, w: w.astype(np.float16) if w.dtype == np.float32 else None), None)]
    for label, model, only in (("u8-act-in", base, True), ("u8-act", base, False),
                               ("int8-w+u8-act", int8_weights(base), False)):
        m, count = fake_quant_acts(model, calib, only)
        rows.append((f"{label} ({count} tensors)", m, None))
    return rows + [(f"noise-{eps:g} seed {seed}", base, (eps, seed))
                   for eps in map(float, args.noise.split(",")) for seed in range(args.seeds)]


def by_task(args, rows, feeds) -> int:
    """The task metric (accuracy_models.task_metric) of every row and quantized model against the float model."""
    from accuracy_models import task_metric

    def outputs(model, fs):
        sess = session(model)
        return [sess.run(None, f) for f in fs]

    ref = outputs(args.model, feeds)
    print(f"{len(feeds)} eval samples, {task_metric(args.task, ref, ref)[0]}\n\n| perturbation | task metric |\n|---|---|")
    for label, model, noise in rows + [(os.path.basename(q), q, None) for q in args.quantized]:
        print(f"| {label} | {task_metric(args.task, ref, outputs(model, feeds if noise is None else noisy(feeds, *noise)))[1]:.4f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model"), ap.add_argument("calib"), ap.add_argument("eval")
    ap.add_argument("quantized", nargs="*", help="quantized models whose flipped samples to list")
    ap.add_argument("--noise", default="1e-3,1e-2,3e-2,1e-1", help="relative input noise levels")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--task", help="a tools/accuracy_models.py model name: its task metric per row, not top-1")
    args = ap.parse_args(argv)
    calib, feeds = load_feeds(args.calib), load_feeds(args.eval)
    if args.task:
        return by_task(args, perturbed(args, calib), feeds)
    ref = first_output(args.model, feeds)
    norm = (lambda p: p) if ref.min() >= 0 and np.allclose(ref.sum(-1), 1, atol=1e-3) else \
        (lambda p: (e := np.exp(p - p.max(-1, keepdims=True))) / e.sum(-1, keepdims=True))   # logits: softmax
    ref = norm(ref)
    top, margin = ref.argmax(-1), np.diff(np.sort(ref, -1)[..., -2:])[..., 0].min(-1)
    rows = perturbed(args, calib)
    print(f"{len(feeds)} eval samples; float top-1 margin median {np.median(margin):.4f}; lowest: "
          + ", ".join(f"{i} ({margin[i]:.3f})" for i in np.argsort(margin)[:12]) + "; below "
          + ", ".join(f"{t}: {int((margin < t).sum())}" for t in (0.1, 0.2, 0.5)) + "\n")
    print("| perturbation | top-1 agreement | flipped | output SNR dB | flipped samples (float margin) |\n|---|---|---|---|---|")
    for label, model, noise in rows + [(os.path.basename(q), q, None) for q in args.quantized]:
        p = norm(first_output(model, feeds if noise is None else noisy(feeds, *noise)))
        flips = np.flatnonzero((p.argmax(-1) != top).any(-1))
        snr = 10 * np.log10(np.sum(ref ** 2) / max(np.sum((ref - p) ** 2), 1e-300))
        listed = ", ".join(f"{i} ({margin[i]:.3f})" for i in flips[np.argsort(margin[flips])])
        print(f"| {label} | {1 - len(flips) / len(feeds):.4f} | {len(flips)} | {snr:.1f} | {listed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
