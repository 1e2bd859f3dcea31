"""Larger held-out eval sets for the accuracy benchmark (issue 32, item 5): 128 samples per model
(one sample = 0.8 % instead of 3 %), so a task metric can resolve about 1 %.

Same recipes as the sets they extend, from held-out sources only, with seeds the calibration and
32-sample eval sets do not use:

* corpus models: ../shared/corpus/build_data.py's functions (imported, run with its output folder
  pointed at a temporary one): rendered text lines from the eval sentence pool (docstrings of
  modules no calibration sentence comes from) over eval photos, the page's held-out line crops,
  rendered documents and crops of scikit-image's text image for ppocr_v4_det, click captchas on
  eval photos for ddddocr_det;
* built models: tools/accuracy_models.py's functions: eval-pool sentences (bert_encoder), held-out
  files not in the calibration set (byte_classifier), crops of the eval photos (yolo_detector),
  captchas of a new seed (crnn_lstm), frames of new float streaming runs (vad_if).

    python tools/build_eval_sets.py                          # all 9 -> ~/.cache/qp-bench/eval128/<model>.npz
    python tools/build_eval_sets.py ppocr_v4_rec --samples 256
    python tools/bench_accuracy.py --eval-dir ~/.cache/qp-bench/eval128

Each npz has the corpus layout (per input name an array (N, *feed_shape)); calibration inputs found
in a set are an error.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import accuracy_models as acc  # noqa: E402  (tools/accuracy_models.py)

SHARED_CORPUS_CODE = HERE.parent.parent / "shared" / "corpus"
DEFAULT_OUT = Path(os.path.expanduser("~/.cache/qp-bench/eval128"))
DEFAULT_CORPUS = Path(os.path.expanduser("~/.cache/qp-corpus"))
CORPUS_MODELS = ("ppocr_v4_det", "ppocr_v4_rec", "ppocr_v2_cls", "ddddocr_det")
MODELS = CORPUS_MODELS + acc.MODELS
SEED = 128   # no set of build_data.py or accuracy_models.py uses seeds from here on


@functools.lru_cache(maxsize=None)
def corpus_recipes():
    """build_data.py imported with its output folders in a temporary directory (its import makes them)."""
    os.environ["QP_CORPUS_DIR"] = tempfile.mkdtemp(prefix="qp-eval128-")
    sys.path.insert(0, str(SHARED_CORPUS_CODE))
    return importlib.import_module("build_data")


def text_crops(bd, n: int, rng) -> list[np.ndarray]:
    """The page's held-out line crops, then rendered eval-pool lines (30 % over an eval photo)."""
    real = [c for line, c in bd.PAGE_SEGS if line % 2 == 1]
    crops = real + bd.text_lines(bd.EVAL_SENT, bd.PHOTOS_EVAL, n - len(real), rng, 6.4)
    return [crops[i] for i in rng.permutation(len(crops))][:n]


def build(name: str, n: int, cache: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED + MODELS.index(name))
    if name in ("ppocr_v4_rec", "ppocr_v2_cls"):
        bd = corpus_recipes()
        crops = text_crops(bd, n, np.random.default_rng(SEED))   # the same lines for both models
        if name == "ppocr_v4_rec":
            return {"x": np.stack([bd.ppocr_norm(c, 48, 320) for c in crops])}
        return {"x": np.stack([bd.ppocr_norm(c, 48, 192, rotate180=i % 2 == 1) for i, c in enumerate(crops)])}
    if name == "ppocr_v4_det":
        bd = corpus_recipes()
        text, photos = bd.rgb(bd.sd.text()), list(bd.PHOTOS_EVAL.values())
        ims = [bd.render_document(bd.EVAL_SENT, bd.PHOTOS_EVAL, rng, 384) if i % 4 < 2 else
               bd.random_crop(text, rng, 0.6, flip=False) if i % 4 == 2 else
               bd.random_crop(photos[rng.integers(len(photos))], rng) for i in range(n)]
        return {"x": np.stack([bd.det_norm(im, 384) for im in ims])}
    if name == "ddddocr_det":
        bd = corpus_recipes()
        return {"images": np.stack([bd.ddddocr_det_prep(bd.click_captcha(bd.PHOTOS_EVAL, rng)) for _ in range(n)])}
    if name == "bert_encoder":
        return acc._bert_data(acc._docstring_sentences()[1], n, rng)
    if name == "byte_classifier":
        files = acc._byte_files()
        held = [p for paths in files.values() for p in paths if zlib.crc32(str(p).encode()) % 5 == 0]
        calib = {w.tobytes() for w in np.load(acc.prepare(name, cache) / "calib.npz")["bytes"][:, 0]}
        windows = [w for w in (acc._byte_window(held[i]) for i in rng.permutation(len(held))) if w.tobytes() not in calib]
        return {"bytes": np.stack(windows[:n])[:, None, :]}
    if name == "yolo_detector":
        return {"images": acc._crops(acc._photo_pool()[1], n, acc.YOLO_SIZE, rng)}
    if name == "crnn_lstm":
        return {"x": acc._captcha_set(n, SEED, acc._fonts())[0][:, None]}
    if name == "vad_if":
        import onnx

        return acc.vad_frames(onnx.load(str(acc.prepare(name, cache) / "model.onnx")), n, SEED)
    raise KeyError(f"unknown model {name!r} (known: {', '.join(MODELS)})")


def calibration_path(name: str, corpus: Path, cache: Path) -> Path:
    return corpus / "calib" / f"{name}.npz" if name in CORPUS_MODELS else cache / name / "calib.npz"


def overlap(data: dict, calib_path: Path) -> int:
    """How many samples of ``data`` equal a calibration sample (every input the same)."""
    if not calib_path.is_file():
        return 0
    with np.load(calib_path) as z:
        seen = {tuple(z[k][i].tobytes() for k in sorted(data)) for i in range(len(z[sorted(data)[0]]))}
    return sum(tuple(data[k][i].tobytes() for k in sorted(data)) in seen for i in range(len(data[sorted(data)[0]])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help=f"default: all of {', '.join(MODELS)}")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--cache", type=Path, default=acc.DEFAULT_CACHE, help="tools/accuracy_models.py's built models")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        print(f"build_eval_sets: unknown model {unknown[0]!r} (known: {', '.join(MODELS)})", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models or MODELS:
        start = time.time()
        data = build(name, args.samples, args.cache)
        clash = overlap(data, calibration_path(name, args.corpus, args.cache))
        if clash:
            print(f"build_eval_sets: {name}: {clash} samples equal calibration samples", file=sys.stderr)
            return 1
        np.savez_compressed(args.out / f"{name}.npz", **data)
        shapes = ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in data.items())
        print(f"{name}: {shapes} ({time.time() - start:.0f} s) -> {args.out / (name + '.npz')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
