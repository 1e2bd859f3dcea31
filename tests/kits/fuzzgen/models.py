"""``models()``: a random valid float model (a :class:`DrawnModel`), and ``feeds_for`` its feeds."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper

from .builder import Builder
from .ops import op_step

OPSETS = (13, 17, 19, 21, 11, 12)   # 11/12: axes and splits are attributes


@st.composite
def models(draw, min_ops: int = 1, max_ops: int = 16):
    """A random valid float model (a :class:`DrawnModel`)."""
    opset = draw(st.sampled_from(OPSETS))
    batch = draw(st.sampled_from((1, 1, 2)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b = Builder(draw, rng, opset, batch, symbolic=draw(st.integers(0, 9)) == 9)
    b.naming = draw(st.sampled_from(("plain", "plain", "plain", "scoped", "unnamed")))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("nchw", "nchw", "nk", "nsk")))
        c, h, w = (draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(1, 6)))
        shape = {"nchw": (batch, c, h, w), "nk": (batch, c * h), "nsk": (batch, h, c * w)}[kind]
        b.input(shape, batched=True)
    for _ in range(draw(st.integers(min_ops, max_ops))):
        draw(op_step(b))
    outputs = [t for t in b.pool if not b.reads.get(t) and t not in b.data]
    extra = [t for t in b.pool if b.reads.get(t) and t not in b.data]
    if extra and (not outputs or draw(st.integers(0, 3)) == 3):
        outputs.append(extra[draw(st.integers(0, len(extra) - 1))])
    if draw(st.integers(0, 19)) == 19 or not outputs:   # a graph input that is also a graph output
        outputs.append(next(t for t in b.pool if t in b.data))
    declare = draw(st.booleans()) and not b.symbolic
    out_info = [helper.make_tensor_value_info(t, TensorProto.FLOAT, list(b.shapes[t]) if declare
                                              else [None] * len(b.shapes[t])) for t in outputs]
    weights = [t for t in b.inits if t.data_type == TensorProto.FLOAT]
    if weights and draw(st.integers(0, 9)) == 9:      # an initializer also listed as a graph input
        w = weights[draw(st.integers(0, len(weights) - 1))]
        b.inputs.append(helper.make_tensor_value_info(w.name, TensorProto.FLOAT, list(w.dims)))
    graph = helper.make_graph(b.nodes, "fuzz", b.inputs, out_info, b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    acts = [t for t in b.pool if t not in b.data and t not in b.unstable]
    return DrawnModel(model, b.data, b.ops, acts, b.computed_nodes, b.weights, b.scaled_params)


@dataclass
class DrawnModel:
    """What ``models()`` draws: the model and what configs and feeds need to know about it."""

    model: onnx.ModelProto
    inputs: dict            # graph input -> (kind, shape, int high)
    ops: list[str]          # labels of the drawn ops
    activations: list[str]  # computed float tensors that survive folding
    nodes: list[str]        # names of nodes that survive folding
    weights: list[str]
    scaled_params: bool     # some weights/biases drawn far from unit scale


def feeds_for(specs: dict, seed: int, count: int = 4, scales: dict | None = None) -> list[dict]:
    """``count`` random feeds for the graph inputs described by ``models()``.

    Float inputs are normal * scale + offset, ``scales`` giving ``{input: (scale, offset)}``
    (default (1, 0)); scale 0 makes a constant input (degenerate ranges downstream).
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        feed = {}
        for name, (kind, shape, high) in specs.items():
            if kind == "float":
                scale, offset = (scales or {}).get(name, (1.0, 0.0))
                feed[name] = np.asarray(rng.standard_normal(shape) * scale + offset, np.float32)
            elif kind == "bool":
                feed[name] = np.asarray(rng.random(shape) < 0.5)   # 0-d draws are numpy scalars
            else:
                feed[name] = np.asarray(rng.integers(0, high, shape), np.int64)
        out.append(feed)
    return out
