"""``Builder``: grows a random graph one op at a time (the op generators are in ``ops``)."""
from __future__ import annotations

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

MAX_ELEMENTS = 512          # no activation grows beyond this many elements


class Builder:
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
