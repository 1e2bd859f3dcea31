"""Wall time of calibration and of the default pipeline, local vs the Ray executor, and the scaling
model: which share of the run parallelises, measured from the tasks' own clocks.

    python tools/bench_ray.py                                  # the four corpus models
    python tools/bench_ray.py --models example --samples 32    # no corpus needed
    python tools/bench_ray.py --json ray.json
    python tools/bench_ray.py --models ppocr_v4_rec --no-calibration --config '{"accuracy": {"target": 20}}'

In one process: onnxruntime's quantize_static (MinMax / Percentile: its calibration plus
quantization) as the reference, qpasses' calibration run locally, then on a fresh local Ray cluster
of 1 and of 2 CPUs (``ray.init(num_cpus=k)``; an untimed run of the bundled example starts the
workers and imports the passes, locally as on Ray). With 1 CPU
the shards run one after the other, so the run is the driver's serial work (model export, reading
and shipping the feeds, merging) plus the tasks' seconds: p = sum(task seconds) / wall is the
parallel share, and Amdahl's law T(n) = T(1) * (1 - p + p / n) predicts n CPUs (compared with the
measured 2-CPU run). Every Ray result is checked identical to the local one (ranges; model bytes;
search-precision's decision, whose checks run as speculative rounds of tasks: checks / rounds).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qpasses import executors  # noqa: E402
from qpasses.api import run_pipeline  # noqa: E402
from qpasses.calibration import sharded  # noqa: E402
from qpasses.calibration.ranges import calibrate_ranges  # noqa: E402
from qpasses.cli.examples import example_data, example_model  # noqa: E402
from qpasses.executors import speculate  # noqa: E402
from qpasses.ir.model import load, save  # noqa: E402

CORPUS = Path.home() / ".cache" / "qp-corpus"
ORT_METHOD = {"minmax": "MinMax", "percentile": "Percentile"}


class _Reader:
    def __init__(self, feeds):
        self.feeds, self.i = feeds, 0

    def get_next(self):
        self.i += 1
        return self.feeds[self.i - 1] if self.i <= len(self.feeds) else None

    def rewind(self):
        self.i = 0


def _load(name: str, samples: int, corpus: Path):
    """(model path, feeds) of a corpus model, or of the bundled example."""
    if name == "example":
        path = Path(tempfile.mkdtemp()) / "example.onnx"
        save(load(example_model()), path)
        data = example_data(samples)
    else:
        path = corpus / "models" / f"{name}.onnx"
        data = dict(np.load(corpus / "calib" / f"{name}.npz"))
    count = min(samples, len(next(iter(data.values()))))
    return path, [{k: v[i] for k, v in data.items()} for i in range(count)]


def _ort_seconds(path: Path, feeds, method: str) -> float:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        quantize_static(str(path), str(Path(tmp) / "q.onnx"), _Reader(feeds), quant_format=QuantFormat.QDQ,
                        calibrate_method=getattr(CalibrationMethod, ORT_METHOD[method]))
        return time.perf_counter() - start


def _calibrate(path: Path, feeds, method: str, executor):
    model = load(path)
    start = time.perf_counter()
    ranges = calibrate_ranges(model, feeds, method=method, executor=executor)
    return time.perf_counter() - start, ranges


CONFIG: dict = {}   # --config: the pipeline runs' config (e.g. a search-precision target)


def _pipeline(path: Path, feeds, spec: str, out: Path):
    """(seconds, model bytes, search-precision's decision, its speculative rounds)."""
    speculate.LAST.clear()
    start = time.perf_counter()
    model, _ = run_pipeline(str(path), config=dict(CONFIG, executor=spec), calibration_data=feeds)
    seconds = time.perf_counter() - start
    return seconds, save(model, out).read_bytes(), model.decisions.get("precision_search"), dict(speculate.LAST)


def _warm(spec: str, out: Path) -> None:
    """Untimed: the example through calibration and the default pipeline (workers start, passes import)."""
    path, feeds = _load("example", 16, CORPUS)
    _calibrate(path, feeds, "minmax", executors.get(spec))
    _pipeline(path, feeds, spec, out / "warm.onnx")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="ppocr_v2_cls,ppocr_v4_det,ppocr_v4_rec,ddddocr_det")
    ap.add_argument("--methods", default="minmax,percentile")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--no-pipeline", action="store_true", help="time calibration only")
    ap.add_argument("--no-calibration", action="store_true", help="time the pipeline only")
    ap.add_argument("--config", type=json.loads, default={},
                    help='the pipeline\'s config as JSON, e.g. \'{"accuracy": {"target": 20}}\'')
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import ray

    from qpasses.executors.ray import runtime_env

    CONFIG.update(args.config)
    runs = [] if args.no_calibration else [(m, meth) for m in args.models.split(",") for meth in args.methods.split(",")]
    data = {m: _load(m, args.samples, args.corpus) for m in args.models.split(",")}
    rows = {run: {} for run in runs}
    pipes = {m: {} for m in data} if not args.no_pipeline else {}
    out = Path(tempfile.mkdtemp())
    for (m, meth), row in rows.items():
        path, feeds = data[m]
        row["ort"] = _ort_seconds(path, feeds, meth)
        row["local"], row["ranges"] = _calibrate(path, feeds, meth, None)
        print(f"{m} {meth}: ort {row['ort']:.2f} s, local {row['local']:.2f} s", file=sys.stderr)
    _warm("local", out)
    for m, pipe in pipes.items():
        pipe["local"], pipe["bytes"], pipe["search"], _ = _pipeline(data[m][0], data[m][1], "local", out / f"{m}.local.onnx")
        print(f"{m} pipeline: local {pipe['local']:.2f} s", file=sys.stderr)
    for cpus in (1, 2):
        start = time.perf_counter()
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env())
        executors._cache.pop(("ray", None), None)
        executor = executors.get("ray")
        startup = time.perf_counter() - start
        _warm("ray", out)
        for (m, meth), row in rows.items():
            path, feeds = data[m]
            row[f"ray{cpus}"], ranges = _calibrate(path, feeds, meth, executor)
            row[f"tasks{cpus}"] = sum(sharded.LAST["task_seconds"])
            row["identical"] = row.get("identical", True) and ranges == row["ranges"]
            print(f"{m} {meth}: ray {cpus} CPU {row[f'ray{cpus}']:.2f} s", file=sys.stderr)
        for m, pipe in pipes.items():
            pipe[f"ray{cpus}"], blob, search, pipe[f"rounds{cpus}"] = _pipeline(data[m][0], data[m][1], "ray",
                                                                                 out / f"{m}.ray{cpus}.onnx")
            pipe["identical"] = pipe.get("identical", True) and blob == pipe["bytes"] and search == pipe["search"]
            print(f"{m} pipeline: ray {cpus} CPU {pipe[f'ray{cpus}']:.2f} s", file=sys.stderr)
        ray.shutdown()
        print(f"ray.init(num_cpus={cpus}): {startup:.1f} s", file=sys.stderr)
    report = _report(rows, pipes, args.samples)
    print(report)
    if args.json:
        args.json.write_text(json.dumps({"calibration": {f"{m} {meth}": {k: v for k, v in r.items() if k != "ranges"}
                                                         for (m, meth), r in rows.items()},
                                         "pipeline": {m: {k: v for k, v in p.items() if k != "bytes"}
                                                      for m, p in pipes.items()}}, indent=2))
    return 0 if all(r["identical"] for r in rows.values()) and all(p["identical"] for p in pipes.values()) else 1


