"""Benchmark models for tools/bench_vs_ort.py: float ONNX models with calibration and eval data.

Three families, each materialised once into a cache folder (``--cache``, default ~/.cache/qp-bench):

* ``light_<net>`` / ``light_<net>_rand``: the onnx backend-test "light" models (weights produced by
  ConstantOfShape, i.e. every weight is one constant), upgraded to opset 13 and constant-folded
  (BatchNormalization folded, Dropout removed); the ``_rand`` variant has seeded random weights
  (He-normal per Conv/Gemm weight, small random biases and BatchNorm statistics).
  Data: smooth seeded random images, 64 calibration / 16 eval samples.
* corpus models (``ppocr_v4_det`` ...): the trained models of /work/shared/corpus, used unchanged,
  with the corpus' own calib/eval sets. Skipped (with a note) when the corpus folder is absent.
  ``<corpus model>_init``: the same with Constant nodes turned into initializers.
* ``encoder_block``: one transformer encoder layer (4-head attention with a padding mask,
  LayerNormalization, erf-GELU FFN) built with onnx.helper, opset 17, seeded weights.

Every prepared model lives in ``<cache>/<name>/``: ``model.onnx`` (float), ``calib/<input>.npy`` and
``eval/<input>.npy`` (arrays of shape (N, *feed_shape), memory-mapped by the readers) and
``info.json``. ``prepare(name)`` returns a :class:`BenchModel` for it.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter
from onnx import TensorProto, helper, numpy_helper

FORMAT_VERSION = 5  # bump to rebuild cached models
DEFAULT_CACHE = Path(os.path.expanduser("~/.cache/qp-bench"))
DEFAULT_CORPUS = Path(os.path.expanduser("~/.cache/qp-corpus"))
LIGHT_DIR = Path(onnx.__file__).parent / "backend/test/data/light"
LIGHT_NETS = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet",
              "squeezenet", "vgg19", "zfnet512")
CORPUS_MODELS = ("ppocr_v4_det", "ppocr_v4_rec", "ppocr_v2_cls", "ddddocr_det")
LIGHT_OPSET = 13
CALIB_SAMPLES, EVAL_SAMPLES = 64, 16


@dataclass
class BenchModel:
    name: str
    kind: str            # "light", "light-rand", "corpus", "transformer"
    path: Path           # float model
    calib_dir: Path      # <input>.npy, shape (N, *feed_shape)
    eval_dir: Path
    real: bool           # trained / meaningful weights (gets the mixed-precision column)

    def samples(self, which: str = "calib", limit: int | None = None) -> "Samples":
        return Samples(self.calib_dir if which == "calib" else self.eval_dir, limit)


class Samples:
    """A re-iterable, indexable, lazily loaded sequence of ``{input: array}`` feeds (mmap'd .npy)."""

    def __init__(self, folder: Path, limit: int | None = None):
        self.folder = Path(folder)
        names = input_names(self.folder)
        self.arrays = {n: np.load(self.folder / f"{i:03d}.npy", mmap_mode="r") for i, n in enumerate(names)}
        count = min(len(a) for a in self.arrays.values())
        self.count = count if limit is None else min(count, limit)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.count:
            raise IndexError(i)
        return {k: np.array(a[i]) for k, a in self.arrays.items()}

    def __iter__(self):
        return (self[i] for i in range(self.count))


# -- registry ----------------------------------------------------------------------------------------
def run_spawned(target, args: tuple, timeout: float, log_path: Path, label: dict) -> dict:
    """Run ``target(*args, conn)`` in a spawned process that sends one result dict through ``conn``;
    wait at most ``timeout`` seconds. A timeout or a child that dies gives ``label`` with ok False and
    the reason."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child))
    proc.start()
    child.close()
    result = None
    if parent.poll(timeout):
        try:
            result = parent.recv()
        except EOFError:
            result = None
    proc.join(5 if result is not None else 0.1)
    if proc.is_alive():
        proc.kill()
        proc.join()
        result = result or {**label, "ok": False, "error": f"timeout after {timeout:.0f} s"}
    if result is None:
        result = {**label, "ok": False, "error": f"child died (exit code {proc.exitcode}); see {log_path}"}
    return result


class FeedReader:
    """onnxruntime's CalibrationDataReader over a sequence of feeds (a list or Samples), rewindable."""

    def __init__(self, feeds):
        self.feeds, self.i = feeds, 0

    def get_next(self):
        if self.i >= len(self.feeds):
            return None
        self.i += 1
        return self.feeds[self.i - 1]

    def rewind(self):
        self.i = 0

    def __len__(self):
        return len(self.feeds)

    def __iter__(self):   # onnxruntime's GPTQ iterates a reader that has a length
        return iter(self.feeds)


# what a quantization imports on first use (a timed run that still imports one says so)
LAZY_IMPORTS = ("numpy.ma", "numpy.random", "onnxruntime", "threadpoolctl", "qpasses.evaluation.summary",
                "qpasses.weightonly.config")


def import_qpasses():
    """qpasses with everything a quantization imports on first use already imported (its pass
    modules, onnxruntime, ...): imports are not timed, as onnxruntime's own are not. ``sys.modules``
    after it is the baseline ``imported_since`` checks a timed run against."""
    import importlib
    import sys

    import qpasses
    from qpasses.core.registry import all_passes

    all_passes()
    for name in LAZY_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:   # an older revision (--qpasses-rev) without it
            pass
    return qpasses, set(sys.modules)


def imported_since(before: set) -> list[str]:
    """Modules a timed run imported (each one's import time is in its seconds): a bench reports them."""
    import sys

    return sorted(set(sys.modules) - before)


def all_names() -> list[str]:
    light = [f"light_{n}{s}" for n in LIGHT_NETS for s in ("", "_rand")]
    return light + list(CORPUS_MODELS) + [f"{n}_init" for n in CORPUS_MODELS] + ["encoder_block"]


# Default benchmark set: fits a ~15 min full run on 2 shared cores. alexnet_rand (233 MB of weights,
# mostly fully connected) keeps weight-heavy models in view: float64 copies of its weights once took
# 1.3x onnxruntime's peak RSS. vgg19, zfnet512 and densenet121 are available with --models.
DEFAULT_MODELS = ("light_resnet50_rand", "light_squeezenet_rand", "light_inception_v1_rand",
                  "light_shufflenet_rand", "light_squeezenet", "light_bvlc_alexnet_rand", *CORPUS_MODELS,
                  "encoder_block")
QUICK_MODELS = ("light_squeezenet_rand", "ppocr_v2_cls", "encoder_block")


def prepare(name: str, cache: Path = DEFAULT_CACHE, corpus: Path = DEFAULT_CORPUS) -> BenchModel:
    """Build (once) and return the benchmark model ``name``; raises FileNotFoundError if a corpus
    model is requested and the corpus is absent."""
    folder = Path(cache) / name
    info_path = folder / "info.json"
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("format") == FORMAT_VERSION:
            return _bench(name, folder, info)
    folder.mkdir(parents=True, exist_ok=True)
    if name.startswith("light_"):
        net, rand = (name[len("light_"):-len("_rand")], True) if name.endswith("_rand") else (name[6:], False)
        if net not in LIGHT_NETS:
            raise KeyError(f"unknown light model '{net}'")
        model, folded_by = light_model(net, random_weights=rand)
        calib = image_data(model, CALIB_SAMPLES, seed=1)
        evald = image_data(model, EVAL_SAMPLES, seed=2)
        info = {"kind": "light-rand" if rand else "light", "real": False, "folded_by": folded_by}
    elif name in CORPUS_MODELS or name.removesuffix("_init") in CORPUS_MODELS:
        base = name.removesuffix("_init")
        src = Path(corpus) / "models" / f"{base}.onnx"
        if not src.is_file():
            raise FileNotFoundError(f"{src}: corpus absent (build it with make_corpus.sh)")
        model = onnx.load(str(src))
        if name != base:
            constants_to_initializers(model.graph)
        calib = dict(np.load(Path(corpus) / "calib" / f"{base}.npz"))
        evald = dict(np.load(Path(corpus) / "eval" / f"{base}.npz"))
        info = {"kind": "corpus", "real": True}
    elif name == "encoder_block":
        model = encoder_block()
        calib = encoder_data(CALIB_SAMPLES, seed=1)
        evald = encoder_data(EVAL_SAMPLES, seed=2)
        info = {"kind": "transformer", "real": True}
    else:
        raise KeyError(f"unknown benchmark model '{name}' (known: {', '.join(all_names())})")
    onnx.save(model, str(folder / "model.onnx"))
    for sub, data in (("calib", calib), ("eval", evald)):
        (folder / sub).mkdir(exist_ok=True)
        for old in (folder / sub).glob("*.npy"):
            old.unlink()
        for i, (key, arr) in enumerate(sorted(data.items())):
            # input names may contain '/', so files are numbered and mapped in info.json
            np.save(folder / sub / f"{i:03d}.npy", np.ascontiguousarray(arr))
        info[f"{sub}_inputs"] = sorted(data)
    info["format"] = FORMAT_VERSION
    info_path.write_text(json.dumps(info, indent=1))
    return _bench(name, folder, info)


def constants_to_initializers(graph) -> None:
    """Turn tensor-valued Constant nodes into initializers (onnxruntime's quantizer treats Constant
    outputs as activations: weights held in Constant nodes get U8 asymmetric activation Q/DQ)."""
    keep = []
    for node in graph.node:
        attr = node.attribute[0] if node.op_type == "Constant" and len(node.attribute) == 1 else None
        if attr is not None and attr.name == "value":
            tensor = onnx.TensorProto()
            tensor.CopyFrom(attr.t)
            tensor.name = node.output[0]
            graph.initializer.append(tensor)
        else:
            keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)


