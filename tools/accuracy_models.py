"""Small models of the classes /work/shared/ANCHORS.md describes that the shared corpus lacks, with
calibration and held-out evaluation data and a task metric, for the accuracy benchmark of issue 15
(tools/bench_accuracy.py).

    python tools/accuracy_models.py                    # build all (cached), print a summary of each
    python tools/accuracy_models.py bert_encoder --force

Models (each built with PyTorch, exported with the TorchScript exporter at opset 17; torch is a
tools-only dependency: ``pip install torch==2.13.0``):

* ``bert_encoder``: BERT-style post-LN encoder (token + position embeddings, 3 layers of 4-head
  attention with the additive mask ``(1 - attention_mask) * -10000`` added to the scores, Softmax,
  LayerNormalization, erf-GELU MLP), mean pooling over the unpadded tokens -> embedding (1, 128).
  Random weights; LayerNorm gains set from data so that 3 hidden channels of the residual stream
  are 20x, 50x and 100x the others (trained-like activation outliers; the last LayerNorm has none,
  so the embedding is not dominated by them). Inputs: input_ids, attention_mask (int64, (1, 64)),
  sentences from Python's own docstrings, variable length padding. Metric: mean cosine to float.
* ``byte_classifier``: byte-level content-type classifier (Magika-like): byte embedding (Gather),
  3 MatMuls, tanh-GELU, LayerNorm written as ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div (eps 1e-3, as
  Keras; padded 8-byte groups embed to 0, so their LayerNorm variance is near 0), softmax
  written as ReduceMax/Sub/Exp/ReduceSum/Div. Trained briefly (seeded) to tell 19 file types apart
  on the first and last 512 bytes of files found under /usr, with 2 + 3 hidden channels of the two
  MatMuls started 60x larger (trained-like outliers: they end 30-40x the median channel, and their
  cubes in the tanh-GELU and squares in the LayerNorm reach 1e4-2e5). Metric: top-1 agreement.
* ``yolo_detector``: YOLOv8-style detector, 320x320: Conv+SiLU backbone with C2f blocks (Split,
  Concat) and SPPF, FPN neck (Resize), decoupled heads (class towers with GroupNorm, as in FCOS: it
  keeps the random class maps at ~2-10 objects per image), DFL (Softmax + 1x1 Conv), anchors built by
  Shape/Range arithmetic, output Concat([xywh boxes in pixels, Sigmoid(20 class scores)], 1) of
  shape (1, 24, 2100). Random weights; the class bias is set so that the float model finds ~4
  objects per image (scores 0.25 threshold, NMS 0.45). Images: scikit-image sample photos
  (crops, flips). Metric: detection F1 at IoU >= 0.5 with the float detections as ground truth.
* ``crnn_lstm``: captcha OCR: Conv/BN/ReLU/MaxPool backbone -> bidirectional LSTM (ONNX LSTM op)
  -> Linear -> per-timestep Softmax, output (32, 1, 35). Trained briefly (seeded, CTC) on rendered
  4-6 character captchas (DejaVu fonts, noise). Metric: CTC greedy decoded string equals float's.
* ``vad_if``: voice-activity model whose compute sits in the two bodies of an If on the sample-rate
  input (16 kHz / 8 kHz branch, each: STFT as a Conv, 3 Conv1d+ReLU, LSTM, Gemm, Sigmoid), inputs
  input (1, 512), state (2, 1, 64), sr (1,) int64; outputs output (1, 1), stateN. Trained briefly
  on synthetic speech-like / noise streams; calibration and eval frames are taken from float
  streaming runs (state fed back), 3/4 at 16 kHz, 1/4 at 8 kHz, half of them at speech onsets and
  offsets. Metric: agreement of prob > 0.5.

Cache: ``~/.cache/qp-bench/acc/<model>/`` with ``model.onnx``, ``calib.npz`` (32 samples),
``eval.npz`` (32) in the corpus layout (per input name an array (N, *feed_shape)) and ``info.json``
(what the float model does on the eval set: how degenerate its metric could be).
"""
from __future__ import annotations

import functools
import io
import json
import math
import os
import re
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import onnx

FORMAT_VERSION = 1   # bump to rebuild every cached model
REVISIONS = {"byte_classifier": 2, "vad_if": 2}   # bump one model's entry to rebuild only that model (default 1)
DEFAULT_CACHE = Path(os.path.expanduser("~/.cache/qp-bench/acc"))
MODELS = ("bert_encoder", "byte_classifier", "yolo_detector", "crnn_lstm", "vad_if")
N_CALIB, N_EVAL = 32, 32
OPSET = 17


# ================================================================================ common helpers
def _torch(seed: int):
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(1)   # 2 threads on a shared 2-core machine: 10x slower training steps
    return torch


def _export(module, args, input_names, output_names, dynamic_axes=None) -> onnx.ModelProto:
    """TorchScript-exporter ONNX (opset 17) of ``module`` in eval mode."""
    import warnings

    import torch

    module.eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buf, opset_version=OPSET, input_names=input_names,
                          output_names=output_names, dynamic_axes=dynamic_axes, dynamo=False,
                          do_constant_folding=True)
    return onnx.load_from_string(buf.getvalue())


def _set_static(model: onnx.ModelProto, shapes: dict[str, tuple], out_shapes: dict[str, tuple]) -> onnx.ModelProto:
    """Give the graph inputs static shapes (after a dynamic-axes export, which keeps the shape
    arithmetic in the graph) and re-infer the rest."""
    for inp in model.graph.input:
        if inp.name in shapes:
            dims = inp.type.tensor_type.shape.dim
            for d, v in zip(dims, shapes[inp.name]):
                d.Clear()
                d.dim_value = int(v)
    for out in model.graph.output:
        for d, v in zip(out.type.tensor_type.shape.dim, out_shapes[out.name]):
            d.Clear()
            d.dim_value = int(v)
    del model.graph.value_info[:]
    return onnx.shape_inference.infer_shapes(model)


def _session(model):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


def run_model(model, data: dict) -> list[list[np.ndarray]]:
    """``session.run(None, feed)`` for every sample of an npz-layout dict."""
    sess = _session(model)
    n = min(len(v) for v in data.values())
    return [sess.run(None, {k: v[i] for k, v in data.items()}) for i in range(n)]


