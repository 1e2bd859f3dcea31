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

import math
import os
import re
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import CalibrationDataError, ModelError
from ..ir import EXTERNAL_DATA_THRESHOLD, QModel, tensor_bytes
from .collectors import HISTOGRAM_METHODS, TensorStats, finalise, histogram_bins
from .data import model_inputs, open_data

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


# Ops whose output range follows exactly from their input's: min/max mode measures the input only.
_SAME_VALUES = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"})


def derived_ranges(proto: onnx.ModelProto, tracked: set[str]) -> dict[str, tuple[str, str]]:
    """{output: (source, op)} for tracked outputs of Relu and value-preserving shape ops whose data
    input is tracked too: their per-sample min/max follow exactly from the source's (Relu:
    max(., 0)), so they need no reduction nodes of their own. Sources come first (graph order)."""
    out: dict[str, tuple[str, str]] = {}
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx") or not node.input or not node.output:
            continue
        kind = "Relu" if node.op_type == "Relu" else ("same" if node.op_type in _SAME_VALUES else None)
        src, dst = node.input[0], node.output[0]
        if kind and dst in tracked and src in tracked:
            out[dst] = (src, kind)
    return out


def augment(proto: onnx.ModelProto, tensors: list[tuple[str, int]], reduce: bool) -> list[str]:
    """Edit ``proto`` (a private copy) so its outputs expose the tensors (or their ReduceMin and
    ReduceMax when ``reduce``). Returns the names to fetch."""
    del proto.metadata_props[:]
    graph = proto.graph
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
    return fetch


def _unique(name: str, taken: set) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


_SHAREABLE = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT8,
                        TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16, TensorProto.INT32,
                        TensorProto.INT64, TensorProto.UINT32, TensorProto.UINT64, TensorProto.BOOL})


def session_options(proto: onnx.ModelProto, *, in_memory_weights: bool | None = None):
    """onnxruntime SessionOptions for ``proto``. Models past the 2 GB protobuf limit (or with
    ``in_memory_weights=True``) have their large initializers moved out of ``proto`` and handed to
    onnxruntime as in-memory external data (``add_external_initializers``: no temporary files).
    Returns (options, objects that must outlive the session)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if in_memory_weights is None:
        in_memory_weights = tensor_bytes(proto) > EXTERNAL_DATA_THRESHOLD
    return opts, (_move_weights_out(proto, opts) if in_memory_weights else [])


def _move_weights_out(proto: onnx.ModelProto, opts) -> list:
    import onnxruntime as ort

    names, values, keep = [], [], []
    for tensor in proto.graph.initializer:
        if tensor.data_type not in _SHAREABLE or tensor.data_location == TensorProto.EXTERNAL:
            continue
        if len(tensor.raw_data) < 1024 and tensor.ByteSize() < 1024:
            continue
        array = np.ascontiguousarray(numpy_helper.to_array(tensor))
        for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            tensor.ClearField(field)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "qpasses-in-memory"), ("offset", "0"), ("length", str(array.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        names.append(tensor.name)
        values.append(ort.OrtValue.ortvalue_from_numpy(array))
        keep.append(array)
    if names:
        opts.add_external_initializers(names, values)
    return keep + values


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


class _Plan:
    """What one calibration run needs: the session, what to fetch and how to read it."""

    def __init__(self, model: QModel, use_hist: bool, in_memory_weights: bool | None = None,
                 only: set[str] | None = None):
        import onnxruntime as ort

        proto = model.to_proto()
        self.specs = model_inputs(proto)
        self.tensors = activation_tensors(proto, _gs_types(model))
        if only is not None:
            self.tensors = [(n, e) for n, e in self.tensors if n in only]
        tracked = {name for name, _ in self.tensors}
        self.inputs = [s.name for s in self.specs if s.name in tracked]
        self.derived = {} if use_hist else derived_ranges(proto, tracked)
        self.inner = [(n, e) for n, e in self.tensors if n not in self.inputs and n not in self.derived]
        self.fetch = augment(proto, self.inner, reduce=not use_hist)
        opts, self._keep = session_options(proto, in_memory_weights=in_memory_weights)
        data = proto.SerializeToString()
        del proto  # free the exported copy before onnxruntime makes its own
        try:
            self.session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ModelError(f"onnxruntime cannot run the model, so it cannot be calibrated: "
                             f"{_unrunnable(model, exc)}") from None


def _is_bfloat16(dtype) -> bool:
    if isinstance(dtype, int):  # gs keeps the ONNX enum for types numpy lacks
        return dtype == TensorProto.BFLOAT16
    try:
        return dtype is not None and np.dtype(dtype).name == "bfloat16"
    except TypeError:
        return False


def _unrunnable(model: QModel, exc: Exception) -> str:
    """Why onnxruntime refused the model: the first op of a domain it does not know, else its message."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    known = {k.domain for k in ort_state.get_all_opkernel_def()} | {"ai.onnx"}
    known |= {d.domain for d in (model.graph.functions or ())}
    for node in model.graph.nodes:
        if (node.domain or "") not in known:
            return (f"node '{node.name}' is op '{node.op}' of domain '{node.domain}', which onnxruntime "
                    f"does not implement (without --calib the model is left float)")
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", _first_line(exc))
    if any(_is_bfloat16(t.dtype) for t in model.tensors().values()):
        text += " (onnxruntime's CPU provider runs few bfloat16 ops: convert the model to float32 or float16)"
    return text