def _bench(name, folder, info) -> BenchModel:
    return BenchModel(name, info["kind"], folder / "model.onnx", folder / "calib", folder / "eval",
                      info["real"])


def input_names(folder: Path) -> list[str]:
    """Input names for the numbered .npy files of a prepared model's calib/ or eval/ folder."""
    info = json.loads((Path(folder).parent / "info.json").read_text())
    return info[f"{Path(folder).name}_inputs"]


# -- light models ------------------------------------------------------------------------------------
def light_model(net: str, random_weights: bool, seed: int = 0) -> tuple[onnx.ModelProto, str]:
    """The onnx light model ``net`` with materialised weights, opset 13, BatchNorm folded; and the
    name of the folder (qpasses or onnxruntime)."""
    model = onnx.load(str(LIGHT_DIR / f"light_{net}.onnx"))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    keep_inputs = [i for i in graph.input if i.name not in inits]
    del graph.input[:]
    graph.input.extend(keep_inputs)
    _materialise_constant_of_shape(graph)
    if random_weights:
        _randomise_weights(graph, np.random.default_rng(seed))
    _drop_unused_inputs(graph)
    model.ir_version = 8  # initializers no longer listed as inputs (IR >= 4)
    model = onnx.version_converter.convert_version(model, LIGHT_OPSET)
    model, folded_by = fold(model)
    if random_weights:  # weights reaching Conv/Gemm through a Reshape are only initializers now
        _randomise_weights(model.graph, np.random.default_rng(seed + 1), only_constant=True)
        _temper_logits(model)
    return model, folded_by


