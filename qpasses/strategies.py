"""Hypothesis strategies for fuzzing: random valid float models, quantization configs and data.

``cases()`` draws a :class:`FuzzCase`: a random DAG over the ops qpasses quantizes (and a few it
does not: Abs, Neg, Shape arithmetic), opset 11-21, random static (sometimes symbolic-batch)
shapes, tensors and graph inputs read by several nodes, several graph outputs (some also read
inside the graph, sometimes a graph input), constants given as initializers, shared or twinned
(same values, another name), or built by constant subgraphs (Constant, ConstantOfShape,
Reshape/Transpose/Add of constants: fold-constants has work), Conv/ConvTranspose/Gemm followed by
BatchNormalization (fold-batchnorm), scoped ('net/x:0') or missing node names; plus a random
QuantConfig (types, symmetry, per-channel, calibration method, mixed precision requests, tensor
overrides, node/op selections, ...) and 4 calibration feeds (N(0, 1), sometimes scaled, offset
or constant). ``run_case`` quantizes a case with the default pipeline and classifies the outcome.

Every drawn model passes onnx.checker and runs in onnxruntime (``run_case`` checks it again).
Numerics are kept well-conditioned on purpose: divisors are constants away from zero or
``Sigmoid(t) + 1``, the Where condition is a bool graph input, Softmax never runs over a size-1
axis (onnxruntime's QLinearSoftmax turns that 1.0 into 0).

Hypothesis is a test extra: only this module (and the tests/tools using it) imports it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

OPSETS = (13, 17, 19, 21, 11, 12)   # 11/12: axes and splits are attributes
MAX_ELEMENTS = 512          # no activation grows beyond this many elements
ACTIVATION_TYPES = ("uint8", "int8", "uint16", "int16", "uint4", "int4")
WEIGHT_TYPES = ("int8", "uint8", "int16", "uint16", "int4", "uint4")
CALIBRATION = ("minmax", "percentile", "entropy", "mse", "pow2")
QUANTIZED_OPS = ("Conv", "Gemm", "MatMul", "Add", "Mul", "Concat", "Relu", "Clip", "Sigmoid", "Softmax",
                 "MaxPool", "AveragePool", "Reshape", "Transpose", "LayerNormalization", "Where", "Resize",
                 "Gather", "Split")


@dataclass
class FuzzCase:
    """One fuzz example: the float model, its calibration feeds and the quantization config."""

    model: onnx.ModelProto
    feeds: list[dict]
    config: dict
    ops: list[str] = field(default_factory=list)
    traits: list[str] = field(default_factory=list)  # "scaled-feeds" (not N(0, 1)), "scaled-params"

    def __repr__(self) -> str:
        text = onnx.printer.to_text(self.model)
        return f"FuzzCase(config={self.config!r}, ops={self.ops!r}, model=\n{text}\n)"

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis prints falsifying examples with this
        printer.text(repr(self))


class _Builder:
    """Grows a graph one op at a time, tracking the static shape of every float tensor."""

    def __init__(self, draw, rng: np.random.Generator, opset: int, batch: int, symbolic: bool = False):
        self.draw, self.rng, self.opset, self.batch, self.symbolic = draw, rng, opset, batch, symbolic
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.data: dict[str, tuple] = {}          # graph input -> (kind, shape[, high])
        self.shapes: dict[str, tuple] = {}        # float tensors computed from inputs -> shape
        self.pool: list[str] = []                 # float tensors available to the next op
        self.reads: dict[str, int] = {}
        self.ops: list[str] = []
        self.consts: dict[tuple, list[str]] = {}  # shape -> initializers made by const()
        self.values: dict[str, np.ndarray] = {}
        self.computed_nodes: list[str] = []
        self.weights: list[str] = []
        self.param_scale = (1.0, 1.0)             # (weight, bias) factors of the current op
        self.scaled_params = False
        self.naming = "plain"                     # or "scoped" ('net/x1:0'), "unnamed" nodes
        self.unstable: set[str] = set()
        self.padded: set[str] = set()             # Pad outputs (no pool may read them)           # tensors a fold may remove (mixed precision skips them)
        self.n = 0

    # -- naming and plumbing ---------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"net/{prefix}{self.n}:0" if self.naming == "scoped" else f"{prefix}{self.n}"

    def add(self, op: str, inputs: list[str], outputs: list[str] | int = 1, **attrs) -> list[str]:
        if isinstance(outputs, int):
            outputs = [self.fresh(op.lower()[:4] + "_") for _ in range(outputs)]
        name = "" if self.naming == "unnamed" else self.fresh(op + "_")
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, **attrs))
        for i in inputs:
            if i:
                self.reads[i] = self.reads.get(i, 0) + 1
        return outputs

    def add_axes(self, op: str, x: str, what: str, values: list[int], outputs=1, **attrs):
        """``op`` with an int list that is an input from opset 13 and an attribute before."""
        if self.opset >= 13:
            out = self.add(op, [x, self.init(np.array(values, np.int64), what)], outputs, **attrs)
        else:
            out = self.add(op, [x], outputs, **attrs, **{what: values})
        return out if outputs != 1 else out[0]

    def act(self, name: str, shape) -> str:
        """Register a computed float tensor."""
        last = self.nodes[-1] if self.nodes else None
        if last is not None and name in last.output and last.name and last.op_type != "BatchNormalization":
            self.computed_nodes.append(last.name)   # survives folding: nodes_to_exclude may name it
        self.shapes[name] = tuple(int(d) for d in shape)
        self.pool.append(name)
        return name

    def input(self, shape, kind: str = "float", high: int = 0, batched: bool = False) -> str:
        """A graph input; ``batched``: dimension 0 is the batch (symbolic 'N' in symbolic models)."""
        name = self.fresh({"float": "x", "bool": "cond", "int64": "ids"}[kind])
        elem = {"float": TensorProto.FLOAT, "bool": TensorProto.BOOL, "int64": TensorProto.INT64}[kind]
        dims = list(shape)
        if batched and self.symbolic:
            dims[0] = "N"
        self.inputs.append(helper.make_tensor_value_info(name, elem, dims))
        self.data[name] = (kind, tuple(shape), high)
        if kind == "float":
            self.act(name, shape)
        return name

    # -- drawing helpers -------------------------------------------------------------------
    def choice(self, seq):
        return self.draw(st.sampled_from(list(seq)))

    def flag(self, p_true: float = 0.5) -> bool:
        """True with probability ``p_true``; shrinks to False."""
        return self.draw(st.integers(0, 99)) >= 100 - int(p_true * 100)

    def pick(self, ok=lambda s: True) -> str | None:
        """A tensor from the pool satisfying ``ok(shape)``; newest first, so shrinking makes chains."""
        cands = [t for t in reversed(self.pool) if ok(self.shapes[t])]
        if not cands:
            return None
        return cands[self.draw(st.integers(0, len(cands) - 1))]

    def rank4(self) -> str:
        """A rank-4 tensor (one made by Reshape if the pool has none)."""
        x = self.pick(lambda s: len(s) == 4)
        if x is None:
            x = self.pick()
            s = self.shapes[x]
            x = self.reshape_to(x, (s[0], int(np.prod(s[1:-1] or (1,))), s[-1] if len(s) > 1 else 1, 1))
        return x

    def rank2(self) -> str:
        x = self.pick(lambda s: len(s) == 2)
        if x is None:
            x = self.pick()
            s = self.shapes[x]
            out = self.add("Flatten", [x], axis=1)[0]
            x = self.act(out, (s[0], int(np.prod(s[1:]))))
        return x

    def reshape_to(self, x: str, shape) -> str:
        out = self.add("Reshape", [x, self.init(np.array(shape, np.int64), "shape")])[0]
        return self.act(out, shape)

    # -- constants -------------------------------------------------------------------------
    def init(self, value: np.ndarray, prefix: str = "c") -> str:
        name = self.fresh(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def const(self, value: np.ndarray, prefix: str = "c", reuse: bool = True) -> str:
        """A constant tensor: an initializer, or a small constant subgraph computing it.

        With ``reuse`` an earlier initializer of the same shape may be returned instead (one
        constant read by several nodes: a weight that is also an operand, ...); pass False when
        the value matters (variances, divisors).
        """
        value = np.asarray(value, np.float32)
        same = self.consts.setdefault(value.shape, []) if reuse else []
        if same and self.flag(0.2):
            name = self.choice(same)
            if self.flag(0.5):
                return name                     # the same constant read twice
            value = self.values[name]           # a twin: same values, another name (cleanup merges)
        route = self.choice(("init", "init", "init", "constant", "of_shape", "reshape", "transpose", "add"))
        if route == "constant":
            return self.add("Constant", [], value=numpy_helper.from_array(value, self.fresh("v")))[0]
        if route == "of_shape" and value.size and np.all(value == value.flat[0]):
            return self.add("ConstantOfShape", [self.init(np.array(value.shape, np.int64), "shape")],
                            value=numpy_helper.from_array(value.reshape(1)[:1], self.fresh("v")))[0]
        if route == "reshape" and value.ndim:
            return self.add("Reshape", [self.init(value.reshape(-1), prefix),
                                        self.init(np.array(value.shape, np.int64), "shape")])[0]
        if route == "transpose" and value.ndim >= 2:
            perm = list(range(value.ndim))[::-1]
            return self.add("Transpose", [self.init(np.transpose(value, perm), prefix)], perm=perm)[0]
        if route == "add":
            half = np.float32(0.5) * value
            rest = self.const(value - half, prefix, reuse=False)
            return self.add("Add", [self.init(half, prefix), rest])[0]
        name = self.init(value, prefix)
        same.append(name)
        self.values[name] = value
        return name

    def weight(self, value: np.ndarray) -> str:
        """A Conv/ConvTranspose/Gemm/MatMul weight, scaled by this op's ``param_scale[0]``."""
        name = self.const(value * np.float32(self.param_scale[0]), "w")
        self.weights.append(name)
        self.scaled_params |= self.param_scale[0] != 1.0
        return name

    def bias(self, value: np.ndarray) -> str:
        """A Conv/ConvTranspose/Gemm bias, scaled by this op's ``param_scale[1]`` (int32 overflow)."""
        self.scaled_params |= self.param_scale[1] != 1.0
        return self.const(value * np.float32(self.param_scale[1]), "bias")

    def normal(self, *shape, std: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)


