"""The output against onnxruntime's own all-int8 QDQ model of the same model and calibration data
(`qpasses run --vs-onnxruntime`): latency and size, the two things users quantize for."""
from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path

import onnx

RUNS = 20   # timed runs of each model (after 3 warm-up runs each)


def ort_qdq_model(source: Path, data, folder: Path) -> tuple[Path, bool]:
    """onnxruntime's `quantize_static` of ``source`` on ``data`` (QDQ, uint8 activations, int8
    weights, MinMax), per channel, or per tensor where onnxruntime cannot load its per-channel
    model (per-axis DequantizeLinear below opset 13); returns (path, per_channel)."""
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(data)

        def get_next(self):
            return next(self.feeds, None)

        def rewind(self):
            self.feeds = iter(data)

    failure, root = None, logging.getLogger()
    for per_channel in (True, False):
        out = folder / f"onnxruntime_{'per_channel' if per_channel else 'per_tensor'}.onnx"
        level = root.level
        root.setLevel(logging.ERROR)   # its advice to pre-process, on the root logger
        try:
            quantize_static(str(source), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=CalibrationMethod.MinMax)
        finally:
            root.setLevel(level)
        try:
            single_thread_session(out)
            return out, per_channel
        except Exception as exc:   # onnxruntime raises its own exception types
            failure = exc
    raise RuntimeError(f"onnxruntime cannot load its own quantized model ({failure})")


def single_thread_session(path: Path):
    from ..calibration.sessions import ort_session

    return ort_session(str(path), threads=1)


def interleaved_latencies(paths: list[Path], feed: dict, runs: int = RUNS) -> list[float]:
    """Median milliseconds of ``runs`` single-thread runs of ``feed`` per model, the models' runs
    interleaved (the order reversed every other round) so that other load falls on each alike."""
    sessions = [single_thread_session(p) for p in paths]
    for s in sessions:
        for _ in range(3):
            s.run(None, feed)
    times: list[list[float]] = [[] for _ in sessions]
    for r in range(runs):
        for i in (range(len(sessions)) if r % 2 == 0 else reversed(range(len(sessions)))):
            start = time.perf_counter()
            sessions[i].run(None, feed)
            times[i].append(1e3 * (time.perf_counter() - start))
    return [statistics.median(t) for t in times]


def model_bytes(path: Path) -> int:
    """The model file's bytes with its external data files."""
    model = onnx.load(str(path), load_external_data=False)
    files = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    return path.stat().st_size + sum((path.parent / f).stat().st_size for f in files)


def compare(source: Path, output: Path, data, runs: int = RUNS) -> dict:
    """Latency (ms, interleaved single-thread runs of the first feed) and size (MB) of ``output``
    and of onnxruntime's QDQ model of ``source`` on the same ``data``, with their ratios."""
    feed = next(iter(data))
    with tempfile.TemporaryDirectory(prefix="qpasses-vs-ort-") as tmp:
        theirs, per_channel = ort_qdq_model(source, data, Path(tmp))
        mine_ms, theirs_ms = interleaved_latencies([output, theirs], feed, runs)
        mine_mb, theirs_mb = model_bytes(output) / 1e6, model_bytes(theirs) / 1e6
    return {"onnxruntime": f"quantize_static QDQ U8S8 {'per-channel' if per_channel else 'per-tensor'} MinMax",
            "latency_ms": _figures(mine_ms), "onnxruntime_latency_ms": _figures(theirs_ms),
            "latency_ratio": round(mine_ms / theirs_ms, 3), "size_mb": round(mine_mb, 6),
            "onnxruntime_size_mb": round(theirs_mb, 6), "size_ratio": round(mine_mb / theirs_mb, 3), "runs": runs}


def _figures(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant figures: a sub-millisecond latency kept to three decimals
    read 0.016 against 0.025 ms, a ratio 1 % off the one computed from the times."""
    return float(f"{value:.{digits}g}")


def line(result: dict) -> str:
    """'against onnxruntime's QDQ model (...): latency 1.09x (81.1 vs 74.8 ms, one thread), size 1.12x (...)'."""
    return (f"against onnxruntime's own QDQ model ({result['onnxruntime']}): latency {result['latency_ratio']:.2f}x "
            f"({result['latency_ms']:.3g} vs {result['onnxruntime_latency_ms']:.3g} ms, one thread, median of "
            f"{result['runs']} interleaved runs), size {result['size_ratio']:.2f}x ({result['size_mb']:.3g} vs "
            f"{result['onnxruntime_size_mb']:.3g} MB)")
