"""Int16 pair sums in onnxruntime's x86-64 U8S8 kernels: which output channels can saturate them,
and weight codes that cannot.

Measured with onnxruntime 1.32, natively (AVX512-VNNI: exact) against ``qemu-x86_64 -cpu Haswell``
(AVX2), with weight codes crafted so that one pairing saturates and another does not
(tests/analysis/test_saturation.py, ``slow``):

- QLinearConv, QLinearMatMul, MatMulIntegerToFloat and QGemm (a QDQ Conv with a Q after it, a QDQ
  MatMul or Gemm) multiply uint8 activation codes by int8 weight codes as stored (zero points are
  subtracted afterwards) with VPMADDUBSW: the products at K indices 2j and 2j+1 are summed in int16,
  saturating; with an odd K the last is paired with 0. onnxruntime's AVX-512 kernel without VNNI
  uses the same instruction; VNNI (VPDPBUSD) and ARM sum in int32.
- K order: MatMul and Gemm, the weight's K axis; Conv, per group, its NHWC im2col: kernel positions
  outer, input channels inner (k = position * C_in/group + c), so with an odd C_in/group a pair
  straddles two kernel positions.
- Depthwise Conv (one input and one output channel per group) runs a kernel without pair sums; a
  group with one input channel and several outputs pairs kernel positions.
- int8 activations are shifted to uint8 (+128) first, so their codes reach 255 too; uint8 weights
  (U8U8) are widened to int16 first: no saturation. ConvTranspose, and a Conv without a Q after it,
  run in float.

The codes an activation can reach are its type's whole range: a value beyond the calibrated range
clips to the grid's end, and ReLU outputs and mid-range zero points alike reach 255. So a pair of
same-sign weight codes saturates when 255 * |a + b| exceeds the int16 bound: |a + b| > 128.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..ir.decisions import PAIR_SUMS
from ..ir.graphutil import weight_positions
from ..ir.model import QModel
from ..quant.qdq import QParams, quantized_values
from ..quant.qparams import compute_qparams
from ..quant.qtypes import qtype
from .derivations import qparams_options
from .ranges import weight_range
from .scopes import all_nodes, scopes

INT16_MIN, INT16_MAX = -32768, 32767
TOP_CODE = 255                       # the largest activation code the kernel multiplies (int8: shifted)
PAIRED_OPS = ("Conv", "Gemm", "MatMul")
ACTIVATION_TYPES = ("uint8", "int8")
WEIGHT_TYPE = "int8"
GRID = "grid"    # protect-pair-sums' fix keeping int8 weights (pair_safe_scale)


# -- the kernel's view of one weight ---------------------------------------------------------
def trans_b(node: gs.Node) -> bool:
    return node.op == "Gemm" and bool(node.attrs.get("transB", 0))


def depthwise(node: gs.Node, shape) -> bool:
    """One input and one output channel per group: onnxruntime's depthwise kernel (no pair sums)."""
    groups = int(node.attrs.get("group", 1))
    return node.op == "Conv" and len(shape) > 2 and shape[1] == 1 and shape[0] == groups


def k_rows(codes: np.ndarray, op: str, transposed: bool = False) -> np.ndarray:
    """Weight codes as [rows, K]: one row per output (Conv output channel, Gemm/MatMul column of B),
    K in the order the kernel pairs it."""
    if op == "Conv":   # [C_out, C_in/group, k...] -> [C_out, k..., C_in/group]
        return np.moveaxis(codes, 1, -1).reshape(codes.shape[0], -1)
    if transposed:     # Gemm transB: [N, K]
        return codes
    return np.swapaxes(codes, -1, -2).reshape(-1, codes.shape[-2])   # [..., K, N] -> [... N, K]


def from_k_rows(rows: np.ndarray, shape: tuple, op: str, transposed: bool = False) -> np.ndarray:
    """``k_rows``' inverse: rows back in the weight's layout ``shape``."""
    if op == "Conv":
        return np.moveaxis(rows.reshape(shape[0], *shape[2:], shape[1]), -1, 1)
    if transposed:
        return rows.reshape(shape)
    return np.swapaxes(rows.reshape(*shape[:-2], shape[-1], shape[-2]), -1, -2)