def collect_stats(model: QModel, data, *, method: str = "minmax", num_bins: int = 2048,
                  averaging_constant: float | None = None, max_samples: int = 0,
                  progress_stream=None, in_memory_weights: bool | None = None,
                  only: set[str] | None = None) -> tuple[dict[str, TensorStats], int]:
    """Run ``model`` on every sample of ``data`` (validated one by one) and return
    ({tensor name: TensorStats} in graph order, number of samples). ``only`` limits the tensors
    measured (fewer model outputs also leave onnxruntime's fusions, e.g. Conv+Relu, intact)."""
    data = open_data(data)
    use_hist = method in HISTOGRAM_METHODS
    plan = _Plan(model, use_hist, in_memory_weights, only)
    bins = histogram_bins(num_bins) if use_hist else 0
    stats = {name: TensorStats(bins, averaging_constant) for name, _ in plan.tensors}
    total = data.count if not max_samples else min(max_samples, data.count or max_samples)
    bar = Progress("calibrate", total, progress_stream)
    count = 0
    for index, feed in enumerate(data.validated(plan.specs, max_samples)):
        try:
            outputs = plan.session.run(plan.fetch, feed)
        except Exception as exc:
            raise CalibrationDataError(f"{data.source}: sample {index}: onnxruntime cannot run the model "
                                       f"on it ({_first_line(exc)})") from None
        if use_hist:
            for name in plan.inputs:
                stats[name].update(feed[name])
            for name, arr in zip(plan.fetch, outputs):
                stats[name].update(arr)
        else:
            _update_ranges(stats, feed, plan, outputs)
        del outputs
        count += 1
        bar.update(count)
    bar.close()
    if count == 0:
        raise CalibrationDataError(f"{data.source}: no samples")
    return stats, count


def _update_ranges(stats, feed, plan: _Plan, outputs) -> None:
    """Min/max mode: one (min, max) per tensor for this sample, measured or derived."""
    current = {name: (feed[name].min(), feed[name].max()) for name in plan.inputs if feed[name].size}
    current.update((name, (outputs[2 * i], outputs[2 * i + 1])) for i, (name, _) in enumerate(plan.inner))
    for name, (src, kind) in plan.derived.items():   # graph order: sources come first
        if src in current:
            lo, hi = current[src]
            current[name] = (max(lo, 0), max(hi, 0)) if kind == "Relu" else (lo, hi)
    for name, st in stats.items():
        if name in current:
            st.update_range(*current[name])
        else:
            st.samples += 1


def calibrate_ranges(model: QModel, data, *, method: str = "minmax", percentile: float = 99.999,
                     num_bins: int = 2048, bits: int = 8, symmetric: bool = False,
                     moving_average: bool = False, averaging_constant: float = 0.01,
                     max_samples: int = 0, progress_stream=None, only: set[str] | None = None):
    """Collect statistics and finalise them: returns (ranges, observed, samples), both dicts of
    tensor name -> (float, float) in graph order."""
    stats, samples = collect_stats(model, data, method=method, num_bins=num_bins,
                                   averaging_constant=averaging_constant if moving_average else None,
                                   max_samples=max_samples, progress_stream=progress_stream, only=only)
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
