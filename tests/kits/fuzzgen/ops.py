"""One generator per op: each adds the op (and the constants it reads) to a ``Builder``."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from .builder import MAX_ELEMENTS, Builder


def _conv(b: Builder, transpose: bool = False) -> None:
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


def _batchnorm(b: Builder, x: str | None = None) -> None:
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


def _gemm(b: Builder) -> None:
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


def _matmul(b: Builder) -> None:
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


def _safe_divisor(b: Builder, s: tuple) -> str:
    """A divisor away from zero: a constant with |c| in [0.5, 2], or Sigmoid(t) + 1."""
    if b.flag(0.6):
        shape = b.choice(_broadcast_shapes(s))
        mag = (b.rng.random(shape) * 1.5 + 0.5).astype(np.float32)
        return b.const(np.where(b.rng.random(shape) < 0.3, -mag, mag).astype(np.float32), "d", reuse=False)
    t = b.pick(lambda u: u == s)
    sig = b.act(b.add("Sigmoid", [t])[0], b.shapes[t])
    return b.act(b.add("Add", [sig, b.const(np.ones((1,), np.float32), "one", reuse=False)])[0], b.shapes[t])


def _binary(b: Builder, op: str) -> None:
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


def _concat(b: Builder) -> None:
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


def _pool(b: Builder, op: str) -> None:
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


def _unary(b: Builder, op: str | None = None) -> None:
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


def _layernorm(b: Builder) -> None:
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


def _instancenorm(b: Builder) -> None:
    x = b.pick(lambda s: len(s) >= 3) or b.rank4()
    s = b.shapes[x]
    y = b.add("InstanceNormalization", [x, b.const(b.normal(s[1], std=0.3) + 1, "in_s"),
                                        b.const(b.normal(s[1], std=0.3), "in_b")], epsilon=1e-3)[0]
    b.ops.append("InstanceNormalization")
    b.act(y, s)


def _where(b: Builder) -> None:
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


def _resize(b: Builder) -> None:
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


def _reshape(b: Builder) -> None:
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


def _transpose(b: Builder) -> None:
    x = b.pick()
    s = b.shapes[x]
    perm = b.draw(st.permutations(range(len(s))))
    y = b.add("Transpose", [x], perm=list(perm))[0]
    b.ops.append("Transpose")
    b.act(y, tuple(s[p] for p in perm))


def _flatten(b: Builder) -> None:
    x = b.pick()
    s = b.shapes[x]
    axis = b.draw(st.integers(0, len(s)))
    y = b.add("Flatten", [x], axis=axis)[0]
    b.ops.append("Flatten")
    b.act(y, (int(np.prod(s[:axis])), int(np.prod(s[axis:]))))


def _squeeze(b: Builder) -> None:
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


def _slice(b: Builder) -> None:
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


def _gather(b: Builder) -> None:
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


def _split(b: Builder) -> None:
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


def _pad(b: Builder) -> None:
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
def op_step(draw, b: Builder) -> None:
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
