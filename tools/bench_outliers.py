"""Outlier passes (issue 15, item 4): the default quantization pipeline with and without
smooth-quant and equalize-cross-layer (inserted after the first cleanup), on the shared corpus and
the BERT-style encoder of tools/accuracy_models.py.

    python tools/bench_outliers.py                                   # every model, every variant
    python tools/bench_outliers.py --models bert_encoder --variants base,sq
    python tools/bench_outliers.py --sq-options 'min_outlier_ratio=4' --json out.json

Per model and variant: the task metric against the float model on the held-out eval set
(../shared/corpus/task_metrics.py for the corpus; mean cosine for bert_encoder), the mean
cosine of the outputs, the minimum output SNR, the quantization time (qpasses.run_pipeline, data
loading excluded), the time of the inserted passes, and what they changed (their stats).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
SHARED_CORPUS_CODE = REPO.parent / "shared" / "corpus"
DEFAULT_CORPUS = Path(os.path.expanduser("~/.cache/qp-corpus"))
DEFAULT_ACC = Path(os.path.expanduser("~/.cache/qp-bench/acc"))
CORPUS_MODELS = ("ppocr_v4_det", "ppocr_v4_rec", "ppocr_v2_cls", "ddddocr_det")
ACC_MODELS = ("bert_encoder",)
VARIANTS = {"base": (), "sq": ("smooth-quant",), "cle": ("equalize-cross-layer",),
            "both": ("equalize-cross-layer", "smooth-quant")}


def pipeline_with(extra: tuple[str, ...], options: dict[str, str]) -> str:
    """QUANTIZE_PIPELINE without the passes of VARIANTS, then ``extra`` inserted after its first cleanup."""
    from qpasses.core.pipeline import QUANTIZE_PIPELINE

    own = {p for v in VARIANTS.values() for p in v}
    parts = [p for p in QUANTIZE_PIPELINE.split(",") if p.split("{")[0] not in own]
    at = parts.index("cleanup") + 1
    inserted = [p + (f"{{{options[p]}}}" if options.get(p) else "") for p in extra]
    return ",".join(parts[:at] + inserted + parts[at:])


def feeds_of(path: Path) -> list[dict]:
    z = np.load(path)
    n = len(z[z.files[0]])
    return [{k: z[k][i] for k in z.files} for i in range(n)]


def run_model(model, feeds):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    src = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    return [sess.run(None, f) for f in feeds]


def cosine(outs_f, outs_q) -> float:
    vals = []
    for a, b in zip(outs_f, outs_q):
        x = np.concatenate([np.ravel(o).astype(np.float64) for o in a if np.issubdtype(np.asarray(o).dtype, np.floating)])
        y = np.concatenate([np.ravel(o).astype(np.float64) for o in b if np.issubdtype(np.asarray(o).dtype, np.floating)])
        vals.append(float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-30)))
    return float(np.mean(vals))


def min_snr(outs_f, outs_q) -> float:
    vals = []
    for i in range(len(outs_f[0])):
        if not np.issubdtype(np.asarray(outs_f[0][i]).dtype, np.floating):
            continue
        ref = np.concatenate([np.ravel(o[i]) for o in outs_f]).astype(np.float64)
        got = np.concatenate([np.ravel(o[i]) for o in outs_q]).astype(np.float64)
        err = float(np.sum((ref - got) ** 2))
        vals.append(10 * np.log10(float(np.sum(ref ** 2)) / err) if err > 0 else float("inf"))
    return min(vals)


def model_files(name: str, corpus: Path, acc: Path) -> tuple[Path, Path, Path]:
    if name in CORPUS_MODELS:
        return corpus / "models" / f"{name}.onnx", corpus / "calib" / f"{name}.npz", corpus / "eval" / f"{name}.npz"
    folder = acc / name
    return folder / "model.onnx", folder / "calib.npz", folder / "eval.npz"


def task(name: str, path: Path, outs_f, outs_q) -> tuple[str, float]:
    if name in CORPUS_MODELS:
        sys.path.insert(0, str(SHARED_CORPUS_CODE))
        from task_metrics import task_metric

        return task_metric(name, outs_f, outs_q, model_path=str(path))
    return "mean cosine", cosine(outs_f, outs_q)


def bench(name: str, variants: list[str], corpus: Path, acc: Path, options: dict[str, str], config=None) -> list[dict]:
    import qpasses
    from qpasses.core.context import RunContext
    from qpasses.evaluation.summary import weighted_ops
    from qpasses.ir.decisions import float_reasons

    path, calib, evalp = model_files(name, corpus, acc)
    if not path.is_file():
        print(f"{name}: {path} absent, skipped", file=sys.stderr)
        return []
    eval_feeds = feeds_of(evalp)
    outs_f = run_model(str(path), eval_feeds)
    rows = []
    for variant in variants:
        extra = VARIANTS[variant]
        text = pipeline_with(extra, options)
        ctx = RunContext(config, str(calib))
        t0 = time.perf_counter()
        model, records = qpasses.run_pipeline(str(path), text, ctx=ctx)
        seconds = time.perf_counter() - t0
        added = [r for r in records if r.name in extra]
        proto = model.to_proto()
        outs_q = run_model(proto, eval_feeds)
        metric, value = task(name, path, outs_f, outs_q)
        eight_bit, weighted = weighted_ops(proto)
        row = {"model": name, "variant": variant, "metric": metric, "task": round(float(value), 4),
               "cosine": round(cosine(outs_f, outs_q), 5), "snr_db": round(min_snr(outs_f, outs_q), 2),
               "weighted_8bit": f"{eight_bit}/{weighted}", "kept_float": sum(r.get("pass") == "search-precision" for r in float_reasons(model).values()),
               "seconds": round(seconds, 2), "pass_seconds": round(sum(r.seconds for r in added), 2),
               "pass_stats": {r.name: r.stats for r in added},
               "findings": {p: ctx.findings.as_dict().get(p) for p in extra}}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "findings"}), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    base = {r["model"]: r for r in rows if r["variant"] == "base"}
    lines = ["| model | metric | variant | task | cosine | SNR dB | 8-bit weighted ops | promoted | time s | pass s | changed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base.get(r["model"])
        delta = "" if b is None or r is b else f" ({r['task'] - b['task']:+.4f})"
        changed = ", ".join(f"{k}: {v}" for s in r["pass_stats"].values() for k, v in s.items())
        lines.append(f"| {r['model']} | {r['metric']} | {r['variant']} | {r['task']:.4f}{delta} | {r['cosine']:.4f} | "
                     f"{r['snr_db']:.2f} | {r['weighted_8bit']} | {r['kept_float']} | {r['seconds']:.1f} | {r['pass_seconds']:.2f} | {changed} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(CORPUS_MODELS + ACC_MODELS))
    ap.add_argument("--variants", default="base,sq,cle,both")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--acc", type=Path, default=DEFAULT_ACC, help="tools/accuracy_models.py's cache")
    ap.add_argument("--sq-options", default="", help="options of smooth-quant, e.g. 'min_outlier_ratio=4'")
    ap.add_argument("--cle-options", default="", help="options of equalize-cross-layer")
    ap.add_argument("--config", default="", help="qpasses config as JSON text, e.g. '{\"per_channel\": false}'")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    options = {"smooth-quant": args.sq_options, "equalize-cross-layer": args.cle_options}
    variants = [v for v in args.variants.split(",") if v]
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        rows += bench(name, variants, args.corpus, args.acc, options, json.loads(args.config) if args.config else None)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"\n{datetime.date.today()} commit {commit}\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
