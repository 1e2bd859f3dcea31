"""Weight rounding that minimises a layer's output error (GPTQ with fixed scales), for round-weights.

For a layer y = W x with the weight's scales and zero points already chosen, the integer codes are
picked one input column at a time; each column's rounding error is spread over the columns not yet
rounded, weighted by the inverse of H = X^T X / rows (X: the layer's float inputs on calibration
data, as rows of its receptive fields). Round-to-nearest ignores that the inputs are correlated;
this keeps ||(W - W_q) X|| small instead of ||W - W_q||. Layers are batched by group: a weight is
[G, R, K] (G groups of R output channels reading K inputs each: G = 1 for MatMul/Gemm/dense Conv,
G = channels for a depthwise Conv) with H [G, K, K].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .conv_pads import auto_pad_of, conv_pads
from .weightonly.gptq import inverse_cholesky

ROW_ELEMENTS = 4_000_000      # at most this many floats of receptive fields per sample and layer
ROW_FLOPS = 150_000_000       # and at most this many multiply-adds into H per sample and layer
BATCH = 128                   # lazy GPTQ updates: columns per batch


@dataclass
class Geometry:
    """How a layer reads its input: ``kind`` dense (MatMul/Gemm: the last axis is K) or conv
    (N, C, spatial...: receptive fields of ``kernel`` with strides, pads, dilations, groups)."""

    kind: str
    k: int                        # inputs per output channel (per group)
    groups: int = 1
    kernel: tuple = ()
    strides: tuple = ()
    pads: tuple = ()              # begin..., end...
    dilations: tuple = ()
    auto_pad: str = "NOTSET"

    @property
    def h_bytes(self) -> int:
        return self.groups * self.k * self.k * 8


def conv_geometry(attrs: dict, weight_shape: tuple) -> Geometry | None:
    """The Geometry of a 1-D or 2-D Conv with this weight shape [O, C/g, k...] (None: other ranks)."""
    kernel = tuple(int(k) for k in weight_shape[2:])
    rank = len(kernel)
    if rank not in (1, 2):
        return None
    strides, dilations = tuple(attrs.get("strides", [1] * rank)), tuple(attrs.get("dilations", [1] * rank))
    pads = tuple(attrs.get("pads", [0] * 2 * rank))
    if rank == 1:   # read as 2-D with height 1 (input_rows adds the axis)
        kernel, strides, dilations, pads = (1,) + kernel, (1,) + strides, (1,) + dilations, (0, pads[0], 0, pads[1])
    return Geometry("conv", int(np.prod(weight_shape[1:])), int(attrs.get("group", 1)), kernel, strides, pads,
                    dilations, auto_pad_of(attrs))


def input_rows(x: np.ndarray, geo: Geometry, rng: np.random.Generator) -> np.ndarray:
    """[G, K, R] float32 columns of ``x`` as the layer reads them (R rows: tokens or receptive
    fields), at most ROW_ELEMENTS / ROW_FLOPS worth, sampled without replacement when there are more."""
    x = np.asarray(x, np.float32)
    if geo.kind == "dense":
        rows = x.reshape(-1, x.shape[-1])
        return np.ascontiguousarray(rows[_pick(len(rows), _row_budget(geo), rng)].T)[None]
    if x.ndim == 3:   # a 1-D conv (conv_geometry made it 2-D with height 1)
        x = x[:, :, None, :]
    n, c, height, width = x.shape
    begins, ends = conv_pads(geo.auto_pad, geo.pads, (height, width), geo.kernel, geo.strides, geo.dilations)
    xp = np.pad(x, ((0, 0), (0, 0), (begins[0], ends[0]), (begins[1], ends[1])))
    (kh, kw), (sh, sw), (dh, dw) = geo.kernel, geo.strides, geo.dilations
    span_h, span_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    if xp.shape[2] < span_h or xp.shape[3] < span_w:
        return np.zeros((geo.groups, geo.k, 0), np.float32)
    windows = np.lib.stride_tricks.sliding_window_view(xp, (span_h, span_w), axis=(2, 3))
    windows = windows[:, :, ::sh, ::sw, ::dh, ::dw]              # [N, C, oh, ow, kh, kw], a view
    oh, ow = windows.shape[2:4]
    pick = _pick(n * oh * ow, _row_budget(geo, c * kh * kw), rng)
    b, rest = np.divmod(pick, oh * ow)
    oy, ox = np.divmod(rest, ow)
    fields = windows[b, :, oy, ox]                                # [R, C, kh, kw]
    fields = fields.reshape(len(pick), geo.groups, -1)            # [R, G, C/g * kh * kw]
    return np.ascontiguousarray(fields.transpose(1, 2, 0))


def _row_budget(geo: Geometry, width: int | None = None) -> int:
    width = width or geo.k
    return max(1, min(ROW_ELEMENTS // max(width, 1), ROW_FLOPS // max(geo.k * width, 1)))


def _pick(total: int, budget: int, rng: np.random.Generator) -> np.ndarray:
    if total <= budget:
        return np.arange(total)
    return np.sort(rng.choice(total, budget, replace=False))


class Hessian:
    """Running X^T X [G, K, K] and row count of one layer's input."""

    def __init__(self, geo: Geometry, seed: int):
        self.geo, self.rng = geo, np.random.default_rng(seed)
        self.xtx = np.zeros((geo.groups, geo.k, geo.k))
        self.sum = np.zeros((geo.groups, geo.k))
        self.rows = 0

    def update(self, x: np.ndarray) -> None:
        cols = input_rows(x, self.geo, self.rng)
        self.xtx += cols @ cols.transpose(0, 2, 1)   # float32 products of one sample, summed in float64
        self.sum += cols.sum(axis=2, dtype=np.float64)
        self.rows += cols.shape[2]

    @property
    def h(self) -> np.ndarray:
        return self.xtx / max(self.rows, 1)

    @property
    def mean(self) -> np.ndarray:
        """[G, K]: the mean input row."""
        return self.sum / max(self.rows, 1)