_HOMOGENEOUS = {"Relu", "Reshape", "Flatten", "GlobalAveragePool", "AveragePool", "MaxPool", "Dropout",
                "Identity", "Squeeze"}


def _temper_logits(model: onnx.ModelProto, target_std: float = 3.0) -> None:
    """Scale the last Conv/Gemm before a final Softmax so random weights give logits of std ~3
    (otherwise the Softmax saturates to one-hot and output SNR only measures argmax flips)."""
    import onnxruntime as ort

    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    out = model.graph.output[0].name
    if out not in producer or producer[out].op_type != "Softmax":
        return
    logits = producer[out].input[0]
    node = producer.get(logits)
    while node is not None and node.op_type in _HOMOGENEOUS:
        node = producer.get(node.input[0])
    if node is None or node.op_type not in ("Conv", "Gemm") or node.input[1] not in inits:
        return
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.add().name = logits
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = image_data(model, 4, seed=99)
    values = [sess.run([logits], {k: v[i] for k, v in feeds.items()})[0] for i in range(4)]
    factor = target_std / max(float(np.std(values)), 1e-12)
    for name in node.input[1:3]:
        if name in inits:
            arr = numpy_helper.to_array(inits[name]) * np.float32(factor)
            inits[name].CopyFrom(numpy_helper.from_array(arr.astype(np.float32), name))


