"""Helpers for tests: tiny models from ONNX text, random feeds, running in onnxruntime, running
passes with a RunContext."""
from __future__ import annotations

import numpy as np
import onnx
import onnx.parser

from .evaluation.evaluate import session
from .ir.model import QModel, from_proto

_NP = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
       onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT64: np.int64,
       onnx.TensorProto.INT32: np.int32, onnx.TensorProto.BOOL: np.bool_,
       onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.INT8: np.int8}


def parse(text: str, *, opset: int = 17, ir_version: int = 10) -> onnx.ModelProto:
    """A ModelProto from the body of an ONNX text graph (the ``<ir_version, opset_import>`` header is added)."""
    if not text.lstrip().startswith("<"):
        text = f'<ir_version: {ir_version}, opset_import: ["" : {opset}]>\n' + text
    return onnx.parser.parse_model(text)


def model_from_text(text: str, **kw) -> QModel:
    return from_proto(parse(text, **kw))


def random_feed(model, seed: int = 0, batch: int = 1) -> dict[str, np.ndarray]:
    """Random inputs for a model (symbolic dimensions become ``batch``)."""
    proto = model.to_proto() if isinstance(model, QModel) else model
    rng = np.random.default_rng(seed)
    inits = {t.name for t in proto.graph.initializer}
    feed = {}
    for vi in proto.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else batch for d in tt.shape.dim]
        dtype = _NP.get(tt.elem_type, np.float32)
        if np.issubdtype(dtype, np.floating):
            feed[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feed[vi.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feed[vi.name] = rng.integers(0, 4, shape).astype(dtype)
    return feed


def run(model, feed: dict, *, judged: bool = False) -> list[np.ndarray]:
    """Run a QModel/ModelProto in onnxruntime CPU; returns every output. ``judged``: in the QDQ
    simulation (no graph optimizations: the same on every CPU) instead of this CPU's int8 kernels."""
    sess = session(model, optimize=not judged)
    names = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}
    return sess.run(None, {k: v for k, v in feed.items() if k in names})


def assert_same_outputs(before, after, feed, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Both models give the same outputs on ``feed`` (max abs diff <= atol + rtol*|ref|)."""
    for ref, got in zip(run(before, feed), run(after, feed), strict=True):
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol)


def run_pass(p, model: QModel, config=None, data=None, *, ctx=None):
    """``p.run(model, ctx)`` with ``ctx`` or a new ``RunContext(config, data)``: one pass on its own
    (no PassManager, so no fact checks). Give a ``ctx`` to read its findings afterwards."""
    from .core.context import RunContext

    return p.run(model, ctx if ctx is not None else RunContext(config, data))


def run_passes(passes, model: QModel, config=None, data=None, *, ctx=None, instruments=()):
    """``PassManager(passes, instruments).run(model, ctx)`` with ``ctx`` or a new
    ``RunContext(config, data)``; returns the records."""
    from .core.context import RunContext
    from .core.pipeline import PassManager

    return PassManager(passes, instruments).run(model, ctx if ctx is not None else RunContext(config, data))


def bn_conv_layer(seed: int = 0, channels: int = 64, size: int = 16) -> onnx.ModelProto:
    """Issue 35's layer: a 3x3 Conv over ``channels`` channels with trained-like weights (Laplace,
    BatchNorm-folded gains per output channel), reading a signed BatchNorm output (``bn_conv_data``),
    so the input's uint8 zero point is mid-range. Without VNNI its int16 pair sums saturate."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = rng.laplace(0, 1, (channels, channels, 3, 3)) * np.sqrt(2 / (channels * 9))
    w *= rng.uniform(0.5, 1.5, (channels, 1, 1, 1))
    b = rng.normal(0, 0.1, channels)
    shape = [1, channels, size, size]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])], "bn_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(w.astype(np.float32), "w"), numpy_helper.from_array(b.astype(np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def bn_conv_data(samples: int, seed: int, channels: int = 64, size: int = 16) -> np.ndarray:
    """[samples, 1, channels, size, size] BatchNorm-like inputs of ``bn_conv_layer``: unit variance,
    neighbouring channels correlated (0.5, as features of one image are) and spatially smooth."""
    rng = np.random.default_rng(seed)
    own = rng.normal(0, 1, (samples, 1, channels, size, size))
    shared = rng.normal(0, 1, (samples, 1, 1, size, size))
    x = np.sqrt(0.5) * own + np.sqrt(0.5) * shared
    x = (x + np.roll(x, 1, -1) + np.roll(x, 1, -2) + np.roll(x, (1, 1), (-1, -2))) / 2
    return x.astype(np.float32)