def upper_inverse_cholesky(h: np.ndarray, damping: float) -> np.ndarray:
    """U [G, K, K] upper triangular with H^-1 = U^T U for each damped H [G, K, K] (batched; a matrix
    that is not positive definite goes through weightonly.gptq's one-at-a-time extra damping)."""
    flipped = h[:, ::-1, ::-1].copy()
    mean = np.maximum(np.diagonal(flipped, axis1=1, axis2=2).mean(axis=1), 1e-8)
    k = h.shape[1]
    flipped[:, np.arange(k), np.arange(k)] += damping * mean[:, None]
    try:
        lower = np.linalg.cholesky(flipped)
    except np.linalg.LinAlgError:
        return np.stack([inverse_cholesky(m, damping) for m in h])
    return np.linalg.inv(lower)[:, ::-1, ::-1].copy()


def round_codes(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, qmin: int, qmax: int,
                h: np.ndarray, damping: float) -> np.ndarray:
    """Integer codes [G, R, K] for weights w [G, R, K] with per-row scale and zero point [G, R],
    clipped to [qmin, qmax], chosen column by column against H [G, K, K] (see module doc)."""
    w = np.array(w, np.float64)
    g, r, k = w.shape
    s, z = scale[..., None].astype(np.float64), zero[..., None].astype(np.float64)
    lo, hi = qmin - z, qmax - z
    h = np.array(h, np.float64)
    dead = np.diagonal(h, axis1=1, axis2=2) <= 0              # inputs that were always 0
    gi, ki = np.nonzero(dead)
    h[gi, ki, ki] = 1.0
    w[gi, :, ki] = 0.0
    u = upper_inverse_cholesky(h, damping)
    codes = np.empty_like(w)
    for c1 in range(0, k, BATCH):
        c2 = min(c1 + BATCH, k)
        block, err = w[:, :, c1:c2], np.empty((g, r, c2 - c1))
        for j in range(c2 - c1):
            col = block[:, :, j:j + 1]
            q = np.clip(np.rint(col / s), lo, hi)
            codes[:, :, c1 + j:c1 + j + 1] = q
            e = (col - q * s) / u[:, None, c1 + j, c1 + j, None]
            block[:, :, j + 1:] -= e * u[:, None, c1 + j, c1 + j + 1:c2]
            err[:, :, j:j + 1] = e
        if c2 < k:
            w[:, :, c2:] -= err @ u[:, c1:c2, c2:]
    return codes + z