def _materialise_constant_of_shape(graph) -> None:
    """Replace ConstantOfShape(initializer shape) nodes by initializers holding their value."""
    inits = {t.name: t for t in graph.initializer}
    keep = []
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = numpy_helper.to_array(inits[node.input[0]]).astype(np.int64)
            value = np.zeros(1, np.float32)
            for a in node.attribute:
                if a.name == "value":
                    value = numpy_helper.to_array(a.t)
            arr = np.full(tuple(shape), value.reshape(-1)[0], dtype=value.dtype)
            graph.initializer.append(numpy_helper.from_array(arr, node.output[0]))
        else:
            keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)
    used = {i for n in graph.node for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _randomise_weights(graph, rng: np.random.Generator, only_constant: bool = False) -> None:
    """He-normal Conv/Gemm weights, small random biases and BatchNorm statistics (in graph order);
    with ``only_constant``, only tensors whose elements are all equal."""
    inits = {t.name: t for t in graph.initializer}
    new: dict[str, np.ndarray] = {}

    def setv(name, arr):
        if name not in inits or name in new:
            return
        if only_constant:
            old = numpy_helper.to_array(inits[name])
            if old.size < 2 or not np.all(old == old.flat[0]):
                return
        new[name] = arr.astype(np.float32)

    for node in graph.node:
        shapes = {n: tuple(inits[n].dims) for n in node.input if n in inits}
        if node.op_type == "Conv" and node.input[1] in shapes:
            w = shapes[node.input[1]]
            fan_in = int(np.prod(w[1:]))
            setv(node.input[1], rng.normal(0, math.sqrt(2.0 / fan_in), w))
            if len(node.input) > 2 and node.input[2] in shapes:
                setv(node.input[2], rng.normal(0, 0.05, shapes[node.input[2]]))
        elif node.op_type == "Gemm" and node.input[1] in shapes:
            w = shapes[node.input[1]]
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            fan_in = w[1] if trans_b else w[0]
            setv(node.input[1], rng.normal(0, math.sqrt(2.0 / fan_in), w))
            if len(node.input) > 2 and node.input[2] in shapes:
                setv(node.input[2], rng.normal(0, 0.05, shapes[node.input[2]]))
        elif node.op_type == "BatchNormalization":
            names = list(node.input[1:5])
            if all(n in shapes for n in names):
                c = shapes[names[0]]
                setv(names[0], 1.0 + 0.1 * rng.standard_normal(c))        # scale
                setv(names[1], 0.1 * rng.standard_normal(c))              # bias
                setv(names[2], 0.1 * rng.standard_normal(c))              # mean
                setv(names[3], rng.uniform(0.5, 1.5, c))                  # var
    for t in graph.initializer:
        if t.name in new:
            t.CopyFrom(numpy_helper.from_array(new[t.name], t.name))


def _drop_unused_inputs(graph) -> None:
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    keep = [i for i in graph.input if i.name in used]
    del graph.input[:]
    graph.input.extend(keep)


def fold(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """Constant-fold and fold BatchNorm: qpasses' fold passes when registered, else onnxruntime's
    basic offline graph optimisation (constant folding, Conv+BN fusion, Dropout removal)."""
    try:
        import qpasses
        from qpasses.core.registry import all_passes

        if {"fold-constants", "fold-batchnorm", "cleanup"} <= set(all_passes()):
            qm, _ = qpasses.run_pipeline(model, "fold-constants,fold-batchnorm,cleanup")
            folded = qm.to_proto()
            keep = [p for p in folded.metadata_props if not p.key.startswith("qpasses.")]
            del folded.metadata_props[:]
            folded.metadata_props.extend(keep)  # a plain float model: no qpasses facts or tables
            return folded, "qpasses"
    except ImportError:
        pass
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.optimized_model_filepath = os.path.join(tmp, "folded.onnx")
        opts.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        folded = onnx.load(opts.optimized_model_filepath)
    folded.ir_version = min(folded.ir_version, 10)
    return folded, "onnxruntime"


def image_data(model: onnx.ModelProto, count: int, seed: int) -> dict[str, np.ndarray]:
    """Smooth random images (low-frequency noise plus fine grain), roughly zero-mean unit-variance."""
    rng = np.random.default_rng(seed)
    out = {}
    for inp in model.graph.input:
        shape = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
        n, c, h, w = shape
        samples = np.empty((count, *shape), np.float32)
        for s in range(count):
            coarse = rng.standard_normal((n, c, 8, 8)).astype(np.float32)
            img = _resize_bilinear(coarse, h, w) + 0.2 * rng.standard_normal((n, c, h, w))
            samples[s] = (img - img.mean()) / (img.std() + 1e-6)
        out[inp.name] = samples
    return out


def _resize_bilinear(x: np.ndarray, h: int, w: int) -> np.ndarray:
    ys, xs = np.linspace(0, x.shape[-2] - 1, h), np.linspace(0, x.shape[-1] - 1, w)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, x.shape[-2] - 1), np.minimum(x0 + 1, x.shape[-1] - 1)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    top = x[..., y0, :][..., x0] * (1 - fx) + x[..., y0, :][..., x1] * fx
    bot = x[..., y1, :][..., x0] * (1 - fx) + x[..., y1, :][..., x1] * fx
    return (top * (1 - fy) + bot * fy).astype(np.float32)


# -- transformer encoder block -----------------------------------------------------------------------
SEQ, DIM, HEADS, FFN = 128, 256, 4, 1024


def encoder_block(seed: int = 0) -> onnx.ModelProto:
    """One post-LN transformer encoder layer, inputs ``embeddings`` (1,128,256) and
    ``attention_mask`` (1,128) float (1 = token, 0 = padding), output ``hidden`` (1,128,256)."""
    rng = np.random.default_rng(seed)
    head = DIM // HEADS
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def dense(x, name, n_in, n_out):
        w = const(f"{name}.weight", rng.normal(0, 1 / math.sqrt(n_in), (n_in, n_out)).astype(np.float32))
        b = const(f"{name}.bias", rng.normal(0, 0.02, n_out).astype(np.float32))
        nodes.append(helper.make_node("MatMul", [x, w], [f"{name}.mm"], name=f"{name}/MatMul"))
        nodes.append(helper.make_node("Add", [f"{name}.mm", b], [f"{name}.out"], name=f"{name}/Add"))
        return f"{name}.out"

    def layer_norm(x, name):
        gamma = 1.0 + 0.1 * rng.standard_normal(DIM)
        gamma[[7, 100]] = 4.0   # a couple of outlier channels, as trained transformers have
        g = const(f"{name}.weight", gamma.astype(np.float32))
        b = const(f"{name}.bias", (0.02 * rng.standard_normal(DIM)).astype(np.float32))
        nodes.append(helper.make_node("LayerNormalization", [x, g, b], [f"{name}.out"], name=name,
                                      axis=-1, epsilon=1e-5))
        return f"{name}.out"

    split_shape = const("heads_shape", np.array([1, SEQ, HEADS, head], np.int64))
    merge_shape = const("merge_shape", np.array([1, SEQ, DIM], np.int64))
    mask_shape = const("mask_shape", np.array([1, 1, 1, SEQ], np.int64))

    def heads(x, name, perm):
        nodes.append(helper.make_node("Reshape", [x, split_shape], [f"{name}.split"], name=f"{name}/Reshape"))
        nodes.append(helper.make_node("Transpose", [f"{name}.split"], [f"{name}.heads"], name=f"{name}/Transpose",
                                      perm=perm))
        return f"{name}.heads"

    q = heads(dense("embeddings", "attn.q", DIM, DIM), "attn.q", [0, 2, 1, 3])
    k = heads(dense("embeddings", "attn.k", DIM, DIM), "attn.k", [0, 2, 3, 1])
    v = heads(dense("embeddings", "attn.v", DIM, DIM), "attn.v", [0, 2, 1, 3])
    one = const("one", np.array(1.0, np.float32))
    big_neg = const("mask_value", np.array(-10000.0, np.float32))
    scale = const("attn.scale", np.array(1.0 / math.sqrt(head), np.float32))
    nodes += [
        helper.make_node("Sub", [one, "attention_mask"], ["mask.inverted"], name="mask/Sub"),
        helper.make_node("Mul", ["mask.inverted", big_neg], ["mask.additive"], name="mask/Mul"),
        helper.make_node("Reshape", ["mask.additive", mask_shape], ["mask.bias"], name="mask/Reshape"),
        helper.make_node("MatMul", [q, k], ["attn.qk"], name="attn/QK_MatMul"),
        helper.make_node("Mul", ["attn.qk", scale], ["attn.scores"], name="attn/Scale"),
        helper.make_node("Add", ["attn.scores", "mask.bias"], ["attn.masked"], name="attn/MaskAdd"),
        helper.make_node("Softmax", ["attn.masked"], ["attn.probs"], name="attn/Softmax", axis=-1),
        helper.make_node("MatMul", ["attn.probs", v], ["attn.ctx"], name="attn/PV_MatMul"),
        helper.make_node("Transpose", ["attn.ctx"], ["attn.ctx_t"], name="attn/ctx/Transpose", perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["attn.ctx_t", merge_shape], ["attn.merged"], name="attn/ctx/Reshape"),
    ]
    proj = dense("attn.merged", "attn.out", DIM, DIM)
    nodes.append(helper.make_node("Add", ["embeddings", proj], ["res1"], name="res1/Add"))
    h1 = layer_norm("res1", "ln1")
    f1 = dense(h1, "ffn.fc1", DIM, FFN)
    sqrt2 = const("sqrt2", np.array(math.sqrt(2.0), np.float32))
    half = const("half", np.array(0.5, np.float32))
    nodes += [
        helper.make_node("Div", [f1, sqrt2], ["gelu.div"], name="gelu/Div"),
        helper.make_node("Erf", ["gelu.div"], ["gelu.erf"], name="gelu/Erf"),
        helper.make_node("Add", ["gelu.erf", one], ["gelu.add"], name="gelu/Add"),
        helper.make_node("Mul", [f1, "gelu.add"], ["gelu.mul"], name="gelu/Mul"),
        helper.make_node("Mul", ["gelu.mul", half], ["gelu.out"], name="gelu/Mul_half"),
    ]
    f2 = dense("gelu.out", "ffn.fc2", FFN, DIM)
    nodes.append(helper.make_node("Add", [h1, f2], ["res2"], name="res2/Add"))
    out = layer_norm("res2", "ln2")
    nodes.append(helper.make_node("Identity", [out], ["hidden"], name="output/Identity"))
    graph = helper.make_graph(
        nodes, "encoder_block",
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, [1, SEQ, DIM]),
         helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, [1, SEQ])],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, SEQ, DIM])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="qpasses-bench")
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def encoder_data(count: int, seed: int) -> dict[str, np.ndarray]:
    """Smooth random token embeddings (low-pass along the sequence) and padding masks."""
    rng = np.random.default_rng(seed)
    emb = np.empty((count, 1, SEQ, DIM), np.float32)
    mask = np.zeros((count, 1, SEQ), np.float32)
    kernel = np.hanning(9) / np.hanning(9).sum()
    for s in range(count):
        raw = rng.standard_normal((SEQ + 8, DIM))
        smooth = np.stack([np.convolve(raw[:, j], kernel, mode="valid") for j in range(DIM)], axis=1)
        x = smooth / smooth.std() + 0.3 * rng.standard_normal((SEQ, DIM))
        x[:, [3, 200]] *= 6.0   # outlier embedding channels
        emb[s, 0] = x
        mask[s, 0, : int(rng.integers(SEQ // 4, SEQ + 1))] = 1.0
    return {"embeddings": emb, "attention_mask": mask}


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Build benchmark models into the cache.")
    ap.add_argument("names", nargs="*", default=list(DEFAULT_MODELS))
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    args = ap.parse_args(argv)
    for name in args.names:
        try:
            bm = prepare(name, args.cache, args.corpus)
        except FileNotFoundError as exc:
            print(f"{name}: skipped ({exc})")
            continue
        m = onnx.load(str(bm.path))
        print(f"{name}: {len(m.graph.node)} nodes, opset {m.opset_import[0].version}, "
              f"{len(bm.samples('calib'))} calib / {len(bm.samples('eval'))} eval samples")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