# ================================================================================ metrics
def _cos(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def mean_cosine(outs_f, outs_q):
    return float(np.mean([_cos(a[0], b[0]) for a, b in zip(outs_f, outs_q)]))


def top1(outs_f, outs_q):
    return float(np.mean([np.array_equal(a[0].argmax(-1), b[0].argmax(-1)) for a, b in zip(outs_f, outs_q)]))


def iou_xyxy(a, b):
    """IoU of box ``a`` (4,) with boxes ``b`` (n, 4), corners."""
    x1 = np.maximum(a[0], b[:, 0]); y1 = np.maximum(a[1], b[:, 1])
    x2 = np.minimum(a[2], b[:, 2]); y2 = np.minimum(a[3], b[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area_a = max(a[2] - a[0], 0) * max(a[3] - a[1], 0)
    area_b = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    return inter / np.maximum(area_a + area_b - inter, 1e-9)


def nms(boxes, scores, classes, iou_thr):
    """Indices kept by greedy per-class non-maximum suppression, best score first."""
    keep = []
    for c in np.unique(classes):
        idx = np.nonzero(classes == c)[0]
        idx = idx[np.argsort(-scores[idx], kind="stable")]
        while idx.size:
            best, idx = idx[0], idx[1:]
            keep.append(best)
            if idx.size:
                idx = idx[iou_xyxy(boxes[best], boxes[idx]) < iou_thr]
    keep = np.asarray(keep, dtype=int)
    return keep[np.argsort(-scores[keep], kind="stable")] if keep.size else keep


YOLO_CONF, YOLO_NMS = 0.25, 0.45


def yolo_detections(output, conf=YOLO_CONF, iou_thr=YOLO_NMS):
    """(boxes xyxy, scores, classes) from a (1, 4+C, N) YOLOv8-style output."""
    p = np.asarray(output[0], np.float64)
    xywh, cls = p[:4].T, p[4:].T
    score, label = cls.max(1), cls.argmax(1)
    sel = score > conf
    xy, wh = xywh[sel, :2], xywh[sel, 2:]
    boxes = np.concatenate([xy - wh / 2, xy + wh / 2], 1)
    k = nms(boxes, score[sel], label[sel], iou_thr)
    return boxes[k], score[sel][k], label[sel][k]


def detection_f1(dets_f, dets_q, iou=0.5):
    """F1 of quantized detections matched greedily (by score, same class) to float ones at IoU >= iou."""
    matched = nf = nq = 0
    for (fb, _, fc), (qb, qs, qc) in zip(dets_f, dets_q):
        used = np.zeros(len(fb), bool)
        for i in np.argsort(-qs, kind="stable"):
            free = np.nonzero(~used & (fc == qc[i]))[0]
            if free.size == 0:
                continue
            ious = iou_xyxy(qb[i], fb[free])
            j = int(np.argmax(ious))
            if ious[j] >= iou:
                used[free[j]] = True
                matched += 1
        nf += len(fb)
        nq += len(qb)
    return 2 * matched / (nf + nq) if nf + nq else 1.0


CAPTCHA_CHARS = "0123456789abcdefghijkmnpqrstuvwxyz"   # index 0 of the model's classes is the CTC blank


def ctc_greedy(probs) -> str:
    """Decoded string of a (T, 1, K) per-timestep softmax: argmax, merge repeats, drop blanks."""
    ids = np.asarray(probs).reshape(np.asarray(probs).shape[0], -1).argmax(-1)
    out, prev = [], -1
    for i in ids:
        if i != prev and i != 0:
            out.append(CAPTCHA_CHARS[i - 1] if i - 1 < len(CAPTCHA_CHARS) else "?")
        prev = i
    return "".join(out)


def text_match(outs_f, outs_q):
    return float(np.mean([ctc_greedy(a[0]) == ctc_greedy(b[0]) for a, b in zip(outs_f, outs_q)]))


def speech_agreement(outs_f, outs_q):
    return float(np.mean([(float(np.ravel(a[0])[0]) > 0.5) == (float(np.ravel(b[0])[0]) > 0.5)
                          for a, b in zip(outs_f, outs_q)]))


METRICS = {
    "bert_encoder": ("mean cosine of the embedding", mean_cosine),
    "byte_classifier": ("top-1 agreement", top1),
    "yolo_detector": ("detection F1 (IoU >= 0.5)", None),
    "crnn_lstm": ("decoded text exact match", text_match),
    "vad_if": ("speech decision (p > 0.5) agreement", speech_agreement),
}


def task_metric(name: str, outs_f, outs_q) -> tuple[str, float]:
    """(metric name, value) of a quantized model's eval outputs against the float model's; outs_*
    are lists (one per eval sample) of ``session.run(None, feed)`` results."""
    label, fn = METRICS[name]
    if name == "yolo_detector":
        dec = lambda outs: [yolo_detections(o[0]) for o in outs]  # noqa: E731
        return label, detection_f1(dec(outs_f), dec(outs_q))
    return label, fn(outs_f, outs_q)


# ================================================================================ bert_encoder
def _docstring_sentences() -> tuple[list[str], list[str]]:
    """Sentences from the docstrings of stdlib modules: (calibration pool, held-out pool)."""
    import importlib
    import inspect

    mods = ["os", "re", "json", "collections", "itertools", "functools", "typing", "pathlib", "argparse",
            "subprocess", "threading", "logging", "email.message", "http.client", "urllib.request", "datetime",
            "decimal", "fractions", "statistics", "random", "string", "textwrap", "shutil", "tempfile",
            "zipfile", "tarfile", "csv", "sqlite3", "unittest", "inspect", "ast", "pickle", "copy", "heapq",
            "bisect", "queue", "socket", "asyncio", "difflib", "gzip", "configparser", "dataclasses"]
    pools: tuple[list[str], list[str]] = ([], [])
    for i, name in enumerate(mods):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        docs = [mod.__doc__ or ""]
        for attr in sorted(dir(mod)):
            if not attr.startswith("_"):
                obj = getattr(mod, attr, None)
                if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                    doc = getattr(obj, "__doc__", None)
                    docs.append(doc if isinstance(doc, str) else "")
        for doc in docs:
            for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                words = re.findall(r"[A-Za-z]+|\d+|[^\sA-Za-z\d]", s.lower())
                if 4 <= len(words):
                    pools[i % 3 == 2].append(" ".join(words))
    return pools


BERT_VOCAB, BERT_LEN, BERT_HIDDEN, BERT_LAYERS, BERT_HEADS, BERT_FFN = 4096, 64, 128, 3, 4, 512
BERT_OUTLIERS = {17: 20.0, 60: 50.0, 101: 100.0}   # hidden channel -> magnitude vs the others


def _tokenize(sentence: str) -> list[int]:
    """[CLS] word ids [SEP]; word ids from a stable hash (Zipf-like, as a real vocabulary)."""
    ids = [3 + zlib.crc32(w.encode()) % (BERT_VOCAB - 3) for w in sentence.split()]
    return [1] + ids[: BERT_LEN - 2] + [2]


def _bert_data(sentences, n, rng) -> dict:
    # realistic lengths: mostly short, a few filling the window
    order = rng.permutation(len(sentences))
    ids = np.zeros((n, 1, BERT_LEN), np.int64)
    mask = np.zeros((n, 1, BERT_LEN), np.int64)
    k = 0
    for j in order:
        toks = _tokenize(sentences[j])
        if len(toks) < 6:
            continue
        ids[k, 0, : len(toks)] = toks
        mask[k, 0, : len(toks)] = 1
        k += 1
        if k == n:
            break
    return {"input_ids": ids, "attention_mask": mask}


def _bert_module(torch):
    nn = torch.nn
    H, NH = BERT_HIDDEN, BERT_HEADS

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
            self.ln1, self.ln2 = nn.LayerNorm(H, eps=1e-12), nn.LayerNorm(H, eps=1e-12)
            self.fc1, self.fc2 = nn.Linear(H, BERT_FFN), nn.Linear(BERT_FFN, H)
            self.act = nn.GELU()

        def heads(self, x):
            b, n, _ = x.shape
            return x.view(b, n, NH, H // NH).transpose(1, 2)

        def forward(self, h, ext):
            b, n, _ = h.shape
            q, k, v = self.heads(self.q(h)), self.heads(self.k(h)), self.heads(self.v(h))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(H // NH) + ext
            ctx = torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2).reshape(b, n, H)
            h = self.ln1(h + self.o(ctx))
            return self.ln2(h + self.fc2(self.act(self.fc1(h))))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(BERT_VOCAB, H)
            self.pos = nn.Embedding(BERT_LEN, H)
            self.register_buffer("position_ids", torch.arange(BERT_LEN)[None], persistent=False)
            self.ln = nn.LayerNorm(H, eps=1e-12)
            self.layers = nn.ModuleList(Layer() for _ in range(BERT_LAYERS))

        def forward(self, input_ids, attention_mask):
            n = input_ids.shape[1]
            h = self.ln(self.tok(input_ids) + self.pos(self.position_ids[:, :n]))
            ext = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * -10000.0
            for layer in self.layers:
                h = layer(h, ext)
            m = attention_mask.unsqueeze(-1).to(torch.float32)
            return (h * m).sum(1) / torch.clamp(m.sum(1), min=1e-9)

        def norms(self):
            yield self.ln
            for layer in self.layers:
                yield layer.ln1
                yield layer.ln2

    return Bert()


def build_bert_encoder():
    torch = _torch(0)
    rng = np.random.default_rng(0)
    model = _bert_module(torch)
    H = BERT_HIDDEN
    out_idx = torch.tensor(sorted(BERT_OUTLIERS))
    ratio = torch.tensor([BERT_OUTLIERS[i] for i in sorted(BERT_OUTLIERS)])
    with torch.no_grad():
        model.tok.weight.normal_(0, 1.0)
        model.pos.weight.normal_(0, 0.5)
        for layer in model.layers:
            for lin in (layer.q, layer.k, layer.v, layer.o, layer.fc1, layer.fc2):
                lin.weight.normal_(0, 1 / math.sqrt(lin.in_features))
                lin.bias.normal_(0, 0.05)
            # peakier attention than random (trained heads attend to a few tokens)
            layer.q.weight.mul_(2.0)
            layer.k.weight.mul_(1.5)
            # the outlier channels carry little information downstream: their weight columns are
            # scaled down by their magnitude (as in trained models, where they act as biases)
            for lin in (layer.q, layer.k, layer.v, layer.fc1):
                lin.weight[:, out_idx] /= ratio
    calib_pool, eval_pool = _docstring_sentences()
    calib = _bert_data(calib_pool, N_CALIB, rng)
    evald = _bert_data(eval_pool, N_EVAL, rng)
    feeds = [torch.from_numpy(calib[k][:, 0]) for k in ("input_ids", "attention_mask")]

    # LayerNorm gains from data, in graph order: normal channels std 1, the outlier channels
    # ratio x that (sign-stable, as trained outlier dimensions), none in the last LayerNorm.
    norms = list(model.norms())
    for i, ln in enumerate(norms):
        seen = {}
        hook = ln.register_forward_hook(lambda m, a, o: seen.setdefault("x", a[0]))
        with torch.no_grad():
            model(*feeds)
        hook.remove()
        x = seen["x"]
        m = feeds[1].bool()
        z = torch.nn.functional.layer_norm(x, (H,), eps=1e-12)[m]   # (tokens, H)
        mean, std = z.mean(0), z.std(0).clamp(min=1e-6)
        sign = torch.tensor([1.0, -1.0, 1.0])
        with torch.no_grad():   # each channel standardised, plus a small trained-like offset
            ln.weight.copy_(1.0 / std)
            ln.bias.copy_(-mean / std + torch.from_numpy(rng.normal(0, 0.1, H).astype(np.float32)))
            if i < len(norms) - 1:   # outlier channels: offset +-ratio, spread 0.3 ratio
                ln.weight[out_idx] = 0.3 * ratio / std[out_idx]
                ln.bias[out_idx] = sign * ratio - ln.weight[out_idx] * mean[out_idx]
    onnx_model = _export(model, tuple(torch.from_numpy(calib[k][0]) for k in ("input_ids", "attention_mask")),
                         ["input_ids", "attention_mask"], ["embedding"])
    return onnx_model, calib, evald, {"outlier_channels": {str(k): v for k, v in BERT_OUTLIERS.items()}}


# ================================================================================ byte_classifier
BYTES_IN, BYTE_PAD = 1024, 256
BYTE_OUTLIERS = ([5, 77], [31, 140, 201])   # channels of d1 / d2 started 20x larger (they stay large)


def _file_type(path: Path, head: bytes) -> str | None:
    name, suf = path.name.lower(), path.suffix.lower()
    if head.startswith(b"\x7fELF"):
        return "elf"
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"\x89PNG"):
        return "png"
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if suf == ".pyc":
        return "pyc"
    table = {".py": "python", ".c": "c", ".h": "c", ".json": "json", ".html": "html", ".htm": "html",
             ".xml": "xml", ".svg": "xml", ".sh": "shell", ".txt": "text", ".md": "markdown",
             ".rst": "rst", ".pm": "perl", ".pl": "perl", ".js": "javascript", ".css": "css",
             ".mo": "gettext", ".conf": "config", ".cfg": "config", ".ini": "config", ".ttf": "font",
             ".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".pem": "pem", ".crt": "pem"}
    if suf in table:
        return table[suf]
    if head.startswith(b"#!") and b"sh" in head[:40]:
        return "shell"
    return None


def _byte_files(limit_per_class=240) -> dict[str, list[Path]]:
    roots = ["/usr/lib/python3", "/usr/lib/python3.11", "/usr/local/lib/python3.11", "/usr/share",
             "/usr/bin", "/usr/lib/x86_64-linux-gnu", "/etc", "/usr/include", "/usr/local/include"]
    found: dict[str, list[Path]] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            if "site-packages" in dirpath or "dist-packages" in dirpath:
                continue
            for fn in sorted(filenames):
                p = Path(dirpath) / fn
                try:
                    if p.is_symlink() or not p.is_file() or p.stat().st_size < 64:
                        continue
                    with open(p, "rb") as f:
                        head = f.read(64)
                except OSError:
                    continue
                t = _file_type(p, head)
                if t is not None and len(found.setdefault(t, [])) < limit_per_class * 4:
                    found[t].append(p)
    rng = np.random.default_rng(0)
    out = {}
    for t, paths in sorted(found.items()):
        if len(paths) >= 40:
            idx = rng.permutation(len(paths))[:limit_per_class]
            out[t] = [paths[i] for i in sorted(idx)]
    return out


def _byte_window(path: Path) -> np.ndarray:
    """First and last 512 bytes (Magika-style), padded with 256."""
    half = BYTES_IN // 2
    arr = np.full(BYTES_IN, BYTE_PAD, np.int64)
    with open(path, "rb") as f:
        beg = f.read(half)
        size = f.seek(0, 2)
        end = b""
        if size > half:
            f.seek(max(half, size - half))
            end = f.read(half)
    arr[: len(beg)] = np.frombuffer(beg, np.uint8)
    if end:
        arr[BYTES_IN - len(end):] = np.frombuffer(end, np.uint8)
    return arr


def _byte_module(torch, n_classes):
    nn = torch.nn

    class DecomposedLN(nn.Module):
        def __init__(self, n, eps=1e-3):
            super().__init__()
            self.g, self.b, self.eps = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n)), eps

        def forward(self, x):
            mu = x.mean(-1, keepdim=True)
            d = x - mu
            var = d.pow(2).mean(-1, keepdim=True)
            return d / torch.sqrt(var + self.eps) * self.g + self.b

    def gelu_tanh(x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))

    class ByteClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(BYTE_PAD + 1, 16, padding_idx=BYTE_PAD)   # padding embeds to 0
            self.d1, self.ln1 = nn.Linear(128, 128), DecomposedLN(128)
            self.d2, self.ln2 = nn.Linear(128, 256), DecomposedLN(256)
            self.out = nn.Linear(256, n_classes)
            self.drop = nn.Dropout(0.1)

        def forward(self, b):
            x = self.emb(b).reshape(b.shape[0], BYTES_IN // 8, 128)    # 8 bytes per position
            x = self.ln1(gelu_tanh(self.d1(x)))
            x = self.ln2(torch.amax(gelu_tanh(self.d2(self.drop(x))), 1))
            z = self.out(self.drop(x))
            e = torch.exp(z - torch.amax(z, -1, keepdim=True))
            return e / e.sum(-1, keepdim=True)

    return ByteClassifier()


def build_byte_classifier():
    torch = _torch(0)
    files = _byte_files()
    classes = sorted(files)
    rng = np.random.default_rng(1)
    train, held = [], []
    for c, paths in enumerate(classes):
        for p in files[paths]:
            (held if zlib.crc32(str(p).encode()) % 5 == 0 else train).append((_byte_window(p), c))
    x = torch.from_numpy(np.stack([w for w, _ in train]))
    y = torch.tensor([c for _, c in train])
    model = _byte_module(torch, len(classes))
    with torch.no_grad():   # trained-like activation outliers: a few hidden channels 20x the others
        for lin, idx in ((model.d1, BYTE_OUTLIERS[0]), (model.d2, BYTE_OUTLIERS[1])):
            lin.weight[idx] *= 60.0
            lin.bias[idx] += 2.0
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    start = time.time()
    for step in range(300):
        if step % 100 == 0:
            print(f"  byte_classifier step {step} ({time.time() - start:.0f} s)", file=sys.stderr)
        idx = torch.from_numpy(rng.integers(0, len(y), 32))
        p = model(x[idx])
        loss = torch.nn.functional.nll_loss(torch.log(p + 1e-9), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    order = rng.permutation(len(held))
    sel = [held[i] for i in order[: N_CALIB + N_EVAL]]
    data = np.stack([w for w, _ in sel])[:, None, :]
    labels = np.array([c for _, c in sel])
    with torch.no_grad():
        acc_held = float((model(torch.from_numpy(np.stack([w for w, _ in held]))).argmax(-1).numpy()
                          == np.array([c for _, c in held])).mean())
    onnx_model = _export(model, (torch.from_numpy(data[0]),), ["bytes"], ["probabilities"])
    info = {"classes": classes, "train_files": len(train), "heldout_files": len(held),
            "float_accuracy_heldout": round(acc_held, 3),
            "eval_labels": labels[N_CALIB:].tolist()}
    return onnx_model, {"bytes": data[:N_CALIB]}, {"bytes": data[N_CALIB:]}, info


# ================================================================================ yolo_detector
YOLO_SIZE, YOLO_CLASSES, YOLO_REG = 320, 20, 16


def _yolo_module(torch):
    nn = torch.nn

    def conv(c1, c2, k=1, s=1):
        return nn.Sequential(nn.Conv2d(c1, c2, k, s, k // 2), nn.SiLU())

    class Bottleneck(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.cv1, self.cv2 = conv(c, c, 3), conv(c, c, 3)

        def forward(self, x):
            return x + self.cv2(self.cv1(x))

    class C2f(nn.Module):
        def __init__(self, c1, c2, n=1):
            super().__init__()
            self.c = c2 // 2
            self.cv1 = conv(c1, 2 * self.c)
            self.m = nn.ModuleList(Bottleneck(self.c) for _ in range(n))
            self.cv2 = conv((2 + n) * self.c, c2)

        def forward(self, x):
            y = list(self.cv1(x).split((self.c, self.c), 1))
            for m in self.m:
                y.append(m(y[-1]))
            return self.cv2(torch.cat(y, 1))

    class SPPF(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.cv1, self.cv2, self.m = conv(c, c // 2), conv(c * 2, c), nn.MaxPool2d(5, 1, 2)

        def forward(self, x):
            y = [self.cv1(x)]
            for _ in range(3):
                y.append(self.m(y[-1]))
            return self.cv2(torch.cat(y, 1))

    class Head(nn.Module):
        def __init__(self, chs, strides):
            super().__init__()
            self.strides = strides
            self.box = nn.ModuleList(nn.Sequential(conv(c, 32, 3), conv(32, 32, 3), nn.Conv2d(32, 4 * YOLO_REG, 1))
                                     for c in chs)
            # class towers with GroupNorm (as FCOS/RetinaNet heads): random weights give class maps
            # whose scale follows the image's texture; normalising keeps ~2-10 objects per image
            self.cls = nn.ModuleList(nn.Sequential(nn.Conv2d(c, 48, 3, 1, 1), nn.GroupNorm(16, 48), nn.SiLU(),
                                                   nn.Conv2d(48, 48, 3, 1, 1), nn.GroupNorm(16, 48), nn.SiLU(),
                                                   nn.Conv2d(48, YOLO_CLASSES, 1)) for c in chs)
            self.dfl = nn.Conv2d(YOLO_REG, 1, 1, bias=False)
            with torch.no_grad():
                self.dfl.weight.copy_(torch.arange(YOLO_REG, dtype=torch.float32).view(1, YOLO_REG, 1, 1))
            self.dfl.weight.requires_grad_(False)

        def forward(self, feats):
            b = feats[0].shape[0]
            xs, anchors, strides = [], [], []
            for i, f in enumerate(feats):
                xs.append(torch.cat((self.box[i](f), self.cls[i](f)), 1).view(b, 4 * YOLO_REG + YOLO_CLASSES, -1))
                h, w = f.shape[2:]
                sx = torch.arange(w, dtype=torch.float32) + 0.5
                sy = torch.arange(h, dtype=torch.float32) + 0.5
                yy, xx = torch.meshgrid(sy, sx, indexing="ij")
                anchors.append(torch.stack((xx, yy), -1).view(-1, 2))
                strides.append(torch.full((h * w, 1), float(self.strides[i])))
            anchor = torch.cat(anchors).transpose(0, 1)[None]     # (1, 2, N)
            stride = torch.cat(strides).transpose(0, 1)[None]     # (1, 1, N)
            x = torch.cat(xs, 2)
            box, cls = x.split((4 * YOLO_REG, YOLO_CLASSES), 1)
            n = box.shape[2]
            dist = self.dfl(box.view(b, 4, YOLO_REG, n).transpose(2, 1).softmax(1)).view(b, 4, n)
            lt, rb = dist.chunk(2, 1)
            x1y1, x2y2 = anchor - lt, anchor + rb
            xywh = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * stride
            return torch.cat((xywh, cls.sigmoid()), 1)

    class Yolo(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(conv(3, 16, 3, 2), conv(16, 32, 3, 2), C2f(32, 32))
            self.p3 = nn.Sequential(conv(32, 64, 3, 2), C2f(64, 64, 2))
            self.p4 = nn.Sequential(conv(64, 128, 3, 2), C2f(128, 128, 2))
            self.p5 = nn.Sequential(conv(128, 128, 3, 2), C2f(128, 128), SPPF(128))
            self.up = nn.Upsample(scale_factor=2.0, mode="nearest")
            self.n4, self.n3 = C2f(256, 128), C2f(192, 64)
            self.d3, self.m4 = conv(64, 64, 3, 2), C2f(192, 128)
            self.d4, self.m5 = conv(128, 128, 3, 2), C2f(256, 128)
            self.head = Head((64, 128, 128), (8, 16, 32))

        def forward(self, x):
            p3 = self.p3(self.stem(x))
            p4 = self.p4(p3)
            p5 = self.p5(p4)
            n4 = self.n4(torch.cat((self.up(p5), p4), 1))
            o3 = self.n3(torch.cat((self.up(n4), p3), 1))
            o4 = self.m4(torch.cat((self.d3(o3), n4), 1))
            o5 = self.m5(torch.cat((self.d4(o4), p5), 1))
            return self.head([o3, o4, o5])

    return Yolo()


def _photo_pool() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """RGB uint8 photos from scikit-image's bundled data: (calibration sources, eval sources)."""
    import skimage.data as sd

    def rgb(a):
        a = np.asarray(a)
        if a.dtype == bool:
            a = a.astype(np.uint8) * 255
        if a.ndim == 2:
            a = np.stack([a] * 3, -1)
        return a[..., :3]

    calib = [rgb(getattr(sd, n)()) for n in ("astronaut", "coffee", "rocket", "hubble_deep_field", "camera",
                                             "brick", "immunohistochemistry", "logo")]
    evals = [rgb(getattr(sd, n)()) for n in ("chelsea", "coins", "moon", "page", "retina", "clock", "colorwheel",
                                             "gravel")]
    return calib, evals


def _crops(sources, n, size, rng) -> np.ndarray:
    """n random crops (scale 0.5-1 of the shorter side), flipped at random, resized to size x size,
    as (n, 1, 3, size, size) float32 in [0, 1]."""
    from skimage.transform import resize

    out = np.zeros((n, 1, 3, size, size), np.float32)
    for i in range(n):
        img = sources[i % len(sources)]
        h, w = img.shape[:2]
        s = int(min(h, w) * rng.uniform(0.5, 1.0))
        y, x = rng.integers(0, h - s + 1), rng.integers(0, w - s + 1)
        crop = img[y: y + s, x: x + s]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        out[i, 0] = resize(crop, (size, size), anti_aliasing=True, preserve_range=True).transpose(2, 0, 1) / 255.0
    return out


def build_yolo_detector():
    torch = _torch(0)
    rng = np.random.default_rng(2)
    model = _yolo_module(torch)
    nn = torch.nn
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d) and m is not model.head.dfl:
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                m.bias.normal_(0, 0.05)
    cal_src, eval_src = _photo_pool()
    calib = {"images": _crops(cal_src, N_CALIB, YOLO_SIZE, rng)}
    evald = {"images": _crops(eval_src, N_EVAL, YOLO_SIZE, rng)}
    x = torch.from_numpy(calib["images"][:, 0])

    # keep activations trained-like (unit scale): each conv is rescaled, in graph order during one
    # forward pass over 8 calibration images, so that its output has std 1
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m is not model.head.dfl]

    def unit(m, a, o):
        s = float(o.std())
        with torch.no_grad():
            m.weight /= s
            m.bias /= s
        return o / s

    hooks = [m.register_forward_hook(unit) for m in convs]
    with torch.no_grad():
        model(x[:8])
    for h in hooks:
        h.remove()
    seen = {}
    h = model.head.register_forward_hook(lambda m, a, o: seen.setdefault("f", a[0]))
    with torch.no_grad():
        model(x)
    h.remove()
    feats = seen["f"]
    head = model.head
    with torch.no_grad():
        # box regression: peaky DFL distributions favouring short distances (boxes 1-8 strides)
        for i, f in enumerate(feats):
            last = head.box[i][-1]
            o = head.box[i](f)
            last.weight *= 3.0 / float(o.std())
            last.bias.copy_((-0.35 * torch.arange(YOLO_REG, dtype=torch.float32)).repeat(4))
        # class logits: std 2.5, then one shared bias so that ~4 objects per image survive
        for i, f in enumerate(feats):
            last = head.cls[i][-1]
            last.bias.zero_()
            last.weight *= 2.5 / float(head.cls[i](f).std())
        out0 = model(x).numpy()

    def count(bias):
        cls = out0[:, 4:]
        logit = np.log(np.clip(cls, 1e-12, 1)) - np.log(np.clip(1 - cls, 1e-12, 1))
        shifted = np.concatenate([out0[:, :4], 1 / (1 + np.exp(-(logit + bias)))], 1)
        return float(np.median([len(yolo_detections(o[None])[0]) for o in shifted]))

    lo, hi = -20.0, 5.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if count(mid) < 5 else (lo, mid)
    with torch.no_grad():
        for i in range(3):
            head.cls[i][-1].bias.fill_(lo)
    onnx_model = _export(model, (x[:1],), ["images"], ["output0"], dynamic_axes={"images": {2: "h", 3: "w"}})
    onnx_model = _set_static(onnx_model, {"images": (1, 3, YOLO_SIZE, YOLO_SIZE)},
                             {"output0": (1, 4 + YOLO_CLASSES, out0.shape[-1])})
    return onnx_model, calib, evald, {"class_bias": round(lo, 3), "conf": YOLO_CONF, "nms_iou": YOLO_NMS}


# ================================================================================ crnn_lstm
CRNN_H, CRNN_W = 32, 128


def _fonts() -> list[str]:
    root = Path("/usr/share/fonts/truetype/dejavu")
    names = ["DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf",
             "DejaVuSerif-Bold.ttf", "DejaVuSansCondensed-Oblique.ttf"]
    fonts = [str(root / n) for n in names if (root / n).is_file()]
    if not fonts:
        raise FileNotFoundError(f"no DejaVu fonts in {root} (apt-get install fonts-dejavu-core)")
    return fonts


@functools.lru_cache(maxsize=None)
def _font(path: str, size: int):
    from PIL import ImageFont

    return ImageFont.truetype(path, size)


def captcha(rng, text: str, fonts) -> np.ndarray:
    """A rendered captcha (CRNN_H, CRNN_W) float32 in [0, 1]: per-character font, size, rotation and
    offset, a background gradient, interference lines and pixel noise."""
    from PIL import Image, ImageDraw, ImageFilter

    W, H = CRNN_W * 2, CRNN_H * 2
    bg = int(rng.integers(170, 256))
    grad = np.linspace(0, rng.uniform(-40, 40), W)[None, :] + np.zeros((H, 1))
    img = Image.fromarray(np.clip(bg + grad, 0, 255).astype(np.uint8), "L")
    x = int(rng.integers(4, 24))
    for ch in text:
        font = _font(fonts[int(rng.integers(len(fonts)))], int(rng.integers(34, 46)))
        glyph = Image.new("L", (60, 64), 0)
        ImageDraw.Draw(glyph).text((8, 2), ch, font=font, fill=255)
        glyph = glyph.rotate(float(rng.uniform(-25, 25)), resample=Image.BILINEAR)
        ink = Image.new("L", glyph.size, int(rng.integers(0, 90)))
        img.paste(ink, (x - 8, int(rng.integers(-6, 6))), glyph)
        x += int(font.getlength(ch)) + int(rng.integers(-3, 4))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(1, 4))):
        pts = [(int(rng.integers(0, W)), int(rng.integers(0, H))) for _ in range(2)]
        draw.line(pts, fill=int(rng.integers(0, 140)), width=int(rng.integers(1, 3)))
    img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0))).resize((CRNN_W, CRNN_H), Image.BILINEAR)
    a = np.asarray(img, np.float32) / 255.0
    return np.clip(a + rng.normal(0, 0.03, a.shape), 0, 1).astype(np.float32)


def _captcha_set(n, seed, fonts):
    rng = np.random.default_rng(seed)
    texts = ["".join(CAPTCHA_CHARS[int(i)] for i in rng.integers(0, len(CAPTCHA_CHARS), rng.integers(4, 7)))
             for _ in range(n)]
    return np.stack([captcha(rng, t, fonts) for t in texts])[:, None], texts


def _crnn_module(torch):
    nn = torch.nn

    def block(c1, c2, pool):
        return [nn.Conv2d(c1, c2, 3, 1, 1), nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(pool, pool)]

    class CRNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.cnn = nn.Sequential(*block(1, 16, 2), *block(16, 32, 2), *block(32, 64, (2, 1)),
                                     *block(64, 64, (2, 1)), nn.Conv2d(64, 96, (2, 1)), nn.ReLU())
            self.rnn = nn.LSTM(96, 64, bidirectional=True)
            self.fc = nn.Linear(128, len(CAPTCHA_CHARS) + 1)

        def logits(self, x):
            f = self.cnn((x - 0.5) / 0.5)                  # (B, 96, 1, 32)
            f = f.squeeze(2).permute(2, 0, 1)              # (T, B, C)
            return self.fc(self.rnn(f)[0])                 # (T, B, K)

        def forward(self, x):
            return torch.softmax(self.logits(x), -1)

    return CRNN()


def build_crnn_lstm(train_seconds: float = 480.0, max_steps: int = 2000):
    torch = _torch(0)
    fonts = _fonts()
    model = _crnn_module(torch)
    imgs, texts = _captcha_set(6000, 10, fonts)
    val_x, val_t = _captcha_set(200, 11, fonts)
    x = torch.from_numpy(imgs)
    targets = [torch.tensor([CAPTCHA_CHARS.index(c) + 1 for c in t]) for t in texts]
    ctc = torch.nn.CTCLoss(blank=0, zero_infinity=True)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    rng = np.random.default_rng(3)
    start, step, acc = time.time(), 0, 0.0
    while time.time() - start < train_seconds and step < max_steps:
        model.train()
        idx = rng.integers(0, len(texts), 32)
        logp = model.logits(x[idx]).log_softmax(-1)
        tg = [targets[i] for i in idx]
        loss = ctc(logp, torch.cat(tg), torch.full((32,), logp.shape[0], dtype=torch.long),
                   torch.tensor([len(t) for t in tg]))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        step += 1
        if step % 100 == 0:
            model.eval()
            with torch.no_grad():
                p = model(torch.from_numpy(val_x)).numpy()
            acc = float(np.mean([ctc_greedy(p[:, i:i + 1]) == t for i, t in enumerate(val_t)]))
            print(f"  crnn step {step} loss {float(loss):.3f} val exact {acc:.2f}", file=sys.stderr)
            if acc >= 0.9:
                break
    model.eval()
    cx, _ = _captcha_set(N_CALIB, 20, fonts)
    ex, et = _captcha_set(N_EVAL, 21, fonts)
    onnx_model = _export(model, (torch.from_numpy(cx[:1]),), ["x"], ["output"])
    return onnx_model, {"x": cx[:, None]}, {"x": ex[:, None]}, {"train_steps": step, "val_exact_match": acc,
                                                                "eval_texts": et}


# ================================================================================ vad_if
VAD_CHUNK, VAD_HIDDEN = 512, 64


def speech_like(rng, seconds: float, sr: int) -> tuple[np.ndarray, np.ndarray]:
    """A stream of alternating speech-like and non-speech segments and its per-sample labels.
    Speech: voiced harmonics (f0 90-260 Hz with drift) shaped by 3 moving formants, syllable-rate
    amplitude modulation, fricative noise bursts. Non-speech: silence, white/brown noise, mains hum,
    tones, clicks. Background noise over everything at a random level."""
    n = int(seconds * sr)
    sig, lab = np.zeros(n), np.zeros(n)
    t = 0
    speech = rng.random() < 0.5
    while t < n:
        m = min(n - t, int(rng.uniform(0.25, 1.4) * sr))
        tt = np.arange(m) / sr
        if speech:
            f0 = rng.uniform(90, 260) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.5, 3) * tt))
            phase = 2 * np.pi * np.cumsum(f0) / sr
            formants = [rng.uniform(300, 900), rng.uniform(900, 2300), rng.uniform(2300, min(3300, sr / 2 - 200))]
            x = np.zeros(m)
            for k in range(1, int((sr / 2 - 100) / f0.max())):
                fk = k * f0
                amp = sum(np.exp(-((fk - F) ** 2) / (2 * 120.0 ** 2)) for F in formants) / k ** 0.5
                x += amp * np.sin(k * phase)
            env = np.clip(np.sin(2 * np.pi * rng.uniform(3, 6) * tt + rng.uniform(0, 6)), 0.05, 1) ** 0.7
            fric = rng.normal(0, 1, m) * (rng.random(m // 400 + 1).repeat(400)[:m] < 0.15)
            fric = np.diff(fric, prepend=0) * 0.3
            x = x * env + fric
            x *= rng.uniform(0.05, 0.5) / max(np.abs(x).max(), 1e-9)
        else:
            kind = rng.integers(0, 5)
            if kind == 0:
                x = np.zeros(m)
            elif kind == 1:
                x = rng.normal(0, rng.uniform(0.005, 0.08), m)
            elif kind == 2:
                x = np.cumsum(rng.normal(0, 1, m))
                x = (x - np.convolve(x, np.ones(64) / 64, "same")) * rng.uniform(0.002, 0.02)
            elif kind == 3:
                f = rng.choice([50.0, 60.0])
                x = sum(np.sin(2 * np.pi * f * k * tt) / k for k in range(1, 6)) * rng.uniform(0.01, 0.1)
            else:
                x = np.sin(2 * np.pi * rng.uniform(400, 3000) * tt) * rng.uniform(0.01, 0.2)
                x[rng.random(m) < 0.001] += rng.uniform(-0.5, 0.5)
        sig[t: t + m], lab[t: t + m] = x, float(speech)
        t += m
        speech = not speech
    sig += rng.normal(0, rng.uniform(0.0005, 0.01), n)
    return sig.astype(np.float32), lab


def _vad_branch_module(torch, n_fft, hop):
    nn = torch.nn
    F = n_fft // 2 + 1

    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_fft = n_fft
            self.stft = nn.Conv1d(1, 2 * F, n_fft, hop, bias=False)
            k = np.arange(n_fft)
            win = np.hanning(n_fft)
            basis = np.concatenate([np.cos(2 * np.pi * np.outer(np.arange(F), k) / n_fft),
                                    -np.sin(2 * np.pi * np.outer(np.arange(F), k) / n_fft)]) * win
            with torch.no_grad():
                self.stft.weight.copy_(torch.from_numpy(basis[:, None, :].astype(np.float32)))
            self.stft.weight.requires_grad_(False)
            self.enc = nn.Sequential(nn.Conv1d(F, 64, 3, 1, 1), nn.ReLU(), nn.Conv1d(64, 64, 3, 2, 1), nn.ReLU(),
                                     nn.Conv1d(64, 64, 3, 2, 1), nn.ReLU())
            self.lstm = nn.LSTM(64, VAD_HIDDEN)
            self.dec = nn.Linear(VAD_HIDDEN, 1)

        def forward(self, x, state):
            z = self.stft(nn.functional.pad(x[:, None, :], (self.n_fft // 2, self.n_fft // 2), mode="reflect"))
            re, im = z.chunk(2, 1)
            mag = torch.sqrt(re * re + im * im + 1e-8)
            h = self.enc(mag).mean(-1)
            out, (hn, cn) = self.lstm(h[None], (state[0:1], state[1:2]))
            return torch.sigmoid(self.dec(torch.relu(out[0]))), torch.cat((hn, cn), 0)

    return Branch()


def _train_vad(torch, branch, sr, seconds, seed):
    rng = np.random.default_rng(seed)
    opt = torch.optim.Adam(branch.parameters(), lr=2e-3)
    seq, batch = 16, 16
    streams = [speech_like(rng, 8.0, sr) for _ in range(48)]
    start, step = time.time(), 0
    branch.train()
    while time.time() - start < seconds:
        xs, ys = [], []
        for _ in range(batch):
            sig, lab = streams[int(rng.integers(len(streams)))]
            s0 = int(rng.integers(0, len(sig) - seq * VAD_CHUNK))
            xs.append(sig[s0: s0 + seq * VAD_CHUNK].reshape(seq, VAD_CHUNK))
            ys.append(lab[s0: s0 + seq * VAD_CHUNK].reshape(seq, VAD_CHUNK).mean(1) > 0.5)
        x = torch.from_numpy(np.stack(xs, 1))                 # (seq, B, chunk)
        y = torch.from_numpy(np.stack(ys, 1).astype(np.float32))
        state = torch.zeros(2, batch, VAD_HIDDEN)
        loss = 0.0
        for i in range(seq):
            p, state = branch(x[i], state)
            loss = loss + torch.nn.functional.binary_cross_entropy(p[:, 0].clamp(1e-6, 1 - 1e-6), y[i])
        opt.zero_grad()
        (loss / seq).backward()
        torch.nn.utils.clip_grad_norm_(branch.parameters(), 5.0)
        opt.step()
        step += 1
    branch.eval()
    return step


def _subgraph(model: onnx.ModelProto, prefix: str, outer: set[str], outputs: list[str]) -> onnx.GraphProto:
    """An exported model's graph as an If body: its inputs become outer-scope references, every other
    name is prefixed, its outputs renamed to ``outputs`` (prefixed)."""
    g = onnx.GraphProto()
    g.CopyFrom(model.graph)
    ren = lambda n: n if (n in outer or n == "") else prefix + n  # noqa: E731
    for node in g.node:
        node.name = prefix + node.name
        for i, n in enumerate(node.input):
            node.input[i] = ren(n)
        for i, n in enumerate(node.output):
            node.output[i] = ren(n)
    for t in g.initializer:
        t.name = ren(t.name)
    for vi in list(g.value_info) + list(g.output):
        vi.name = ren(vi.name)
    del g.input[:]
    # rename the body outputs so that both branches have distinct, predictable names
    for o, new in zip(list(g.output), outputs):
        old = o.name
        for node in g.node:
            for i, n in enumerate(node.output):
                if n == old:
                    node.output[i] = prefix + new
        o.name = prefix + new
    g.name = prefix.strip("/")
    return g


def vad_frames(model, n: int, seed: int, truth_hits: list | None = None) -> dict:
    """n frames from float streaming runs of the vad_if ``model`` (state fed back), 3/4 at 16 kHz,
    1/4 at 8 kHz; per stream half at random positions, half at speech onsets/offsets (where
    decisions flip). ``truth_hits`` collects, per chunk run, whether the float decision is right."""
    rng = np.random.default_rng(seed)
    sess = _session(model)
    out = {"input": [], "state": [], "sr": []}
    per_stream = 8
    for s in range(n // per_stream):
        sr = 8000 if s % 4 == 3 else 16000
        sig, lab = speech_like(rng, 6.0, sr)
        m = len(sig) // VAD_CHUNK
        chunks = sig[: m * VAD_CHUNK].reshape(m, VAD_CHUNK)
        speech = lab[: m * VAD_CHUNK].reshape(m, VAD_CHUNK).mean(1) > 0.5
        edges = [i + d for i in np.nonzero(np.diff(speech))[0] for d in (0, 1) if 8 <= i + d < m]
        pick = set(rng.choice(edges, min(len(edges), per_stream // 2), replace=False).tolist()) if edges else set()
        rest = np.setdiff1d(np.arange(8, m), list(pick))
        pick |= set(rng.choice(rest, per_stream - len(pick), replace=False).tolist())
        state = np.zeros((2, 1, VAD_HIDDEN), np.float32)
        for i, c in enumerate(chunks):
            feed = {"input": c[None], "state": state, "sr": np.array([sr], np.int64)}
            if i in pick:
                for k, v in feed.items():
                    out[k].append(v)
            p, state = sess.run(None, feed)
            if truth_hits is not None:
                truth_hits.append(bool(p.ravel()[0] > 0.5) == bool(speech[i]))
    return {k: np.stack(v) for k, v in out.items()}


def build_vad_if(train_seconds: float = 90.0):
    torch = _torch(0)
    from onnx import TensorProto, helper

    b16, b8 = _vad_branch_module(torch, 256, 64), _vad_branch_module(torch, 128, 32)
    steps16 = _train_vad(torch, b16, 16000, train_seconds, 30)
    steps8 = _train_vad(torch, b8, 8000, train_seconds / 2, 31)
    args = (torch.zeros(1, VAD_CHUNK), torch.zeros(2, 1, VAD_HIDDEN))
    g16 = _subgraph(_export(b16, args, ["input", "state"], ["output", "stateN"]), "b16/",
                    {"input", "state"}, ["output", "stateN"])
    g8 = _subgraph(_export(b8, args, ["input", "state"], ["output", "stateN"]), "b8/",
                   {"input", "state"}, ["output", "stateN"])
    nodes = [
        helper.make_node("Constant", [], ["sr16k"], value=helper.make_tensor("v", TensorProto.INT64, [1], [16000])),
        helper.make_node("Equal", ["sr", "sr16k"], ["is16k"]),
        helper.make_node("If", ["is16k"], ["output", "stateN"], then_branch=g16, else_branch=g8, name="If_sr"),
    ]
    graph = helper.make_graph(
        nodes, "vad_if",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, VAD_CHUNK]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, 1, VAD_HIDDEN]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 1]),
         helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, 1, VAD_HIDDEN])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)

    truth_hits: list[bool] = []
    calib, evald = vad_frames(model, N_CALIB, 40, truth_hits), vad_frames(model, N_EVAL, 41, truth_hits)
    return model, calib, evald, {"train_steps": {"16k": steps16, "8k": steps8},
                                 "float_accuracy_all_stream_frames": round(float(np.mean(truth_hits)), 3)}


# ================================================================================ cache and summary
BUILDERS = {"bert_encoder": build_bert_encoder, "byte_classifier": build_byte_classifier,
            "yolo_detector": build_yolo_detector, "crnn_lstm": build_crnn_lstm, "vad_if": build_vad_if}


def prepare(name: str, cache: Path = DEFAULT_CACHE, force: bool = False) -> Path:
    """Build (once) the model ``name`` into ``cache/name/`` and return that folder."""
    if name not in BUILDERS:
        raise KeyError(f"unknown accuracy model {name!r} (known: {', '.join(MODELS)})")
    folder = Path(cache) / name
    info_path = folder / "info.json"
    if not force and info_path.is_file():
        cached = json.loads(info_path.read_text())
        if (cached.get("format"), cached.get("revision", 1)) == (FORMAT_VERSION, REVISIONS.get(name, 1)):
            return folder
    folder.mkdir(parents=True, exist_ok=True)
    start = time.time()
    model, calib, evald, info = BUILDERS[name]()
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(folder / "model.onnx"))
    np.savez(folder / "calib.npz", **calib)
    np.savez(folder / "eval.npz", **evald)
    info.update(float_summary(name, model, evald, info))
    info.update({"format": FORMAT_VERSION, "revision": REVISIONS.get(name, 1), "build_seconds": round(time.time() - start, 1),
                 "torch": __import__("torch").__version__})
    info_path.write_text(json.dumps(info, indent=1))
    return folder


def float_summary(name: str, model, evald: dict, info: dict | None = None) -> dict:
    """What the float model does on the eval set, and the metric's chance level, so that a
    degenerate metric shows: for decisions (top-1, speech) the share of the most frequent one (a
    constant answer scores that), otherwise the score of unrelated outputs (sample i against i+1)."""
    info = info or {}
    outs = run_model(model, evald)
    if name in ("byte_classifier", "vad_if"):
        dec = [int(np.asarray(o[0]).argmax(-1).ravel()[0]) if name == "byte_classifier"
               else int(float(np.ravel(o[0])[0]) > 0.5) for o in outs]
        chance = float(np.bincount(dec).max() / len(dec))
    else:
        _, chance = task_metric(name, outs, outs[1:] + outs[:1])
    s: dict = {"metric": METRICS[name][0], "chance_level": round(chance, 4)}
    if name == "bert_encoder":
        e = np.stack([o[0][0] for o in outs])
        s["embedding_norm_mean"] = round(float(np.linalg.norm(e, axis=1).mean()), 3)
        s["mean_tokens"] = round(float(evald["attention_mask"].sum(-1).mean()), 1)
    elif name == "byte_classifier":
        p = np.stack([o[0][0] for o in outs])
        s["predicted_classes"] = np.bincount(p.argmax(1), minlength=p.shape[1]).tolist()
        if "eval_labels" in info:
            s["float_accuracy_eval"] = round(float(np.mean(p.argmax(1) == np.array(info["eval_labels"]))), 3)
        s["top1_prob_median"] = round(float(np.median(p.max(1))), 3)
        s["top1_top2_margin_median"] = round(float(np.median(np.diff(np.sort(p, 1)[:, -2:], axis=1))), 3)
    elif name == "yolo_detector":
        dets = [yolo_detections(o[0]) for o in outs]
        s["detections_per_image"] = [len(d[0]) for d in dets]
        s["detection_scores_median"] = round(float(np.median(np.concatenate([d[1] for d in dets]))), 3)
        s["box_output_max"] = round(float(max(np.abs(o[0][0, :4]).max() for o in outs)), 1)
    elif name == "crnn_lstm":
        texts = [ctc_greedy(o[0]) for o in outs]
        s["decoded"] = texts
        if "eval_texts" in info:
            s["float_exact_vs_truth"] = round(float(np.mean([a == b for a, b in zip(texts, info["eval_texts"])])), 3)
        s["char_prob_median"] = round(float(np.median([o[0].max(-1).ravel() for o in outs])), 3)
    elif name == "vad_if":
        p = np.array([float(o[0].ravel()[0]) for o in outs])
        s["speech_rate"] = round(float((p > 0.5).mean()), 3)
        s["probs_within_0.1_of_threshold"] = int((np.abs(p - 0.5) < 0.1).sum())
    return s


def describe(path: Path) -> dict:
    """Nodes (incl. subgraphs), weighted ops, op histogram, inputs and outputs of a model."""
    m = onnx.load(str(path))
    ops: dict[str, int] = {}

    def walk(g):
        for n in g.node:
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)

    walk(m.graph)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_accuracy import weighted_op_share

    total, _ = weighted_op_share(m)
    shape = lambda v: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]  # noqa: E731
    return {"nodes": sum(ops.values()), "weighted_ops": total, "ops": dict(sorted(ops.items())),
            "inputs": {i.name: shape(i) for i in m.graph.input},
            "outputs": {o.name: shape(o) for o in m.graph.output}}


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    for name in args.models:
        folder = prepare(name, args.cache, force=args.force)
        info = json.loads((folder / "info.json").read_text())
        d = describe(folder / "model.onnx")
        print(f"{name}: {d['nodes']} nodes, {d['weighted_ops']} weighted ops, inputs {d['inputs']}, "
              f"outputs {d['outputs']}")
        print("   ", {k: v for k, v in info.items() if k not in ("eval_texts", "decoded", "eval_labels", "classes")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