def _rounds(last: dict) -> str:
    """Rounds of tasks after the first check (+1: the first), candidates scored in them."""
    return f"{last['rounds'] + 1} ({last['scored'] + 1} scored)" if last else "1"


def _amdahl(t1: float, p: float, n: int) -> float:
    return t1 * (1 - p + p / n)


def _report(rows: dict, pipes: dict, samples: int) -> str:
    lines = [f"### Calibration, {samples} samples (seconds; ratio: onnxruntime's quantize_static time / ours)", "",
             "| model | method | ort | local | ray 1 CPU | ray 2 CPU | local/ray2 | ort/ray2 | parallel share p "
             "| predicted 2 / 4 / 8 / 16 CPU | identical |", "|" + "---|" * 11] if rows else []
    for (m, meth), r in rows.items():
        p = min(1.0, r["tasks1"] / r["ray1"])
        pred = " / ".join(f"{_amdahl(r['ray1'], p, n):.2f}" for n in (2, 4, 8, 16))
        lines.append(f"| {m} | {meth} | {r['ort']:.2f} | {r['local']:.2f} | {r['ray1']:.2f} | {r['ray2']:.2f} "
                     f"| {r['local'] / r['ray2']:.2f} | {r['ort'] / r['ray2']:.2f} | {p:.2f} | {pred} "
                     f"| {'yes' if r['identical'] else 'NO'} |")
    if pipes:
        lines += ["", "### Default pipeline (calibrate, select-by-snr, search-precision, ...; seconds)", "",
                  "| model | local | ray 1 CPU | ray 2 CPU | local/ray2 | search-precision checks: rounds on 1 / 2 CPU "
                  "| its seconds on 2 CPU: quantizing (driver) / scoring (tasks) | model bytes and decisions identical |",
                  "|" + "---|" * 8]
        for m, r in pipes.items():
            ran = r["search"] and r["search"]["evaluations"] > 1 and r["rounds2"]
            search = (f"{r['search']['evaluations']}: {_rounds(r['rounds1'])} / {_rounds(r['rounds2'])}" if ran
                      else "1 (target met)" if r["search"] else "—")
            split = f"{r['rounds2']['build_seconds']:.2f} / {r['rounds2']['task_seconds']:.2f}" if ran else "—"
            lines.append(f"| {m} | {r['local']:.2f} | {r['ray1']:.2f} | {r['ray2']:.2f} | {r['local'] / r['ray2']:.2f} "
                         f"| {search} | {split} | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
