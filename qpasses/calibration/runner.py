"""Run the float model once over the calibration samples and stream per-tensor statistics.

One onnxruntime CPU session runs an augmented copy of the model:
- min/max methods: every float activation gets ReduceMin/ReduceMax nodes whose scalar results are
  extra graph outputs (reduced inside onnxruntime, nothing large leaves the session);
- histogram methods: every float activation is itself an extra graph output; each sample's arrays
  are counted into the streaming histograms and dropped before the next sample.
Float graph inputs are measured from the feeds directly. Memory therefore stays at one sample's
activations plus a fixed amount per tensor, whatever the number of samples.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import CalibrationDataError
from ..ir import EXTERNAL_DATA_THRESHOLD, QModel, tensor_bytes
from .collectors import HISTOGRAM_METHODS, TensorStats, finalise, histogram_bins
from .data import CalibrationData, model_inputs, open_data, validate

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE})
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                        "Bernoulli"})
MIN_SUFFIX, MAX_SUFFIX = "__qpasses_min", "__qpasses_max"


def activation_tensors(proto: onnx.ModelProto, fallback_types: dict | None = None) -> list[tuple[str, int]]:
    """(name, elem_type) of every float activation of the top-level graph, in graph order: float
    graph inputs that are not initializers, then float node outputs that are not constants (a
    Constant node's output, or computed only from initializers and constants). Subgraphs are skipped.
    """
    graph = proto.graph
    types = _elem_types(proto)
    for name, elem in (fallback_types or {}).items():
        types.setdefault(name, elem)
    constant = {t.name for t in graph.initializer}
    out = [(vi.name, types.get(vi.name, 0)) for vi in graph.input if vi.name not in constant]
    for node in graph.node:
        inputs = [i for i in node.input if i]
        if node.op_type not in RANDOM_OPS and all(i in constant for i in inputs) and node.domain in ("", "ai.onnx"):
            constant.update(o for o in node.output if o)
            continue
        out.extend((o, types.get(o, 0)) for o in node.output if o)
    seen, result = set(), []
    for name, elem in out:
        if elem in FLOAT_TYPES and name not in seen:
            seen.add(name)
            result.append((name, elem))
    return result


def _elem_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Element types of the top-level tensors, by shape inference on a weight-free copy (types do
    not depend on weight values, and the copy stays small for models of any size)."""
    light = onnx.ModelProto()
    light.ir_version = proto.ir_version
    light.opset_import.extend(proto.opset_import)
    light.functions.extend(proto.functions)
    g = light.graph
    g.node.extend(proto.graph.node)
    g.input.extend(proto.graph.input)
    g.output.extend(proto.graph.output)
    g.value_info.extend(proto.graph.value_info)
    listed = {vi.name for vi in proto.graph.input}
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in proto.graph.initializer if t.name not in listed)
    try:
        g2 = onnx.shape_inference.infer_shapes(light, strict_mode=False).graph
    except Exception:  # inference failure on exotic ops: keep what the model declares
        g2 = g
    types = {}
    for vi in list(g2.input) + list(g2.value_info) + list(g2.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    return types


def _gs_types(model: QModel) -> dict[str, int]:
    """Element types gs knows (from the model's own value_info), as ONNX enums."""
    out = {}
    for name, tensor in model.tensors().items():
        dtype = getattr(tensor, "dtype", None)
        if dtype is None:
            continue
        try:
            out[name] = int(dtype) if isinstance(dtype, int) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        except Exception:
            continue
    return out


def augment(proto: onnx.ModelProto, tensors: list[tuple[str, int]], reduce: bool) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``proto`` whose outputs expose the tensors (or their ReduceMin/ReduceMax when
    ``reduce``). Returns (model, names to fetch)."""
    aug = onnx.ModelProto()
    aug.CopyFrom(proto)
    del aug.metadata_props[:]
    graph = aug.graph
    existing = {o.name for o in graph.output}
    taken = existing | {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    fetch = []
    for name, elem in tensors:
        if reduce:
            lo, hi = _unique(name + MIN_SUFFIX, taken), _unique(name + MAX_SUFFIX, taken)
            graph.node.append(helper.make_node("ReduceMin", [name], [lo], name=lo, keepdims=0))
            graph.node.append(helper.make_node("ReduceMax", [name], [hi], name=hi, keepdims=0))
            graph.output.extend([helper.make_tensor_value_info(lo, elem, []),
                                 helper.make_tensor_value_info(hi, elem, [])])
            fetch += [lo, hi]
        else:
            if name not in existing:
                graph.output.append(helper.make_tensor_value_info(name, elem, None))
            fetch.append(name)
    return aug, fetch


def _unique(name: str, taken: set) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


def _session(proto: onnx.ModelProto, tmpdir: str | None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if tmpdir is None:
        return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    path = Path(tmpdir) / "augmented.onnx"
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="augmented.onnx.data", size_threshold=1024)
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


class Progress:
    """A plain ``\\r`` progress bar on stderr, only on a terminal and without QPASSES_NO_PROGRESS."""

    def __init__(self, label: str, total: int | None, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = (stream is not None or (self.stream.isatty() and not os.environ.get("QPASSES_NO_PROGRESS")))
        self.label, self.total, self.start = label, total, time.perf_counter()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        if self.total:
            filled = int(30 * done / self.total)
            bar = f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total}"
        else:
            bar = f"{done}"
        self.stream.write(f"\r{self.label} {bar} {rate:.1f} samples/s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def collect_stats(model: QModel, data, *, method: str = "minmax", num_bins: int = 2048,
                  averaging_constant: float | None = None, max_samples: int = 0,
                  progress_stream=None) -> tuple[dict[str, TensorStats], int]:
    """Run ``model`` on every sample of ``data`` (validated one by one) and return
    ({tensor name: TensorStats} in graph order, number of samples)."""
    data = open_data(data)
    proto = model.to_proto()
    specs = model_inputs(proto)
    tensors = activation_tensors(proto, _gs_types(model))
    use_hist = method in HISTOGRAM_METHODS
    bins = histogram_bins(num_bins) if use_hist else 0
    stats = {name: TensorStats(bins, averaging_constant) for name, _ in tensors}
    input_names = [s.name for s in specs if s.name in stats]
    inner = [(n, e) for n, e in tensors if n not in input_names]
    aug, fetch = augment(proto, inner, reduce=not use_hist)
    del proto
    large = tensor_bytes(aug) > EXTERNAL_DATA_THRESHOLD
    with tempfile.TemporaryDirectory(prefix="qpasses-calib-") if large else contextlib.nullcontext() as tmpdir:
        sess = _session(aug, tmpdir)
        del aug
        total = data.count if not max_samples else min(max_samples, data.count or max_samples)
        bar = Progress("calibrate", total, progress_stream)
        count = 0
        for index, feed in enumerate(data):
            if max_samples and index >= max_samples:
                break
            feed = validate(feed, specs, index, data.source)
            try:
                outputs = sess.run(fetch, feed)
            except Exception as exc:
                raise CalibrationDataError(f"{data.source}: sample {index}: onnxruntime cannot run the model "
                                           f"on it ({_first_line(exc)})") from None
            for name in input_names:
                if name in feed:
                    stats[name].update(feed[name])
            if use_hist:
                for name, arr in zip(fetch, outputs):
                    stats[name].update(arr)
            else:
                for i in range(0, len(fetch), 2):
                    stats[inner[i // 2][0]].update_range(outputs[i], outputs[i + 1])
            del outputs
            count += 1
            bar.update(count)
        bar.close()
    if count == 0:
        raise CalibrationDataError(f"{data.source}: no samples")
    return stats, count


def calibrate_ranges(model: QModel, data, *, method: str = "minmax", percentile: float = 99.999,
                     num_bins: int = 2048, bits: int = 8, symmetric: bool = False,
                     moving_average: bool = False, averaging_constant: float = 0.01,
                     max_samples: int = 0, progress_stream=None):
    """Collect statistics and finalise them: returns (ranges, observed, samples), both dicts of
    tensor name -> (float, float) in graph order."""
    stats, samples = collect_stats(model, data, method=method, num_bins=num_bins,
                                   averaging_constant=averaging_constant if moving_average else None,
                                   max_samples=max_samples, progress_stream=progress_stream)
    ranges, observed = {}, {}
    for name, st in stats.items():
        lo, hi = finalise(method, st, percentile=percentile, num_bins=num_bins, bits=bits,
                          symmetric=symmetric, moving_average=moving_average)
        ranges[name] = (_finite(lo), _finite(hi))
        observed[name] = tuple(float(v) for v in st.observed)
    return ranges, observed, samples


def _finite(value) -> float:
    value = float(value)
    return value if math.isfinite(value) else 0.0


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