# -- ops -------------------------------------------------------------------------------------
def _conv(b: _Builder, transpose: bool = False) -> None:
    x = b.rank4()
    n, c, h, w = b.shapes[x]
    groups = b.choice([g for g in (1, 2, 3, 4, c) if c % g == 0])
    cout = groups * b.draw(st.integers(1, max(1, 6 // groups)))
    k = [b.draw(st.integers(1, 3)) for _ in range(2)]
    stride = [b.draw(st.integers(1, 2)) for _ in range(2)]
    dil = [b.draw(st.integers(1, 2)) if k[i] > 1 else 1 for i in range(2)]
    pads = [b.draw(st.integers(0, max(0, min(1, k[i % 2] - 1 if transpose else 1)))) for i in range(4)]
    dims = (h, w)
    if transpose:
        out = [(dims[i] - 1) * stride[i] + dil[i] * (k[i] - 1) + 1 - pads[i] - pads[i + 2] for i in range(2)]
        weight = b.normal(c, cout // groups, *k, std=1 / math.sqrt(c // groups * k[0] * k[1] / stride[0]))
    else:
        out = [(dims[i] + pads[i] + pads[i + 2] - dil[i] * (k[i] - 1) - 1) // stride[i] + 1 for i in range(2)]
        weight = b.normal(cout, c // groups, *k, std=1 / math.sqrt(c // groups * k[0] * k[1]))
    if min(out) < 1 or n * cout * out[0] * out[1] > MAX_ELEMENTS:
        return _unary(b)
    inputs = [x, b.weight(weight)]
    if b.flag(0.6):
        inputs.append(b.bias(b.normal(cout, std=0.3)))
    op = "ConvTranspose" if transpose else "Conv"
    y = b.add(op, inputs, kernel_shape=k, strides=stride, dilations=dil, pads=pads, group=groups)[0]
    b.ops.append(op + ("+bias" if len(inputs) == 3 else "") + (f"/g{groups}" if groups > 1 else ""))
    b.act(y, (n, cout, *out))
    if b.flag(0.25):
        _batchnorm(b, y)


def _batchnorm(b: _Builder, x: str | None = None) -> None:
    """BatchNormalization, right after a Conv/ConvTranspose/Gemm (foldable) or on any tensor."""
    x = x or b.pick(lambda s: len(s) >= 2)
    if x is None:
        return _unary(b)
    c = b.shapes[x][1]
    scale, bias = b.normal(c, std=0.5) + 1, b.normal(c, std=0.2)
    mean, var = b.normal(c, std=0.3), (b.rng.random(c) + 0.5).astype(np.float32)
    params = [b.const(v, p, reuse=p != "bn_v")
              for v, p in ((scale, "bn_s"), (bias, "bn_b"), (mean, "bn_m"), (var, "bn_v"))]
    y = b.add("BatchNormalization", [x, *params], epsilon=1e-5)[0]
    b.unstable.add(x)
    b.ops.append("BatchNormalization")
    b.act(y, b.shapes[x])


def _gemm(b: _Builder) -> None:
    x = b.rank2()
    m, k = b.shapes[x]
    trans_a = b.flag(0.15)
    if trans_a:
        m, k = k, m
    trans_b = b.flag()
    if b.flag(0.15) and m * m <= MAX_ELEMENTS:           # activation x activation: A * A^T
        y = b.add("Gemm", [x, x], transA=int(trans_a), transB=int(not trans_a))[0]
        b.ops.append("Gemm(act,act)")
        b.act(y, (m, m))
        return
    nout = b.draw(st.integers(1, 8))
    weight = b.normal(k, nout, std=1 / math.sqrt(k))
    inputs = [x, b.weight(weight.T.copy() if trans_b else weight)]
    bias = b.choice(("none", "n", "1n", "scalar"))
    if bias != "none":
        shape = {"n": (nout,), "1n": (1, nout), "scalar": (1,)}[bias]
        inputs.append(b.bias(b.normal(*shape, std=0.3)))
    alpha, beta = b.choice((1.0, 1.0, 0.5, 2.0)), b.choice((1.0, 1.0, 0.5))
    y = b.add("Gemm", inputs, transA=int(trans_a), transB=int(trans_b), alpha=alpha, beta=beta)[0]
    b.ops.append(f"Gemm(bias={bias})")
    b.act(y, (m, nout))
    if b.flag(0.15):
        _batchnorm(b, y)


def _matmul(b: _Builder) -> None:
    x = b.pick(lambda s: len(s) >= 2) or b.rank2()
    s = b.shapes[x]
    kind = b.choice(("weight", "weight", "act", "left"))
    n = b.draw(st.integers(1, 8))
    shape = {"act": (*s[:-1], s[-2]), "left": (*s[:-2], n, s[-1]), "weight": (*s[:-1], n)}[kind]
    if np.prod(shape) > MAX_ELEMENTS:
        return _unary(b)
    if kind == "act":                                   # x @ y^T for some y of x's shape
        perm = list(range(len(s)))
        perm[-2:] = perm[-1], perm[-2]
        yt = b.add("Transpose", [b.pick(lambda t: t == s)], perm=perm)[0]
        inputs = [x, b.act(yt, tuple(s[p] for p in perm))]
    elif kind == "left":                                # constant @ x
        inputs = [b.weight(b.normal(n, s[-2], std=1 / math.sqrt(s[-2]))), x]
    else:
        inputs = [x, b.weight(b.normal(s[-1], n, std=1 / math.sqrt(s[-1])))]
    out = b.add("MatMul", inputs)[0]
    b.ops.append(f"MatMul({kind})")
    b.act(out, shape)


def _broadcast_shapes(s: tuple) -> list[tuple]:
    """Constant shapes that broadcast onto ``s`` without growing it."""
    out = [(), (1,), s, (s[-1],) if s else ()]
    if len(s) >= 3:
        out.append((s[1],) + (1,) * (len(s) - 2))
        out.append((1,) * (len(s) - 1) + (s[-1],))
    return out


def _safe_divisor(b: _Builder, s: tuple) -> str:
    """A divisor away from zero: a constant with |c| in [0.5, 2], or Sigmoid(t) + 1."""
    if b.flag(0.6):
        shape = b.choice(_broadcast_shapes(s))
        mag = (b.rng.random(shape) * 1.5 + 0.5).astype(np.float32)
        return b.const(np.where(b.rng.random(shape) < 0.3, -mag, mag).astype(np.float32), "d", reuse=False)
    t = b.pick(lambda u: u == s)
    sig = b.act(b.add("Sigmoid", [t])[0], b.shapes[t])
    return b.act(b.add("Add", [sig, b.const(np.ones((1,), np.float32), "one", reuse=False)])[0], b.shapes[t])


def _binary(b: _Builder, op: str) -> None:
    x = b.pick()
    s = b.shapes[x]
    if op == "Div":
        other = _safe_divisor(b, s)
        kind = "safe"
    else:
        kind = b.choice(("const", "tensor", "same", "const"))
        if kind == "same":
            other = x
        elif kind == "tensor":
            other = b.pick(lambda t: t != s and _fits(t, s)) or b.pick(lambda t: t == s)
        else:
            value = b.normal(*b.choice(_broadcast_shapes(s)))
            if op == "Mul":
                value = value * np.float32(0.5) + np.float32(b.choice((0.0, 1.0)))
            other = b.const(value, "k")
    inputs = [x, other]
    if kind != "safe" and b.flag(0.3):
        inputs.reverse()
    y = b.add(op, inputs)[0]
    b.ops.append(f"{op}({kind})")
    b.act(y, s)


def _fits(t: tuple, s: tuple) -> bool:
    try:
        return np.broadcast_shapes(t, s) == s
    except ValueError:
        return False


def _concat(b: _Builder) -> None:
    x = b.pick()
    s = b.shapes[x]
    axis = b.draw(st.integers(-len(s), len(s) - 1))
    a = axis % len(s)
    parts: list = [x]                                   # tensor names, or shapes of constants to make
    for _ in range(b.draw(st.integers(1, 2))):
        if b.flag(0.2):
            parts.append(tuple(b.draw(st.integers(1, 2)) if i == a else d for i, d in enumerate(s)))
        else:
            parts.append(b.pick(lambda t: len(t) == len(s) and all(t[i] == s[i] for i in range(len(s))
                                                                   if i != a)))
    total = sum((p if isinstance(p, tuple) else b.shapes[p])[a] for p in parts)
    shape = tuple(total if i == a else d for i, d in enumerate(s))
    if np.prod(shape) > MAX_ELEMENTS:
        return _unary(b)
    inputs = [b.const(b.normal(*p), "cat") if isinstance(p, tuple) else p for p in parts]
    order = b.draw(st.permutations(range(len(inputs))))
    y = b.add("Concat", [inputs[i] for i in order], axis=axis)[0]
    b.ops.append("Concat")
    b.act(y, shape)


def _pool(b: _Builder, op: str) -> None:
    x = b.rank4()
    n, c, h, w = b.shapes[x]
    if x in b.padded and op != "GlobalAveragePool":
        return _unary(b)   # onnxruntime's PadFusion folds the Pad into the pool's pads, past the kernel
    if op == "GlobalAveragePool":
        y = b.add(op, [x])[0]
        b.ops.append(op)
        b.act(y, (n, c, 1, 1))
        return
    k = [b.draw(st.integers(1, min(3, d))) for d in (h, w)]
    stride = [b.draw(st.integers(1, 2)) for _ in range(2)]
    pads = [b.draw(st.integers(0, k[i % 2] - 1)) for i in range(4)]
    out = [(d + pads[i] + pads[i + 2] - k[i]) // stride[i] + 1 for i, d in enumerate((h, w))]
    attrs = {"kernel_shape": k, "strides": stride, "pads": pads}
    if op == "AveragePool":
        attrs["count_include_pad"] = int(b.flag())
    y = b.add(op, [x], **attrs)[0]
    b.ops.append(op)
    b.act(y, (n, c, *out))


_UNARY = {
    "Relu": {}, "Sigmoid": {}, "Tanh": {}, "Abs": {}, "Neg": {},
    "LeakyRelu": {"alpha": (0.01, 0.1, 0.5)}, "HardSigmoid": {"alpha": (0.2, 0.5), "beta": (0.5, 0.3)},
    "HardSwish": {}, "Softmax": {}, "Clip": {},
}


def _unary(b: _Builder, op: str | None = None) -> None:
    op = op or b.choice(("Relu", "Sigmoid", "Tanh", "LeakyRelu", "Abs"))
    if op == "HardSwish" and b.opset < 14:
        op = "HardSigmoid"
    x = b.pick()
    s = b.shapes[x]
    attrs = {k: b.choice(v) for k, v in _UNARY[op].items()}
    inputs = [x]
    if op == "Softmax":   # not over a size-1 axis: onnxruntime's QLinearSoftmax turns that 1.0 into 0
        attrs["axis"] = b.choice([a for a in range(-len(s), len(s)) if s[a] > 1] or [-1])
    if op == "Clip":
        lo, hi = b.choice(((0.0, 6.0), (-1.0, 1.0), (None, 0.5), (0.0, None), (0.25, 2.0), (-2.0, -0.5)))
        inputs += [b.init(np.array(lo, np.float32), "lo") if lo is not None else "",
                   b.init(np.array(hi, np.float32), "hi") if hi is not None else ""]
        while inputs[-1] == "":
            inputs.pop()
        op_text = f"Clip({lo},{hi})"
    y = b.add(op, inputs, **attrs)[0]
    b.ops.append(op_text if op == "Clip" else op)
    b.act(y, s)


def _layernorm(b: _Builder) -> None:
    if b.opset < 17:
        return _unary(b, "Softmax")
    x = b.pick()
    s = b.shapes[x]
    axis = b.draw(st.integers(-len(s), len(s) - 1))
    inner = s[axis % len(s):]
    inputs = [x, b.const(b.normal(*inner, std=0.3) + 1, "ln_s")]
    if b.flag(0.7):
        inputs.append(b.const(b.normal(*inner, std=0.3), "ln_b"))
    y = b.add("LayerNormalization", inputs, axis=axis, epsilon=1e-3)[0]
    b.ops.append("LayerNormalization")
    b.act(y, s)


def _instancenorm(b: _Builder) -> None:
    x = b.pick(lambda s: len(s) >= 3) or b.rank4()
    s = b.shapes[x]
    y = b.add("InstanceNormalization", [x, b.const(b.normal(s[1], std=0.3) + 1, "in_s"),
                                        b.const(b.normal(s[1], std=0.3), "in_b")], epsilon=1e-3)[0]
    b.ops.append("InstanceNormalization")
    b.act(y, s)


def _where(b: _Builder) -> None:
    x = b.pick()
    s = b.shapes[x]
    cond_shape = b.choice((s, (1,) * (len(s) - 1) + s[-1:], s[1:]))
    cond = b.input(cond_shape, "bool")
    other = b.choice(("tensor", "const"))
    if other == "tensor":
        y = b.pick(lambda t: t == s)
    else:
        y = b.const(b.normal(*b.choice(_broadcast_shapes(s))), "k")
    inputs = [cond, x, y] if b.flag() else [cond, y, x]
    out = b.add("Where", inputs)[0]
    b.ops.append(f"Where({other})")
    b.act(out, s)


def _resize(b: _Builder) -> None:
    x = b.rank4()
    n, c, h, w = b.shapes[x]
    mode = b.choice(("nearest", "linear"))
    factors = [b.choice((1.0, 2.0, 0.5) if d >= 2 else (1.0, 2.0)) for d in (h, w)]
    out = [int(math.floor(d * f)) for d, f in zip((h, w), factors)]
    if n * c * out[0] * out[1] > MAX_ELEMENTS:
        factors, out = [1.0, 1.0], [h, w]
    empty = "" if b.opset >= 13 else b.init(np.zeros(0, np.float32), "empty")  # roi/scales required before 13
    if b.flag():
        inputs = [x, empty, b.init(np.array([1, 1, *factors], np.float32), "scales")]
    else:
        inputs = [x, empty, empty, b.init(np.array([n, c, *out], np.int64), "sizes")]
    y = b.add("Resize", inputs, mode=mode)[0]
    b.ops.append(f"Resize({mode})")
    b.act(y, (n, c, *out))


def _reshape(b: _Builder) -> None:
    x = b.pick()
    s = b.shapes[x]
    rest = int(np.prod(s[1:]))
    divisors = [d for d in range(1, rest + 1) if rest % d == 0]
    kind = b.choice(("flat", "split", "shape_of", "zero"))
    if kind == "flat":
        target, shape = [s[0], -1], (s[0], rest)
    elif kind == "zero":
        d = b.choice(divisors)
        target, shape = [0, d, -1], (s[0], d, rest // d)
    elif kind == "split":
        d = b.choice(divisors)
        target = shape = (s[0], rest // d, d, 1)
    else:                                           # target computed from Shape(x): a shape subgraph
        shp = b.add("Shape", [x])[0]
        head = b.add("Slice", [shp, b.init(np.array([0], np.int64)), b.init(np.array([1], np.int64))])[0]
        tgt = b.add("Concat", [head, b.init(np.array([-1], np.int64))], axis=0)[0]
        y = b.add("Reshape", [x, tgt])[0]
        b.ops.append("Reshape(Shape)")
        b.act(y, (s[0], rest))
        return
    y = b.add("Reshape", [x, b.init(np.array(target, np.int64), "shape")])[0]
    b.ops.append(f"Reshape({kind})")
    b.act(y, shape)


def _transpose(b: _Builder) -> None:
    x = b.pick()
    s = b.shapes[x]
    perm = b.draw(st.permutations(range(len(s))))
    y = b.add("Transpose", [x], perm=list(perm))[0]
    b.ops.append("Transpose")
    b.act(y, tuple(s[p] for p in perm))


def _flatten(b: _Builder) -> None:
    x = b.pick()
    s = b.shapes[x]
    axis = b.draw(st.integers(0, len(s)))
    y = b.add("Flatten", [x], axis=axis)[0]
    b.ops.append("Flatten")
    b.act(y, (int(np.prod(s[:axis])), int(np.prod(s[axis:]))))


def _squeeze(b: _Builder) -> None:
    x = b.pick(lambda s: 1 in s[1:] and len(s) > 1)
    if x is None or b.flag(0.4):
        x = b.pick(lambda s: len(s) < 5)
        if x is None:
            return _unary(b)
        s = b.shapes[x]
        axis = b.draw(st.integers(-len(s) - 1, len(s)))
        y = b.add_axes("Unsqueeze", x, "axes", [axis])
        shape = list(s)
        shape.insert(axis % (len(s) + 1), 1)
        b.ops.append("Unsqueeze")
        b.act(y, tuple(shape))
        return
    s = b.shapes[x]
    axes = [i for i in range(1, len(s)) if s[i] == 1]
    axes = axes[: b.draw(st.integers(1, len(axes)))]
    y = b.add_axes("Squeeze", x, "axes", axes)
    b.ops.append("Squeeze")
    b.act(y, tuple(d for i, d in enumerate(s) if i not in axes))


def _slice(b: _Builder) -> None:
    x = b.pick(lambda s: max(s[1:] or (1,)) >= 2) or b.pick()
    s = b.shapes[x]
    axis = b.draw(st.integers(1, len(s) - 1)) if len(s) > 1 else 0
    d = s[axis]
    step = b.choice((1, 1, 2, -1))
    start = b.draw(st.integers(0, d - 1))
    if step > 0:
        end = b.choice((d, 2**62, start + 1, -1 if start < d - 1 else d))
    else:
        end = b.choice((-(2**62), -1 - d, start - 1 if start > 0 else -(2**62)))
    n = len(range(*slice(start, end, step).indices(d)))
    if n == 0:
        start, end, step, n = 0, d, 1, d
    inputs = [x, *(b.init(np.array([v], np.int64)) for v in (start, end, axis - len(s) * b.flag(0.3), step))]
    y = b.add("Slice", inputs)[0]
    b.ops.append("Slice")
    b.act(y, tuple(n if i == axis else v for i, v in enumerate(s)))


def _gather(b: _Builder) -> None:
    if b.flag(0.3):                                   # table lookup: constant (V, D), int64 ids input
        vocab, dim, length = b.draw(st.integers(2, 10)), b.draw(st.integers(1, 8)), b.draw(st.integers(1, 4))
        ids = b.input((b.batch, length), "int64", vocab, batched=True)
        y = b.add("Gather", [b.const(b.normal(vocab, dim), "table"), ids], axis=0)[0]
        b.ops.append("Gather(table)")
        b.act(y, (b.batch, length, dim))
        return
    x = b.pick()
    s = b.shapes[x]
    axis = b.draw(st.integers(0, len(s) - 1))
    d = s[axis]
    if len(s) >= 2 and b.flag(0.3):                # a scalar index drops the axis (never to rank 0)
        idx, shape = np.array(b.draw(st.integers(-d, d - 1)), np.int64), ()
    else:
        idx = np.array([b.draw(st.integers(-d, d - 1)) for _ in range(b.draw(st.integers(1, 3)))], np.int64)
        shape = idx.shape
    y = b.add("Gather", [x, b.init(idx, "idx")], axis=axis - len(s) * b.flag(0.3))[0]
    b.ops.append("Gather")
    b.act(y, (*s[:axis], *shape, *s[axis + 1:]))


def _split(b: _Builder) -> None:
    x = b.pick(lambda s: max(s) >= 2) or b.pick()
    s = b.shapes[x]
    axis = b.choice([i for i, d in enumerate(s) if d >= 2] or [0])
    d = s[axis]
    if d < 2:
        return _unary(b)
    first = b.draw(st.integers(1, d - 1))
    sizes = [first, d - first]
    if sizes[1] >= 2 and b.flag(0.3):
        sizes = [first, 1, d - first - 1]
    mode = b.choice(("input", "num_outputs") if b.opset >= 18 else ("input", "equal"))
    if mode == "equal" and d % 2 == 0:
        sizes = [d // 2, d // 2]
        outs = b.add("Split", [x], 2, axis=axis)
    elif mode == "num_outputs" and d % 2 == 0:
        sizes = [d // 2, d // 2]
        outs = b.add("Split", [x], 2, axis=axis, num_outputs=2)
    else:
        outs = b.add_axes("Split", x, "split", sizes, len(sizes), axis=axis)
    b.ops.append("Split")
    for out, size in zip(outs, sizes):
        b.act(out, tuple(size if i == axis else v for i, v in enumerate(s)))


def _pad(b: _Builder) -> None:
    x = b.pick()
    s = b.shapes[x]
    mode = b.choice(("constant", "reflect", "edge"))
    pads = [0] * (2 * len(s))
    for i in range(1, len(s)):
        limit = s[i] - 1 if mode == "reflect" else 2
        pads[i], pads[i + len(s)] = (b.draw(st.integers(0, max(0, min(2, limit)))) for _ in range(2))
    shape = tuple(d + pads[i] + pads[i + len(s)] for i, d in enumerate(s))
    if np.prod(shape) > MAX_ELEMENTS:
        return _unary(b)
    inputs = [x, b.init(np.array(pads, np.int64), "pads")]
    value = b.choice((None, 0.0, 1.5)) if mode == "constant" else None
    if value is not None:
        inputs.append(b.init(np.array(value, np.float32), "pad_value"))
    y = b.add("Pad", inputs, mode=mode)[0]
    b.padded.add(y)
    b.ops.append(f"Pad({mode},{value})")
    b.act(y, shape)


OPS = {
    "Relu": lambda b: _unary(b, "Relu"),
    "Conv": _conv,
    "ConvTranspose": lambda b: _conv(b, transpose=True),
    "Gemm": _gemm,
    "MatMul": _matmul,
    "Add": lambda b: _binary(b, "Add"),
    "Sub": lambda b: _binary(b, "Sub"),
    "Mul": lambda b: _binary(b, "Mul"),
    "Div": lambda b: _binary(b, "Div"),
    "Concat": _concat,
    "MaxPool": lambda b: _pool(b, "MaxPool"),
    "AveragePool": lambda b: _pool(b, "AveragePool"),
    "GlobalAveragePool": lambda b: _pool(b, "GlobalAveragePool"),
    "Clip": lambda b: _unary(b, "Clip"),
    "LeakyRelu": lambda b: _unary(b, "LeakyRelu"),
    "Sigmoid": lambda b: _unary(b, "Sigmoid"),
    "Tanh": lambda b: _unary(b, "Tanh"),
    "HardSigmoid": lambda b: _unary(b, "HardSigmoid"),
    "HardSwish": lambda b: _unary(b, "HardSwish"),
    "Softmax": lambda b: _unary(b, "Softmax"),
    "Abs": lambda b: _unary(b, "Abs"),
    "Neg": lambda b: _unary(b, "Neg"),
    "LayerNormalization": _layernorm,
    "InstanceNormalization": _instancenorm,
    "BatchNormalization": _batchnorm,
    "Where": _where,
    "Resize": _resize,
    "Reshape": _reshape,
    "Transpose": _transpose,
    "Flatten": _flatten,
    "Squeeze": _squeeze,
    "Slice": _slice,
    "Gather": _gather,
    "Split": _split,
    "Pad": _pad,
}


@st.composite
def _op_step(draw, b: _Builder) -> None:
    """Add one random op to ``b``: its own strategy, so the shrinker can delete the op as a unit."""
    outer, b.draw = b.draw, draw
    name = draw(st.sampled_from(list(OPS)))
    b.rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))  # per op: deleting one keeps the rest
    if draw(st.integers(0, 7)) == 7:   # tiny/huge weights, huge biases (int32 bias overflow)
        b.param_scale = (draw(st.sampled_from((1.0, 1e-4, 100.0))), draw(st.sampled_from((1.0, 1e3))))
    else:
        b.param_scale = (1.0, 1.0)
    OPS[name](b)
    b.draw = outer


@st.composite
def models(draw, min_ops: int = 1, max_ops: int = 16):
    """A random valid float model (a :class:`DrawnModel`)."""
    opset = draw(st.sampled_from(OPSETS))
    batch = draw(st.sampled_from((1, 1, 2)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b = _Builder(draw, rng, opset, batch, symbolic=draw(st.integers(0, 9)) == 9)
    b.naming = draw(st.sampled_from(("plain", "plain", "plain", "scoped", "unnamed")))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("nchw", "nchw", "nk", "nsk")))
        c, h, w = (draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(1, 6)))
        shape = {"nchw": (batch, c, h, w), "nk": (batch, c * h), "nsk": (batch, h, c * w)}[kind]
        b.input(shape, batched=True)
    for _ in range(draw(st.integers(min_ops, max_ops))):
        draw(_op_step(b))
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


@st.composite
def configs(draw, activations: list[str] = (), nodes: list[str] = (), weights: list[str] = ()):
    """A random QuantConfig as a dict (only keys that differ from the defaults, some of the time)."""
    cfg: dict = {}
    if nodes and draw(st.integers(0, 9)) == 9:
        cfg["nodes_to_exclude"] = [nodes[draw(st.integers(0, len(nodes) - 1))]]
    if nodes and draw(st.integers(0, 14)) == 14:
        cfg["nodes_to_quantize"] = sorted({nodes[draw(st.integers(0, len(nodes) - 1))] for _ in range(3)})
    if draw(st.integers(0, 9)) == 9:
        cfg["scale_type"] = "float16"
    if draw(st.integers(0, 9)) == 9:
        cfg["minimum_real_range"] = draw(st.sampled_from((1e-4, 0.01, 1.0)))
    if draw(st.integers(0, 9)) == 9:
        cfg["force_quantize_no_input_check"] = True
    if draw(st.integers(0, 14)) == 14:
        cfg["op_types_to_exclude_output_quantization"] = sorted(
            draw(st.sets(st.sampled_from(QUANTIZED_OPS), min_size=1, max_size=3)))
    if draw(st.integers(0, 14)) == 14:
        cfg["target"] = "qnn"
    if draw(st.integers(0, 14)) == 14:
        ops = draw(st.sets(st.sampled_from(QUANTIZED_OPS), min_size=1, max_size=6))
        cfg["op_types_to_quantize"] = sorted(ops)
    if draw(st.booleans()):
        cfg["activation_type"] = draw(st.sampled_from(ACTIVATION_TYPES))
    if draw(st.booleans()):
        cfg["weight_type"] = draw(st.sampled_from(WEIGHT_TYPES))
    if draw(st.integers(0, 2)) == 2:
        cfg["per_channel"] = draw(st.booleans())
    for key in ("activation_symmetric", "reduce_range", "keep_removable_activations"):
        if draw(st.integers(0, 3)) == 3:
            cfg[key] = True
    if draw(st.integers(0, 4)) == 4:
        cfg["activation_restricted_asymmetric"] = True
    if draw(st.integers(0, 3)) == 3:
        cfg["weight_symmetric"] = draw(st.booleans())
    if draw(st.integers(0, 9)) == 9:
        cfg["quantize_bias"] = False
    method = draw(st.sampled_from(("default",) + CALIBRATION))
    if method != "default":
        cal = {"method": method}
        if method == "entropy":
            cal["num_bins"] = draw(st.sampled_from((16, 128)))
        if method == "percentile":
            cal["percentile"] = draw(st.sampled_from((99.0, 99.999, 100.0)))
            cal["symmetric"] = draw(st.booleans())
        if method == "minmax" and draw(st.booleans()):
            cal["moving_average"] = True
        cfg["calibration"] = cal
    if activations and draw(st.integers(0, 3)) == 3:
        base = cfg.get("activation_type", "uint8")
        wide = ("uint16", "int16") if base in ("uint8", "int8", "uint4", "int4") else ("uint8", "int8")
        mp = {}
        qt = draw(st.sampled_from(wide))
        for _ in range(draw(st.integers(1, 2))):
            name = activations[draw(st.integers(0, len(activations) - 1))]
            qt = draw(st.sampled_from(wide)) if draw(st.integers(0, 3)) == 3 else qt
            mp[name] = qt if draw(st.booleans()) else {"quant_type": qt, "symmetric": draw(st.booleans())}
        cfg["mixed_precision"] = mp
    if (activations or weights) and draw(st.integers(0, 5)) == 5:
        cfg["tensor_overrides"] = draw(overrides(activations, weights, cfg.get("activation_type", "uint8")))
    return cfg


@st.composite
def overrides(draw, activations, weights, act_type: str):
    """onnxruntime-style TensorQuantOverrides for a few random activations and weights."""
    out = {}
    for _ in range(draw(st.integers(1, 2))):
        if weights and (not activations or draw(st.booleans())):
            name = weights[draw(st.integers(0, len(weights) - 1))]
            kind = draw(st.sampled_from(("quant_type", "symmetric", "reduce_range", "axis")))
            value = {"quant_type": st.sampled_from(WEIGHT_TYPES), "symmetric": st.booleans(),
                     "reduce_range": st.just(True), "axis": st.integers(-1, 1)}[kind]
            out[name] = [{kind: draw(value)}]
            continue
        name = activations[draw(st.integers(0, len(activations) - 1))]
        kind = draw(st.sampled_from(("quant_type", "symmetric", "range", "scale", "convert")))
        if kind == "range":
            entry = {"rmin": -draw(st.sampled_from((0.0, 0.5, 4.0))),
                     "rmax": draw(st.sampled_from((0.5, 1.0, 4.0)))}
        elif kind == "scale":
            qt = ACTIVATION_TYPES.index(act_type)
            lo, hi = ((0, 255), (-128, 127), (0, 65535), (-32768, 32767), (0, 15), (-8, 7))[qt]
            entry = {"scale": draw(st.sampled_from((0.01, 0.1, 1.0))),
                     "zero_point": draw(st.integers(lo, hi))}
        elif kind == "convert":
            wide = ("uint16", "int16") if act_type.endswith("8") else ("uint8", "int8")
            entry = {"convert": {"quant_type": draw(st.sampled_from(wide))}}
        else:
            entry = {kind: draw(st.sampled_from(ACTIVATION_TYPES) if kind == "quant_type" else st.booleans())}
        out[name] = [entry]
    return out


@st.composite
def cases(draw, min_ops: int = 1, max_ops: int = 16):
    """A :class:`FuzzCase`: model, 4 calibration feeds, config."""
    drawn = draw(models(min_ops, max_ops))
    config = draw(configs(drawn.activations, drawn.nodes, drawn.weights))
    specs = drawn.inputs
    scaled = draw(st.integers(0, 3)) == 3          # else every float input is N(0, 1)
    scales = {name: (draw(st.sampled_from((1.0, 0.01, 100.0, 0.0))), draw(st.sampled_from((0.0, 3.0, -3.0))))
              for name, (kind, _, _) in specs.items() if kind == "float" and scaled}
    feeds = feeds_for(specs, draw(st.integers(0, 2**16)), scales=scales)
    traits = ["scaled-feeds"] if any(v != (1.0, 0.0) for v in scales.values()) else []
    return FuzzCase(drawn.model, feeds, config, drawn.ops, traits + ["scaled-params"] * drawn.scaled_params)


# -- running a case ----------------------------------------------------------------------------
@dataclass
class Outcome:
    """What the default pipeline did with a case: ``ok``, ``error`` (a QpassesError), ``crash``, or
    ``skip`` (the float model itself gives inf/NaN on the drawn feeds).

    ``kind`` groups outcomes for counting (the error class and message with names and numbers
    blanked, or the crash's stage and exception site); ``detail`` is the full message.
    """

    status: str
    kind: str
    detail: str = ""
    snr: dict = field(default_factory=dict)


SNR_FLOOR_DB = 0.0


def snr_floor(case: "FuzzCase") -> float | None:
    """The least SNR (dB) a correct quantizer reaches on every output of ``case``, or None.

    Only for unit-normal feeds and activations and weights of 8 bits or more, calibrated with
    minmax (no moving average) or pow2: the SNR is measured on the calibration feeds, so no value
    is clipped and every quantization adds at most half a step, 1/510 of the tensor's range. The
    drawn ops amplify that error by small factors only (weights ~ N(0, 1/fan_in), divisors >= 0.5,
    normalisations with eps = 1e-3 scale by at most ~32, the kinks of HardSwish/Clip/... sit at
    unit scale), so a typical output sits near 40 dB and only a cancellation of roughly 40 dB (an
    output ~100x smaller than its inputs on every sample) pushes it below 0 dB, the SNR of an
    all-zero output. Measured on thousands of eligible cases, the lowest SNR seen is 10-20 dB (a
    tiny Gemm whose output cancels); gross bugs (wrong scale, axis or zero point, a shared scale
    where ranges differ) land well below 0 dB. Without a floor (``no_floor_reasons``): 4-bit types,
    clipping calibrations (percentile, entropy, mse, moving average), tensor overrides (fixed
    ranges, scales), scaled or offset feeds (x100 feeds make HardSwish's output 1000x smaller
    than its input's range) and scaled weights/biases legitimately reach 0 dB.
    """
    return None if no_floor_reasons(case) else SNR_FLOOR_DB


def no_floor_reasons(case: "FuzzCase") -> list[str]:
    """Why ``snr_floor`` does not apply to ``case`` (empty: it applies)."""
    from qpasses import QpassesError, load_config

    try:
        config = load_config(case.config)
    except QpassesError:
        return ["invalid-config"]
    cal = config.calibration
    checks = {"4-bit": any(t.endswith("4") for t in (config.activation_type, config.weight_type)),
              cal.method: cal.method not in ("minmax", "pow2"), "moving-average": cal.moving_average,
              "overrides": config.tensor_overrides}
    return [why for why, applies in checks.items() if applies] + list(case.traits)


def run_case(case: FuzzCase, snr_floor=snr_floor) -> Outcome:
    """Quantize ``case`` with the default pipeline and check the result.

    ok: the model passes onnx.checker, loads and runs in onnxruntime with the float model's
    output shapes, no output's SNR (on the calibration feeds) is NaN, and the SNR is at least
    ``snr_floor(case)`` dB when that returns a number. The SNR is measured with
    ORT_DISABLE_ALL, i.e. the exact QDQ semantics: onnxruntime's QDQ fusions have bugs of their
    own (QLinearSoftmax over an inner axis; a float Conv bias dropped with 16-bit Q/DQ; no 4-bit
    support; QLinearConv refusing per-channel weight scales on another axis), so the default
    session is only checked to load (or else to load with basic optimizations), to run (except in
    fused QLinear kernels) and for NaN; the ``ORT_*`` outcomes mark those onnxruntime bugs.
    error: a one-line QpassesError. Anything else is a crash.
    """
    import qpasses
    from qpasses.evaluate import session

    try:
        onnx.checker.check_model(case.model)
        ref_sess = session(case.model)
        refs = [ref_sess.run(None, f) for f in case.feeds]
    except Exception as exc:  # the strategy made an invalid model: a bug in this module
        return _crash("invalid-model", exc)
    if not all(np.all(np.isfinite(r)) for rs in refs for r in rs):  # large inputs through act x act products
        return Outcome("skip", "skip: the float model overflows on these feeds")
    before = case.model.SerializeToString()
    try:
        q = qpasses.quantize(case.model, case.feeds, config=case.config)
    except qpasses.QpassesError as exc:
        text = str(exc)
        if not text.strip() or "\n" in text.strip() or "Traceback" in text:
            return _crash("unclear-error", exc)
        return Outcome("error", f"{type(exc).__name__}: {_blank(text)}", text)
    except Exception as exc:
        return _crash("pipeline", exc)
    if case.model.SerializeToString() != before:
        return Outcome("crash", "input-mutated", "quantize() changed the ModelProto it was given")
    names = [o.name for o in ref_sess.get_outputs()]
    stage, kind = "export", "ok"
    try:
        proto = q.to_proto()
        stage = "checker"
        onnx.checker.check_model(proto)
        stage = "ort-load"
        try:
            sess = session(proto)
        except Exception as exc:   # onnxruntime's QDQ fusions fail on some valid models
            try:
                sess = _session(proto, "ORT_ENABLE_BASIC")
            except Exception:
                raise exc from None
            kind = ORT_4BIT if _quantizes_activations_to_4_bits(proto) else ORT_LOAD
        exact_sess = _session(proto, "ORT_DISABLE_ALL")
        stage = "ort-run"
        exact = [exact_sess.run(names, f) for f in case.feeds]
        try:
            fused = [sess.run(names, f) for f in case.feeds]
        except Exception as exc:
            if "QLinear" not in str(exc):   # only onnxruntime's fused kernels are excused
                raise
            fused, kind = None, ORT_RUN
    except Exception as exc:
        return _crash(stage, exc)
    for i, name in enumerate(names):
        if any(e[i].shape != r[i].shape for e, r in zip(exact, refs)):
            return Outcome("crash", "output-shape", f"output '{name}' changed shape")
    snr, fused_snr = _snr(names, refs, exact), _snr(names, refs, fused) if fused else {}
    for which, values in (("", snr), (" (onnxruntime optimizations on)", fused_snr)):
        if any(math.isnan(v) for v in values.values()):
            return Outcome("crash", "snr-nan" + which, f"NaN SNR{which}: {values}", snr)
    floor = snr_floor(case) if snr_floor else None
    if floor is not None and min(snr.values()) < floor:
        return Outcome("crash", "snr-low", f"SNR {min(snr.values()):.1f} dB < floor {floor} dB: {snr}", snr)
    if kind == "ok" and min(fused_snr.values()) < min(min(snr.values()) - 10, 20):
        kind = ORT_FUSION
    return Outcome("ok", kind, "", snr)


# outcomes that are onnxruntime's bugs, not qpasses': counted apart, never a failure
ORT_4BIT = "ok, loads only with ORT_ENABLE_BASIC (onnxruntime's QDQ fusions mishandle 4-bit)"
ORT_LOAD = "ok, loads only with ORT_ENABLE_BASIC (an onnxruntime QDQ optimizer bug)"
ORT_FUSION = "ok, >10 dB lost with onnxruntime's optimizations on only (a QDQ fusion bug)"
ORT_RUN = "ok, onnxruntime's fused QLinear kernel fails at run time (the exact QDQ model runs)"


def _snr(names: list[str], refs: list, outs: list) -> dict[str, float]:
    """SNR of each output over every feed."""
    from qpasses.evaluate import snr_db

    return {name: snr_db(np.concatenate([np.ravel(r[i]) for r in refs]),
                         np.concatenate([np.ravel(o[i]) for o in outs])) for i, name in enumerate(names)}


def _quantizes_activations_to_4_bits(proto: onnx.ModelProto) -> bool:
    """A QuantizeLinear (activations only: weights are stored quantized) writes int4/uint4."""
    four = {t.name for t in proto.graph.initializer if t.data_type in (TensorProto.INT4, TensorProto.UINT4)}
    return any(n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in four
               for n in proto.graph.node)


def _session(proto: onnx.ModelProto, level: str):
    """An onnxruntime CPU session at graph optimization ``level`` (ORT_DISABLE_ALL: exact QDQ semantics)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _crash(stage: str, exc: BaseException) -> Outcome:
    """A crash outcome whose kind names the stage, the exception type and where it was raised."""
    import traceback

    inner = exc.__cause__ or exc
    frames = traceback.extract_tb(inner.__traceback__)
    ours = [f for f in frames if "/qpasses/" in f.filename] or frames
    where = f"{ours[-1].filename.rsplit('/qpasses/', 1)[-1]}:{ours[-1].lineno}" if ours else "?"
    first = (str(exc).strip().splitlines() or [""])[0]
    if stage in ("pipeline", "export"):
        kind = f"{stage}: {type(inner).__name__} at {where}"
    else:  # checker / onnxruntime: the message says what is wrong
        text = re.sub(r"^.*?(FAIL|INVALID_GRAPH|INVALID_ARGUMENT) : |\S+\.cc:\d+ [^)]*\) ", "", first)
        kind = f"{stage}: {_blank(text)}"
    return Outcome("crash", kind, f"{type(exc).__name__}: {first}")


def _blank(text: str) -> str:
    """A message with quoted names and numbers replaced, so errors of one kind count together."""
    text = re.sub(r"'[^']*'|\([A-Za-z_][^()]*\)", "'…'", text)
    return re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", text)[:120]
