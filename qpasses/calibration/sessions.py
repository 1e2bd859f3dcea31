"""onnxruntime session plumbing for runs over a model's parts: options that hand weights over as
arrays, why onnxruntime refused a model, and the error of a failed run."""
from __future__ import annotations

import re

import numpy as np
import onnx
from onnx import TensorProto

from ..errors import first_line
from ..ir.model import IN_MEMORY, QModel


class RunError(Exception):
    """onnxruntime failed on a sample (``index``: which one, when the caller knows it)."""

    index = -1


def ort_session(model, opts=None, *, log: int = 3, optimization: str | None = None,
                optimized_to=None, threads: int | None = None, float_only: bool = False):
    """An onnxruntime CPU session of ``model`` (serialised bytes or a path), with ``opts`` (new
    options by default): logging at severity ``log`` and up, graph optimizations at ``optimization``
    ("none", "extended", "all"; None: onnxruntime's default), the optimized graph saved to
    ``optimized_to``, and ``threads`` threads (intra- and inter-op); ``float_only``: no Q/DQ fusion
    into integer kernels, whatever the level (session.disable_quant_qdq). Its threads wait without
    spinning: qpasses runs a model many times with Python work between the runs (statistics,
    scores, the next trial), which spinning threads take the cores from (yolo_detector's default
    pipeline: 52 -> 34 s, 39 -> 23 s of CPU, on two busy cores; the same outputs)."""
    import onnxruntime as ort

    opts = ort.SessionOptions() if opts is None else opts
    opts.log_severity_level = log
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if optimization is not None:
        opts.graph_optimization_level = {"none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                                         "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                                         "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[optimization]
    if float_only:
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    if optimized_to is not None:
        opts.optimized_model_filepath = str(optimized_to)
    if threads is not None:
        opts.intra_op_num_threads = opts.inter_op_num_threads = threads
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def session_options(proto: onnx.ModelProto, weights: dict | None = None, *, prepacking: bool = False):
    """onnxruntime SessionOptions for ``proto``; initializers of ``proto`` stubbed out as external
    data at location IN_MEMORY (``QModel.to_proto(weights=...)``) are handed to onnxruntime from
    ``weights`` (``add_external_initializers``: no serialised copy; onnxruntime still makes its
    own). Returns (options, objects that must outlive the session). With weights handed over,
    prepacking is off unless ``prepacking`` (a third copy of each weight; off, the MLAS kernels may
    round a few outputs differently from a default session)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    names = [t.name for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL
             and any(e.key == "location" and e.value == IN_MEMORY for e in t.external_data)]
    if not names or weights is None:
        return opts, []
    values = [ort.OrtValue.ortvalue_from_numpy(weights[n]) for n in names]
    opts.add_external_initializers(names, values)
    if not prepacking:
        # big weights: no packed copies as well (a third copy of each; halves calibration time on
        # the 2.4 GB MatMul stack of tools/bench_big_model.py)
        opts.add_session_config_entry("session.disable_prepacking", "1")
    return opts, values


def _is_bfloat16(dtype) -> bool:
    if isinstance(dtype, int):  # gs keeps the ONNX enum for types numpy lacks
        return dtype == TensorProto.BFLOAT16
    try:
        return dtype is not None and np.dtype(dtype).name == "bfloat16"
    except TypeError:
        return False


def unrunnable(model: QModel, exc: Exception) -> str:
    """Why onnxruntime refused the model: the first op of a domain it does not know, else its message."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    known = {k.domain for k in ort_state.get_all_opkernel_def()} | {"ai.onnx"}
    known |= {d.domain for d in (model.graph.functions or ())}
    for node in model.graph.nodes:
        if (node.domain or "") not in known:
            return (f"node '{node.name}' is op '{node.op}' of domain '{node.domain}', which onnxruntime "
                    f"does not implement (without --calib the model is left float)")
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", first_line(exc))
    if any(_is_bfloat16(t.dtype) for t in model.tensors().values()):
        text += " (onnxruntime's CPU provider runs few bfloat16 ops: convert the model to float32 or float16)"
    return text