def output_axis(ndim: int, op: str, transposed: bool = False) -> int:
    """The weight axis of a row's output channel (what a per-channel scale runs along)."""
    return 0 if op == "Conv" or transposed else ndim - 1


def row_channels(shape: tuple, op: str, transposed: bool = False) -> np.ndarray:
    """The output channel (index along ``output_axis``) of each of ``k_rows``' rows."""
    if op == "Conv" or transposed:
        return np.arange(shape[0])
    return np.arange(int(np.prod(shape[:-2], dtype=np.int64)) * shape[-1]) % shape[-1]


def _pairs(rows: np.ndarray, dtype=np.int32) -> np.ndarray:
    """[rows, K] -> [rows, ceil(K/2), 2] (odd K: the last paired with 0), as ``dtype``."""
    rows = np.asarray(rows, dtype)
    if rows.shape[1] % 2:
        rows = np.pad(rows, ((0, 0), (0, 1)))
    return rows.reshape(rows.shape[0], -1, 2)


def _same_sign_sums(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pair of ``_pairs``: the sum of its positive members and of its negative ones (what the
    pair adds with every activation at the top where its weights are positive, or negative)."""
    plus, minus = np.maximum(p, 0), np.minimum(p, 0)
    return plus[..., 0] + plus[..., 1], minus[..., 0] + minus[..., 1]


def pair_limits(top: int = TOP_CODE) -> tuple[int, int]:
    """The largest and smallest sum of two same-sign weight codes whose products with activation
    codes in [0, top] stay within int16."""
    return INT16_MAX // top, -(-INT16_MIN // top)


def risky_pairs(rows: np.ndarray, top: int = TOP_CODE) -> np.ndarray:
    """[rows, pairs] bool: the pair's products with activation codes in [0, top] can leave int16."""
    high, low = _same_sign_sums(_pairs(rows))
    return (top * high > INT16_MAX) | (top * low < INT16_MIN)


def clip_pairs(rows: np.ndarray, exact: np.ndarray, qmin: int, qmax: int, top: int = TOP_CODE) -> np.ndarray:
    """``rows`` (int codes) with each risky pair moved onto the int16 bound, to the codes nearest to
    ``exact`` (the unrounded codes) in squared error; other pairs unchanged."""
    limit_hi, limit_lo = pair_limits(top)
    r, j = np.nonzero(risky_pairs(rows, top))
    out = np.array(rows, np.int32)
    if not r.size:
        return out
    a0, b0 = out[r, 2 * j], out[r, 2 * j + 1]   # a risky pair is never an odd K's last code and its padding
    ua, ub = np.asarray(exact, np.float64)[r, 2 * j], np.asarray(exact, np.float64)[r, 2 * j + 1]
    target = np.where(a0 + b0 > limit_hi, limit_hi, limit_lo)
    lo, hi = np.maximum(qmin, target - qmax), np.minimum(qmax, target - qmin)
    best = (ua - ub + target) / 2            # the nearest point of a + b = target
    cands = [np.clip(np.floor(best) + d, lo, hi) for d in (0, 1)]
    errs = [(a - ua) ** 2 + (target - a - ub) ** 2 for a in cands]
    a = np.where(errs[0] <= errs[1], cands[0], cands[1]).astype(np.int32)
    out[r, 2 * j], out[r, 2 * j + 1] = a, target - a
    return out


def pair_safe_scale(values: np.ndarray, node: gs.Node, scale, top: int = TOP_CODE) -> np.ndarray:
    """Per output channel (``scale``'s shape: one value or one per channel), the scale of the
    symmetric weight ``values``: ``scale`` where no same-sign pair of its round-to-nearest codes
    sums past the int16 bound, else the smallest on which none can: |a + b| / scale <= limit - 1/2
    keeps the rounded sum within it."""
    values, scale = np.asarray(values, np.float64), np.asarray(scale, np.float64)
    transposed = trans_b(node)
    rows = np.asarray(k_rows(values, node.op, transposed))
    channels = row_channels(values.shape, node.op, transposed)
    per_row = scale[channels] if scale.size > 1 else np.full(len(channels), scale.item())
    risky = risky_pairs(np.rint(rows / per_row[:, None]), top).any(1)
    high, low = _same_sign_sums(_pairs(rows, np.float64))
    largest = np.maximum(high.max(1), -low.min(1))   # per row
    per_channel = np.zeros(int(channels.max()) + 1)
    np.maximum.at(per_channel, channels, np.where(risky, largest, 0.0))
    high, low = pair_limits(top)
    need = per_channel / (min(high, -low) - 0.5)
    return np.maximum(scale, need if scale.size > 1 else need.max(keepdims=True))


def within_pairs(target, codes: np.ndarray, exact: np.ndarray, qt) -> np.ndarray:
    """Codes [groups, rows, inputs] a rounding pass chose for ``target`` (analysis.weighted_layers),
    a weight on a pair-safe grid (zero point 0), with each pair that could leave int16 moved onto
    the bound (``clip_pairs``; ``exact``: the unrounded codes)."""
    node, shape = target.node, np.shape(target.weight.values)
    transposed = trans_b(node)
    rows = clip_pairs(k_rows(target.from_rows(np.rint(codes), shape), node.op, transposed),
                      k_rows(target.from_rows(exact, shape), node.op, transposed), qt.qmin, qt.qmax)
    return target.to_rows(from_k_rows(rows, shape, node.op, transposed)).astype(np.asarray(codes).dtype)


def pair_grids(model: QModel) -> set[str]:
    """The weights protect-pair-sums put on a pair-safe grid (``pair_safe_scale``): passes choosing
    their codes later keep them ``within_pairs``."""
    layers = (model.decisions.get(PAIR_SUMS) or {}).get("layers", {})
    return {weight for weight, row in layers.items() if row.get("fix") == GRID}


# -- the layers onnxruntime runs with pair sums ----------------------------------------------
@dataclass
class PairLayer:
    """A node onnxruntime runs as a U8S8 integer kernel, with its weight's codes as stored."""

    node: gs.Node
    weight: str
    codes: np.ndarray        # int32, the weight's layout

    @property
    def transposed(self) -> bool:
        return trans_b(self.node)

    def rows(self) -> np.ndarray:
        return k_rows(self.codes, self.node.op, self.transposed)

    def risky(self, top: int = TOP_CODE) -> tuple[np.ndarray, int]:
        """bool per output channel (some pair of its row(s) can saturate), and the risky pairs."""
        pairs = risky_pairs(self.rows(), top)
        out = np.zeros(self.codes.shape[output_axis(self.codes.ndim, self.node.op, self.transposed)], bool)
        np.logical_or.at(out, row_channels(self.codes.shape, self.node.op, self.transposed), pairs.any(1))
        return out, int(pairs.sum())


def _kernel_candidate(node: gs.Node) -> bool:
    return node.op in PAIRED_OPS and len(node.inputs) > 1


def _weight_qparams(model: QModel, name: str, tq, config, ndim: int) -> QParams | None:
    """The entry's qparams; before compute-qparams (with a config), those it will compute from the values."""
    if tq.scale:
        return QParams.of(name, tq, ndim)
    if config is None:
        return None
    rmin, rmax, _ = weight_range(model, name, tq)
    scale, zero_point = compute_qparams(rmin, rmax, tq.qtype, **qparams_options(tq, config))
    return QParams.make(name, tq.qtype, np.ravel(scale).tolist(), np.ravel(zero_point).tolist(), tq.axis, ndim)


def table_layers(model: QModel, config=None) -> list[PairLayer]:
    """Before insert-qdq: the nodes the table makes U8S8 integer kernels (8-bit integer data input,
    int8 constant weight; a Conv's output quantized to 8 bits), with the codes insert-qdq will
    store (given a ``config``, weights without qparams yet get those compute-qparams will give them)."""
    out, table = [], model.quant
    for node in all_nodes(model):
        if not _kernel_candidate(node):
            continue
        data, weight = node.inputs[0], node.inputs[1]
        tq, src = table.get(weight.name), table.get(data.name)
        if (not isinstance(weight, gs.Constant) or tq is None or tq.role != "weight" or tq.convert is not None or tq.qtype != WEIGHT_TYPE or src is None
                or src.qtype_read_by(node.name) not in ACTIVATION_TYPES):
            continue
        if node.op == "Conv":
            dst = table.get(node.outputs[0].name)
            if dst is None or dst.qtype not in ACTIVATION_TYPES:
                continue
        values = np.asarray(weight.values)
        if depthwise(node, values.shape):
            continue
        qp = _weight_qparams(model, weight.name, tq, config, values.ndim)
        if qp is None:
            continue
        out.append(PairLayer(node, weight.name, quantized_values(values, qp).astype(np.int32)))
    return out


def _dq_input(tensor: gs.Tensor) -> gs.Node | None:
    node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    return node if node is not None and node.op == "DequantizeLinear" else None


def _zero_point_type(node: gs.Node) -> str | None:
    """The integer type a Q or DQ node's zero point declares (uint8 when it has none)."""
    if len(node.inputs) < 3 or node.inputs[2].name == "":
        return "uint8"
    zp = node.inputs[2]
    dtype = zp.values.dtype if isinstance(zp, gs.Constant) else getattr(zp, "dtype", None)
    try:
        return qtype(np.dtype(dtype).name).name
    except Exception:   # a float8 or unknown type: no U8S8 kernel
        return None


def qdq_layers(model: QModel) -> list[PairLayer]:
    """In a QDQ model (any producer's): the nodes onnxruntime fuses into U8S8 integer kernels, with
    the int8 codes their weight DequantizeLinear holds."""
    out = []
    for node in all_nodes(model):
        if not _kernel_candidate(node):
            continue
        data, weight = (_dq_input(t) for t in node.inputs[:2])
        if data is None or weight is None or not isinstance(weight.inputs[0], gs.Constant):
            continue
        codes = np.asarray(weight.inputs[0].values)
        if codes.dtype != np.int8 or _zero_point_type(data) not in ACTIVATION_TYPES or depthwise(node, codes.shape):
            continue
        if node.op == "Conv" and not any(r.op == "QuantizeLinear" and _zero_point_type(r) in ACTIVATION_TYPES
                                         for r in node.outputs[0].outputs):
            continue
        out.append(PairLayer(node, weight.inputs[0].name, codes.astype(np.int32)))
    return out


@dataclass(frozen=True)
class Risk:
    """A layer whose int16 pair sums can saturate on a CPU without VNNI."""

    node: str
    op: str
    weight: str
    channels: tuple[int, ...]   # output channels with a risky pair
    of: int                     # output channels in all
    pairs: int                  # risky pairs

    def line(self) -> str:
        return (f"{self.op} '{self.node}': {len(self.channels)} of {self.of} output channels "
                f"({self.pairs} weight pairs)")


def risks(layers: list[PairLayer]) -> list[Risk]:
    """The layers with a pair that can saturate, in graph order."""
    out = []
    for layer in layers:
        channels, pairs = layer.risky()
        if channels.any():
            out.append(Risk(layer.node.name, layer.node.op, layer.weight, tuple(int(c) for c in np.flatnonzero(channels)),
                            channels.size, pairs))
    return out


# -- the pair sums data reaches -----------------------------------------------------------------
CHUNK = 1 << 22     # pair sums computed at once (int32)


class PairSums:
    """The int16 pair sums a layer's risky pairs reach in the U8S8 kernel on its input data, and what
    saturating them costs: each value the kernel reads quantized with the layer's input qparams (int8
    codes shifted by 128, a Conv's padding at the zero point), the products of each risky pair's two
    codes summed exactly (int32, numpy integers: the same on every machine), for the pairs whose
    inputs' largest codes on that input let them pass the cap. ``update`` takes the float input (a
    calibration.runner collector). ``largest``: the largest |sum| as a share of the
    int16 bound; ``noise``: the power of the error the kernel's outputs would carry if the sums
    saturated at ``limit`` times the int16 bounds (each output's clipped parts summed, times its
    channel's weight scale), relative to the power of the noise quantizing the input adds to them
    (step^2 / 12 times the row's squared weights, per output; the input scale cancels)."""

    min = max = 0.0   # collect_stats' test for body tensors that never ran

    def __init__(self, layer: PairLayer, qp: QParams, weight_scale, weight_zero_point, limit: float = 1.0,
                 top: int = TOP_CODE):
        rows = layer.rows()
        r, j = np.nonzero(risky_pairs(rows, top))
        self.layer, self.qp, self.shift = layer, qp, 128 if qp.qtype.name == "int8" else 0
        a, b = rows[r, 2 * j], rows[r, 2 * j + 1]   # a risky pair never holds an odd K's padding
        # |codes| <= 128 times input codes <= 255: each |sum| fits uint16 (exact, half int32's traffic)
        self.a, self.b = np.abs(a).astype(np.uint16), np.abs(b).astype(np.uint16)
        self.sign = np.sign(a)   # both codes of a risky pair share a sign
        self.rows, self.k = r, 2 * j
        scale = np.float32(qp.scale[0])   # the input's: quantizing keeps the order of values with one finite positive scale
        self.monotonic = len(qp.scale) == 1 and 0 < scale < np.inf
        self.bound = np.where(a > 0, INT16_MAX, -INT16_MIN)            # the |sum| int16 holds, per pair
        self.cap = (self.bound * limit).astype(np.int64)               # the |sum| taken to saturate
        self.parts = np.uint16 if limit >= 0 else np.int32             # the parts of sums past their cap
        channels = row_channels(layer.codes.shape, layer.node.op, layer.transposed)
        n = (int(channels.max()) + 1,)
        self.scale = np.broadcast_to(np.asarray(weight_scale, np.float64), n)[channels]
        zero = np.broadcast_to(np.asarray(weight_zero_point, np.int64), n)[channels]
        squares = ((rows.astype(np.int64) - zero[:, None]) ** 2).sum(1)   # exact
        self.row_power = math.fsum(squares * self.scale ** 2) / 12
        self.extreme = np.zeros(r.size, np.int64)              # per pair, the largest |sum|
        self.sums = self.saturated = self.samples = self.outputs = self._outputs = 0
        self.errors: list[float] = []                          # per sample and row, its error power
        self.unread = False
        self.ceiling = 0.0                                     # the largest bound of the pairs not summed
        self.last_error: dict[int, np.ndarray] = {}

    @property
    def noise(self) -> float:
        """Saturation error power over input-quantization noise power (floats summed exactly: math.fsum)."""
        return math.fsum(self.errors) / (self.row_power * self.outputs) if self.outputs and self.row_power else 0.0

    @property
    def noise_db(self) -> float | None:
        """``noise`` in dB to 0.1 dB (None: nothing saturates), which the decision reads: a float input
        differing in its last bits between CPUs' kernels moves a code now and then, not this."""
        noise = self.noise
        return round(10 * math.log10(noise), 1) if noise > 0 else None

    @staticmethod
    def emulated(layer: PairLayer) -> bool:
        """Whether the input layout is known: a Conv, or a 2-D MatMul/Gemm weight."""
        return layer.node.op == "Conv" or layer.codes.ndim == 2

    def update(self, x, *_) -> None:
        x = np.asarray(x)
        if self.layer.node.op == "Conv" and x.ndim != self.layer.codes.ndim:
            self.unread = True   # not the layout the layer reads: nothing measured
            return
        self.last_error = {}   # row -> each output's clipped parts (int64) on this input
        if self.layer.node.op == "Conv":
            self._conv(x)
        else:
            if self.layer.node.op == "Gemm" and self.layer.node.attrs.get("transA", 0):
                x = x.T
            worth, codes, at = self._inputs(x, x.ndim - 1, self.k, self.k + 1)
            self._reduce(np.flatnonzero(worth), lambda sel: codes[..., at[self.k[sel]]],
                         lambda sel: codes[..., at[self.k[sel] + 1]], -1)
        self.errors += [_square_sum(e) * self.scale[row] ** 2 for row, e in self.last_error.items()]
        self.outputs += self._outputs
        self.samples += 1

    def _codes(self, x: np.ndarray) -> np.ndarray:
        """The codes the kernel reads for ``x`` (uint8; int8 codes + 128: the sign bit flipped)."""
        codes = quantized_values(x, self.qp)
        return np.bitwise_xor(codes.view(np.uint8), np.uint8(self.shift)) if self.shift else codes

    def _inputs(self, x: np.ndarray, axis: int, first: np.ndarray, second: np.ndarray, pad=None):
        """(``_worth`` per pair, the codes of the inputs of ``x`` along ``axis`` that the pairs worth it
        read, each input's index among those). An input's largest code is its largest value's
        (``monotonic``), or ``pad``'s (the padding's code)."""
        others = tuple(a for a in range(x.ndim) if a != axis)
        top = x.max(axis=others)
        codes = None
        if self.monotonic and not np.isnan(top).any():
            maxima = self._codes(top)
        else:   # the codes of every input
            codes = self._codes(x)
            maxima = codes.max(axis=others)
        worth = self._worth(maxima if pad is None else np.maximum(maxima, pad), first, second)
        if codes is not None:
            return worth, codes.astype(np.uint16), np.arange(maxima.size)
        read = np.unique(np.concatenate([first[worth], second[worth]]))
        at = np.zeros(maxima.size, np.intp)
        at[read] = np.arange(read.size)
        return worth, self._codes(np.take(x, read, axis=axis)).astype(np.uint16), at   # the sums' type

    def _conv(self, x: np.ndarray) -> None:
        from ..quant.conv_pads import auto_pad_of, conv_pads

        node, shape = self.layer.node, self.layer.codes.shape
        kernel, per_group = shape[2:], shape[1]
        rank = len(kernel)
        strides = [int(s) for s in node.attrs.get("strides", [1] * rank)]
        dilations = [int(d) for d in node.attrs.get("dilations", [1] * rank)]
        begins, ends = conv_pads(auto_pad_of(node.attrs), node.attrs.get("pads", [0] * 2 * rank), x.shape[2:],
                                 kernel, strides, dilations)
        group = self.rows // (shape[0] // int(node.attrs.get("group", 1)))
        first, second = self.k, self.k + 1
        channel = lambda sel, k: group[sel] * per_group + k[sel] % per_group   # noqa: E731
        every = slice(None)
        pad = int(self.qp.zero_point[0]) + self.shift
        worth, codes, at = self._inputs(x, 1, channel(every, first), channel(every, second),
                                        pad if any(begins) or any(ends) else None)
        if not worth.any():
            return
        padded = np.pad(codes, [(0, 0), (0, 0)] + list(zip(begins, ends)), constant_values=pad)
        out = [(n - (k - 1) * d - 1) // s + 1 for n, k, s, d in zip(padded.shape[2:], kernel, strides, dilations)]

        def view(position: int) -> np.ndarray:   # the input codes kernel position ``position`` multiplies
            offsets = np.unravel_index(position, kernel)
            return padded[(slice(None), slice(None)) + tuple(slice(p * d, p * d + s * (o - 1) + 1, s)
                                                             for p, d, s, o in zip(offsets, dilations, strides, out))]

        where = (first // per_group) * int(np.prod(kernel)) + second // per_group   # the pair's two kernel positions
        for key in np.unique(where[worth]):
            pairs = np.flatnonzero((where == key) & worth)
            v1, v2 = view(first[pairs[0]] // per_group), view(second[pairs[0]] // per_group)
            self._reduce(pairs, lambda sel: v1[:, at[channel(sel, first)]], lambda sel: v2[:, at[channel(sel, second)]], 1)

    def _worth(self, maxima: np.ndarray, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        """bool per pair: its sums can pass its cap, given the largest code of each input (``maxima``)
        and the inputs each pair's codes multiply; the others' bounds only raise ``ceiling``."""
        maxima = maxima.astype(np.int64)
        most = self.a * maxima[first] + self.b * maxima[second]
        worth = most > self.cap
        if not worth.all():
            self.ceiling = max(self.ceiling, float((most[~worth] / self.bound[~worth]).max()))
        return worth

    def _reduce(self, pairs: np.ndarray, left, right, axis: int) -> None:
        """Each pair's |sums| over the codes ``left(sel)`` and ``right(sel)`` read (pairs along ``axis``),
        in chunks; the clipped parts only for the pairs whose sums pass their cap."""
        if not pairs.size:
            return
        probe = left(pairs[:1])
        axis %= probe.ndim
        step = max(1, CHUNK // max(1, probe.size))
        shape = [1] * probe.ndim
        for start in range(0, pairs.size, step):
            sel = pairs[start:start + step]
            shape[axis] = sel.size
            sums = self.a[sel].reshape(shape) * left(sel)
            sums += self.b[sel].reshape(shape) * right(sel)
            sums = np.moveaxis(sums, axis, 0).reshape(sel.size, -1)   # [pairs, outputs]: a view when the axes before are 1
            top = sums.max(1)
            self.extreme[sel] = np.maximum(self.extreme[sel], top)
            self.sums += sums.size
            self._outputs = sums.shape[1]   # outputs of one row in this sample
            hot = np.flatnonzero(top > self.cap[sel])
            if hot.size:
                self._clip(sel[hot], sums if hot.size == sel.size else sums[hot])

    def _clip(self, pairs: np.ndarray, sums: np.ndarray) -> None:
        """Count the ``sums`` ([pairs, outputs], |sums| as uint16, overwritten) past their pair's bound, and
        add the parts past its cap, with its sign, to their row's outputs' (integer sums: exact in any order)."""
        self.saturated += int(np.count_nonzero(sums > self.bound[pairs, None].astype(sums.dtype)))
        parts, cap = sums.astype(self.parts, copy=False), self.cap[pairs, None].astype(self.parts)
        np.maximum(parts, cap, out=parts)
        parts -= cap
        rows, sign = self.rows[pairs], self.sign[pairs]   # rows ascending: pairs are taken in row order
        cuts = np.flatnonzero((rows[1:] != rows[:-1]) | (sign[1:] != sign[:-1])) + 1   # runs of one row and sign
        starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [rows.size]])
        for row, negative, start, end in zip(rows[starts].tolist(), (sign[starts] < 0).tolist(), starts, ends):
            part = parts[start:end].sum(0, dtype=np.int64) if end - start > 1 else parts[start].astype(np.int64)
            if negative:
                np.negative(part, out=part)
            if row in self.last_error:
                self.last_error[row] += part
            else:
                self.last_error[row] = part

    @property
    def largest(self) -> float:
        """The largest |pair sum| seen, as a share of the int16 bound it would cross; when ``exact`` is
        False, a bound on it (pairs whose codes' maxima kept them below their cap were not summed)."""
        seen = float((self.extreme / self.bound).max()) if self.extreme.size else 0.0
        return max(seen, self.ceiling)

    @property
    def exact(self) -> bool:
        return not self.extreme.size or float((self.extreme / self.bound).max()) >= self.ceiling


def _square_sum(values: np.ndarray) -> float:
    """The sum of the integers' squares, the same whatever the order numpy adds in: exact below 2^53,
    else summed exactly and rounded once (math.fsum)."""
    squares = values.astype(np.float64) ** 2
    total = float(squares.sum())
    return total if total < 2.0 ** 53 else math.fsum(squares[squares > 0])


def reached(model: QModel, layers: list[PairLayer], data, samples: int, limit: float = 1.0,
            budget: float = math.inf) -> tuple[dict[str, PairSums], int]:
    """node name -> PairSums of each main-graph layer (whose input layout is known) over ``samples``
    feeds of ``data`` (one float run reading only those layers' inputs, calibration.runner), saturating at ``limit`` times the int16 bounds; and the feeds read. Layers
    are taken in order while their risky pairs times output positions times ``samples`` stay within
    ``budget`` sums (the rest are not measured: their caller protects them; a layer of unknown
    output shape counts 0: it is measured whatever the budget). That count bounds the sums computed
    (the pairs whose inputs' largest codes keep them below their cap are skipped), and the time
    follows the sums: about 1 s per 1e8 on one core when every pair passes its cap."""
    from ..calibration.runner import collect_stats
    from .weighted_layers import Readers

    by_input: dict[str, list[PairSums]] = {}
    out, inner = {}, scopes(model)
    spent = 0.0
    for layer in layers:   # a body's values reach collect_stats threaded out, not in their layout
        cost = (weight_positions(layer.node) or 0.0) * int(risky_pairs(layer.rows()).sum()) * samples
        if PairSums.emulated(layer) and not inner.scope_of(layer.node) and spent + cost <= budget:
            spent += cost
            data_in = layer.node.inputs[0].name
            tq = model.quant[data_in]
            qp = QParams.make(data_in, tq.qtype_read_by(layer.node.name),
                              *((tq.convert.scale, tq.convert.zero_point) if tq.converted_for(layer.node.name)
                                else (tq.scale, tq.zero_point)), tq.axis, len(layer.node.inputs[0].shape or ()) or None)
            wq = model.quant[layer.weight]
            out[layer.node.name] = PairSums(layer, qp, wq.scale, wq.zero_point, limit)
            by_input.setdefault(data_in, []).append(out[layer.node.name])
    if not by_input:
        return out, 0
    _, count = collect_stats(model, data, max_samples=samples, only=set(by_input),
                             collector=lambda name: Readers(by_input.get(name, [])))
    return {name: found for name, found in out.items() if found.samples and not found.unread}, count


def verdict(found: list[Risk], cpu: str, checked: int) -> str:
    """One line: the layers whose pair sums can saturate on x86-64 without VNNI, and what ``cpu`` makes of them."""
    from ..config.quant_config import PAIR_SATURATING_CPUS

    if not found:
        return f"int16 pair sums: none of {checked} uint8 x int8 layers can saturate on any CPU"
    action = ("protect-pair-sums protects those that saturate measurably on the calibration data (data=false: all)"
              if cpu in PAIR_SATURATING_CPUS else f"left as they are for cpu {cpu} (cpu: x86-64 protects every x86-64 CPU)")
    names = "; ".join(r.line() for r in found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
    return (f"int16 pair sums: {len(found)} of {checked} uint8 x int8 layers can saturate on x86-64 without "
            f"VNNI, {action}: {names}")


def decision_line(model: QModel) -> str | None:
    """protect-pair-sums' decision saved in the model, in one line (None: no layer was at risk)."""
    record = model.decisions.get(PAIR_SUMS)
    if not record:
        return None
    layers = record.get("layers", {})
    if record.get("protected"):
        fixes = [row.get("fix") for row in layers.values()]
        words = {GRID: "on int8 grids no pair can saturate", "uint8": "with weights stored as uint8",
                 "int8": "left int8 (no measurable saturation)"}
        done = ", ".join(f"{fixes.count(f)} {words.get(f, f'left ({f})')}" for f in dict.fromkeys(fixes))
        data = record.get("data") or {}
        done += (f", judged on {data['samples']} calibration samples" if data.get("samples")
                 else f" ({data['skipped']})" if data.get("skipped") else "")
    else:
        done = "left as they are, but would saturate on x86-64 without VNNI"
    names = "; ".join(f"{row['op']} '{row['node']}' ({len(row['channels'])} of {row['of']} output channels)"
                      for row in list(layers.values())[:5]) + (f"; and {len(layers) - 5} more" if len(layers) > 5 else "")
    count = len(layers)
    return f"int16 pair sums (cpu {record.get('cpu')}): {count} layer{'s' * (count != 1)} at risk, {done}: {names}"
