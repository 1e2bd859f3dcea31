"""Weight rounding that minimises a layer's output error with the weight's scales fixed: GPTQ
(round-weights) and the quadratic layer loss of reconstruct-weights.

For a layer y = W x with the weight's scales and zero points already chosen, the integer codes are
picked one input column at a time; each column's rounding error is spread over the columns not yet
rounded, weighted by the inverse of H = X^T X / rows (X: the layer's inputs on calibration data, as
rows of its receptive fields). Round-to-nearest ignores that the inputs are correlated; this keeps
||(W - W_q) X|| small instead of ||W - W_q||. With the quantized model's inputs X_q beside the
float ones X (``Hessian.update(x_q, x)``), ||W_q X_q - W X||^2 = (W_q - T) H (W_q - T)^T + const
for H = X_q^T X_q / rows and the target T = W (X^T X_q) H^-1 (``target``): the same rounding,
aimed at T. ``refine_codes`` then moves single codes while the loss falls. Layers are batched by
group: a weight is [G, R, K] (G groups of R output channels reading K inputs each: G = 1 for
MatMul/Gemm/dense Conv, G = channels for a depthwise Conv) with H [G, K, K].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .conv_pads import auto_pad_of, conv_pads

ROW_ELEMENTS = 4_000_000      # at most this many floats of receptive fields per sample and layer
ROW_FLOPS = 150_000_000       # and at most this many multiply-adds into H per sample and layer
BATCH = 128                   # lazy GPTQ updates: columns per batch
_LEAF = 128                   # lower_inverse: blocks this small are inverted directly


@dataclass
class Geometry:
    """How a layer reads its input: ``kind`` dense (MatMul/Gemm: the last axis is K) or conv
    (N, C, spatial...: receptive fields of ``kernel`` with strides, pads, dilations, groups; a
    ConvTranspose reads its input with zeros inserted ``upsample`` apart, as the Conv it equals)."""

    kind: str
    k: int                        # inputs per output channel (per group)
    groups: int = 1
    kernel: tuple = ()
    strides: tuple = ()
    pads: tuple = ()              # begin..., end... (negative: cropped)
    dilations: tuple = ()
    auto_pad: str = "NOTSET"
    upsample: tuple = ()

    @property
    def h_bytes(self) -> int:
        return self.groups * self.k * self.k * 8


def conv_geometry(attrs: dict, weight_shape: tuple, transposed: bool = False) -> Geometry | None:
    """The Geometry of a 1-D or 2-D Conv (ConvTranspose with ``transposed``) with this weight shape
    ([O, C/g, k...]; ConvTranspose [C, O/g, k...]); None for other ranks, and for a ConvTranspose
    whose padding is not explicit (auto_pad, output_shape)."""
    kernel = tuple(int(k) for k in weight_shape[2:])
    rank = len(kernel)
    if rank not in (1, 2) or (transposed and (auto_pad_of(attrs) != "NOTSET" or "output_shape" in attrs)):
        return None
    strides, dilations = tuple(attrs.get("strides", [1] * rank)), tuple(attrs.get("dilations", [1] * rank))
    pads = tuple(attrs.get("pads", [0] * 2 * rank))
    groups, upsample = int(attrs.get("group", 1)), ()
    k = int(np.prod(weight_shape[1:]))
    if transposed:   # the Conv over the input spread ``strides`` apart, padded by the kernel's reach
        extra = tuple(attrs.get("output_padding", [0] * rank))
        reach = [d * (n - 1) for d, n in zip(dilations, kernel)]
        pads = tuple(r - p for r, p in zip(reach, pads[:rank])) + tuple(
            r - p + e for r, p, e in zip(reach, pads[rank:], extra))
        upsample, strides = strides, (1,) * rank
        k = weight_shape[0] // groups * int(np.prod(kernel))
    if rank == 1:   # read as 2-D with height 1 (input_rows adds the axis)
        kernel, strides, dilations, pads = (1,) + kernel, (1,) + strides, (1,) + dilations, (0, pads[0], 0, pads[1])
        upsample = (1,) + upsample if upsample else ()
    return Geometry("conv", k, groups, kernel, strides, pads, dilations, auto_pad_of(attrs), upsample)


def input_rows(x: np.ndarray, geo: Geometry, rng: np.random.Generator, dtype=np.float32) -> np.ndarray:
    """[G, K, R] columns of ``x`` as the layer reads them (R rows: tokens or receptive fields), at
    most ROW_ELEMENTS / ROW_FLOPS worth, sampled without replacement when there are more; the float32
    values, as ``dtype`` (C order)."""
    return paired_rows([x], geo, rng, dtype=dtype)[0]


def paired_rows(arrays: list, geo: Geometry, rng: np.random.Generator, most: int = 0,
                dtype=np.float32) -> list[np.ndarray]:
    """input_rows of arrays of one shape (a layer's input in two models) at the same sampled rows
    (``most`` of them when given, whatever the multiply-adds)."""
    xs = [np.asarray(x, np.float32) for x in arrays]
    if geo.kind == "dense":
        rows = [x.reshape(-1, x.shape[-1]) for x in xs]
        pick = _pick(len(rows[0]), _row_budget(geo, None, most), rng)
        return [np.ascontiguousarray(r[pick].T, dtype=dtype)[None] for r in rows]
    if xs[0].ndim == 3:   # a 1-D conv (conv_geometry made it 2-D with height 1)
        xs = [x[:, :, None, :] for x in xs]
    if geo.upsample:
        xs = [_spread(x, geo.upsample) for x in xs]
    n, c, height, width = xs[0].shape
    begins, ends = conv_pads(geo.auto_pad, geo.pads, (height, width), geo.kernel, geo.strides, geo.dilations)
    kh, kw = geo.kernel
    span_h, span_w = _spans(geo)
    xps = [_padded(x, begins, ends) for x in xs]
    if xps[0].shape[2] < span_h or xps[0].shape[3] < span_w:
        return [np.zeros((geo.groups, geo.k, 0), dtype) for _ in xs]
    oh, ow = _out_sizes(xps[0].shape[2:], geo)
    pick = _pick(n * oh * ow, _row_budget(geo, c * kh * kw, most), rng)
    at = None
    if len(pick) < n * oh * ow:   # the (sample, y, x) of each row picked
        b, rest = np.divmod(pick, oh * ow)
        at = (b, *np.divmod(rest, ow))
    return [_fields(xp, geo, oh, ow, at, dtype) for xp in xps]


def _fields(xp: np.ndarray, geo: Geometry, oh: int, ow: int, at: tuple | None, dtype) -> np.ndarray:
    """[G, K, R] receptive fields of the padded ``xp`` [N, C, H, W] as ``dtype``: every one (``at``
    None, in sample, y, x order) or those at (sample, y, x) ``at``; one strided slice per kernel tap."""
    n, c = xp.shape[:2]
    g, (kh, kw), (sh, sw), (dh, dw) = geo.groups, geo.kernel, geo.strides, geo.dilations
    rows = n * oh * ow if at is None else len(at[0])
    out = np.empty((g, c // g, kh, kw, rows), dtype)
    every = out.reshape(g, c // g, kh, kw, n, oh, ow) if at is None else None
    for i in range(kh):
        for j in range(kw):
            tap = xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]   # [N, C, oh, ow]
            if at is None:
                every[:, :, i, j] = tap.reshape(n, g, c // g, oh, ow).transpose(1, 2, 0, 3, 4)
            else:
                out[:, :, i, j] = tap[at[0], :, at[1], at[2]].T.reshape(g, c // g, rows)
    return out.reshape(g, geo.k, rows)


def most_rows(shape, geo: Geometry) -> int:
    """The most rows input_rows takes from one array of ``shape`` (ints; None or a name: unknown,
    then the budget alone bounds them)."""
    budget = _row_budget(geo, None if geo.kind == "dense" else geo.k * geo.groups)
    if shape is None or not all(isinstance(d, (int, np.integer)) for d in shape):
        return budget
    if geo.kind == "dense":
        return min(budget, int(np.prod(shape[:-1])))
    sizes = [1, shape[-1]] if len(shape) == 3 else list(shape[2:])
    sizes = [(size - 1) * u + 1 for size, u in zip(sizes, geo.upsample)] if geo.upsample else sizes
    begins, ends = conv_pads(geo.auto_pad, geo.pads, tuple(sizes), geo.kernel, geo.strides, geo.dilations)
    return min(budget, int(shape[0]) * math.prod(_out_sizes([s + b + e for s, b, e in zip(sizes, begins, ends)], geo)))


def _out_sizes(padded, geo: Geometry) -> list[int]:
    """A conv's output positions on each spatial axis of an input ``padded`` to these sizes."""
    return [(p - span) // s + 1 if p >= span else 0 for p, span, s in zip(padded, _spans(geo), geo.strides)]


def _spans(geo: Geometry) -> tuple[int, int]:
    """How far a conv's receptive field reaches on each spatial axis."""
    return tuple(d * (k - 1) + 1 for d, k in zip(geo.dilations, geo.kernel))


def _spread(x: np.ndarray, upsample: tuple) -> np.ndarray:
    """[N, C, H, W] with ``upsample - 1`` zeros between neighbours (what a ConvTranspose convolves)."""
    n, c, h, w = x.shape
    out = np.zeros((n, c, (h - 1) * upsample[0] + 1, (w - 1) * upsample[1] + 1), x.dtype)
    out[:, :, ::upsample[0], ::upsample[1]] = x
    return out


def _padded(x: np.ndarray, begins, ends) -> np.ndarray:
    """``x`` zero-padded on its two spatial axes (negative pads crop)."""
    if not any(begins) and not any(ends):
        return x
    (top, left), (bottom, right) = ([max(p, 0) for p in pads] for pads in (begins, ends))
    out = np.zeros(x.shape[:2] + (x.shape[2] + top + bottom, x.shape[3] + left + right), x.dtype)
    out[:, :, top:top + x.shape[2], left:left + x.shape[3]] = x
    return out[:, :, max(-begins[0], 0):out.shape[2] - max(-ends[0], 0), max(-begins[1], 0):out.shape[3] - max(-ends[1], 0)]


def _row_budget(geo: Geometry, width: int | None = None, most: int = 0) -> int:
    """Rows to sample from one array: ``most`` (else as many as ROW_FLOPS allows), at most ROW_ELEMENTS worth."""
    width = width or geo.k
    budget = max(1, ROW_ELEMENTS // max(width, 1))
    return min(budget, most or max(1, ROW_FLOPS // max(geo.k * width, 1)))


def _pick(total: int, budget: int, rng: np.random.Generator) -> np.ndarray:
    if total <= budget:
        return np.arange(total)
    return np.sort(rng.choice(total, budget, replace=False))


class Hessian:
    """Running X^T X [G, K, K] and row count of one layer's input. With the float model's input X_r
    beside it (``update(x, reference)``, a quantized model's input), also X^T X_r, X_r^T X_r and
    X_r's mean row."""

    def __init__(self, geo: Geometry, seed: int, most: int = 0):
        self.geo, self.rng, self.most = geo, np.random.default_rng(seed), most   # most: rows per update (0: the budget)
        self.xtx = np.zeros((geo.groups, geo.k, geo.k))
        self.sum = np.zeros((geo.groups, geo.k))
        self.cross = self.ref_xtx = self.ref_sum = None
        self.rows = self.updates = 0
        self._pending: list = []   # paired rows not yet in the moments: products of larger blocks run faster

    def update(self, x: np.ndarray, reference: np.ndarray | None = None) -> None:
        self.updates += 1
        if reference is not None:
            cols, ref = paired_rows([x, reference], self.geo, self.rng, self.most)
            self._pending.append((cols, ref))
            self.rows += cols.shape[2]
            if sum(c.size for c, _ in self._pending) >= ROW_ELEMENTS:
                self._flush()
            return
        cols = input_rows(x, self.geo, self.rng, np.float64)   # float32 products' last digits: CPU's BLAS
        if self.geo.groups == 1:   # numpy's 2-D X X^T path: one triangle's products (BLAS syrk)
            self.xtx[0] += cols[0] @ cols[0].T
        else:
            self.xtx += cols @ cols.transpose(0, 2, 1)
        self.sum += cols.sum(axis=2, dtype=np.float64)
        self.rows += cols.shape[2]

    def _flush(self) -> None:
        """Add the pending paired rows to the moments."""
        if not self._pending:
            return
        # in float64: the last digits of float32 products differ between CPUs' BLAS kernels, and the
        # codes chosen from them did (the example model's conv2 under qemu Haswell)
        pending, self._pending = self._pending, []
        if self.cross is None:
            self.cross, self.ref_xtx, self.ref_sum = np.zeros_like(self.xtx), np.zeros_like(self.xtx), np.zeros_like(self.sum)
        if self.geo.groups == 1:   # 2-D products: X X^T through BLAS syrk (one triangle), X R^T without a copy
            c, r = (np.concatenate([p[i][0] for p in pending], axis=1, dtype=np.float64) for i in (0, 1))
            cols, ref = c[None], r[None]
            self.xtx[0] += c @ c.T
            self.cross[0] += c @ r.T
            self.ref_xtx[0] += r @ r.T
        else:
            cols, ref = (np.concatenate([p[i] for p in pending], axis=2, dtype=np.float64) for i in (0, 1))
            self.xtx += cols @ cols.transpose(0, 2, 1)
            self.cross += cols @ ref.transpose(0, 2, 1)
            self.ref_xtx += ref @ ref.transpose(0, 2, 1)
        self.sum += cols.sum(axis=2, dtype=np.float64)
        self.ref_sum += ref.sum(axis=2, dtype=np.float64)

    @property
    def h(self) -> np.ndarray:
        self._flush()
        return self.xtx / max(self.rows, 1)

    @property
    def mean(self) -> np.ndarray:
        """[G, K]: the mean input row."""
        self._flush()
        return self.sum / max(self.rows, 1)

    def moments(self, centered: bool, mix: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(E[x x^T], E[x x_r^T]) per group for inputs x that take each value of the quantized input
        with probability ``mix``, else the float one (QDrop; 1: the quantized input), less their means
        with ``centered`` (the loss left once a bias absorbs the mean output error). Without a
        reference: (X^T X, X^T X) / rows."""
        a, n = self.h, max(self.rows, 1)
        if self.cross is None:
            b = c = a
            mean = ref_mean = self.mean
        else:
            b, c = self.cross / n, self.ref_xtx / n
            ref_mean = self.ref_sum / n
            mean = ref_mean + mix * (self.mean - ref_mean)
        shift = b - c                                         # E[e x_r^T], e = x - x_r
        noise = a - b - b.transpose(0, 2, 1) + c              # E[e e^T]
        h = c + mix * (shift + shift.transpose(0, 2, 1)) + mix * mix * noise
        k = np.arange(h.shape[1])
        h[:, k, k] += (mix - mix * mix) * noise[:, k, k]      # a value meets itself: one draw
        cross = c + mix * shift
        if centered:
            h = h - mean[:, :, None] * mean[:, None, :]
            cross = cross - mean[:, :, None] * ref_mean[:, None, :]
        return h, cross

    def ref_mean(self) -> np.ndarray:
        """[G, K]: the reference's mean input row (the input's own without a reference)."""
        self._flush()
        return self.mean if self.ref_sum is None else self.ref_sum / max(self.rows, 1)

    def error_db(self, w: np.ndarray, new: np.ndarray, bias_shift: np.ndarray | None = None) -> float:
        """10 log10 E||new x + bias_shift - w x_r||^2 / E||w x_r||^2 over the rows seen: the output
        error of weights ``new`` [G, R, K] on these inputs against ``w`` on the reference's."""
        a, n = self.h, max(self.rows, 1)
        b, c = (a, a) if self.cross is None else (self.cross / n, self.ref_xtx / n)
        quad = lambda u, m, v: float(np.sum((u @ m) * v))   # noqa: E731  sum over rows of u M v^T
        signal = quad(w, c, w)
        err = quad(new, a, new) - 2 * quad(new, b, w) + signal
        if bias_shift is not None:
            s = bias_shift.reshape(new.shape[:2])
            err += 2 * np.sum(s * (np.einsum("grk,gk->gr", new, self.mean) - np.einsum("grk,gk->gr", w, self.ref_mean())))
            err += np.sum(s * s)
        return float(10 * np.log10(max(err, 1e-300) / max(signal, 1e-300)))


def damped(h: np.ndarray, damping: float) -> np.ndarray:
    """H [G, K, K] plus ``damping`` times the mean of each diagonal on the diagonal."""
    out = np.array(h, np.float64)
    k = out.shape[1]
    mean = np.maximum(np.diagonal(out, axis1=1, axis2=2).mean(axis=1), 1e-12)
    out[:, np.arange(k), np.arange(k)] += damping * mean[:, None]
    return out


def target(w: np.ndarray, h: np.ndarray, cross: np.ndarray, damping: float) -> np.ndarray:
    """T [G, R, K] minimising E||T x - W x_ref||^2 + damping * mean(diag H) * ||T - W||^2 for
    weights w [G, R, K], H = E[x x^T] and cross = E[x x_ref^T] per group."""
    hd = damped(h, damping)
    lam = (hd - h)[:, :1, :1]                     # the damping added, per group
    rhs = cross @ w.transpose(0, 2, 1) + lam * w.transpose(0, 2, 1)   # [G, K, R]
    return np.linalg.solve(hd, rhs).transpose(0, 2, 1)


def lower_inverse(lower: np.ndarray) -> np.ndarray:
    """The inverse of lower-triangular matrices [..., K, K], by 2 x 2 blocks (matrix products, no
    LU: np.linalg.inv's pivoted solve against the identity takes about 3 times as long at K = 576)."""
    k = lower.shape[-1]
    if k <= _LEAF:
        return np.linalg.inv(lower)
    m = k // 2
    a, c, d = lower[..., :m, :m], lower[..., m:, :m], lower[..., m:, m:]
    ai, di = lower_inverse(a), lower_inverse(d)
    out = np.zeros_like(lower)
    out[..., :m, :m], out[..., m:, m:] = ai, di
    out[..., m:, :m] = -(di @ (c @ ai))
    return out


def inverse_cholesky(h: np.ndarray, damping: float) -> np.ndarray:
    """U upper triangular with H^-1 = U^T U (after adding damping * mean(diag H) to the diagonal).

    With J the reversal, J H J = L L^T gives H = V V^T for V = J L J (upper), so U = V^-1 = J L^-1 J."""
    h = h[::-1, ::-1].copy()
    mean = max(float(np.mean(np.diag(h))), 1e-8)
    h[np.diag_indices_from(h)] += damping * mean
    for extra in (0.0, 1e-6, 1e-4, 1e-2):
        try:
            if extra:
                h[np.diag_indices_from(h)] += extra * mean
            return lower_inverse(np.linalg.cholesky(h))[::-1, ::-1].copy()
        except np.linalg.LinAlgError:
            continue
    raise np.linalg.LinAlgError("the Hessian is not positive definite even after damping")


def upper_inverse_cholesky(h: np.ndarray, damping: float) -> np.ndarray:
    """U [G, K, K] upper triangular with H^-1 = U^T U for each damped H [G, K, K] (batched; a matrix
    that is not positive definite goes through inverse_cholesky's one-at-a-time extra damping)."""
    try:
        lower = np.linalg.cholesky(damped(h[:, ::-1, ::-1], damping))
    except np.linalg.LinAlgError:
        return np.stack([inverse_cholesky(m, damping) for m in h])
    return lower_inverse(lower)[:, ::-1, ::-1].copy()


def round_codes(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, qmin, qmax,
                h: np.ndarray, damping: float, dead_to_zero: bool = True) -> np.ndarray:
    """Integer codes [G, R, K] for weights w [G, R, K] with per-row scale and zero point [G, R],
    clipped to [qmin, qmax] (integers, or code bounds per weight [G, R, K]), chosen column by column
    against H [G, K, K] (see module doc). An input whose diagonal in H is 0 gets the weight 0 (with
    ``dead_to_zero``), else its weight rounded to nearest."""
    w = np.array(w, np.float64)
    g, r, k = w.shape
    s, z = scale[..., None].astype(np.float64), zero[..., None].astype(np.float64)
    lo, hi = np.broadcast_to(qmin - z, w.shape), np.broadcast_to(qmax - z, w.shape)
    h = np.array(h, np.float64)
    dead = np.diagonal(h, axis1=1, axis2=2) <= 0              # inputs that were always 0
    gi, ki = np.nonzero(dead)
    h[gi, ki, ki] = 1.0
    if dead_to_zero:
        w[gi, :, ki] = 0.0
    u = upper_inverse_cholesky(h, damping)
    # column-major copies [K, G, R]: a column, and the columns after it, are contiguous blocks
    wt, codes = np.ascontiguousarray(w.transpose(2, 0, 1)), np.empty((k, g, r))
    lo_t, hi_t, st = lo.transpose(2, 0, 1), hi.transpose(2, 0, 1), s[..., 0]
    ut, diag = u.transpose(1, 2, 0)[..., None], np.diagonal(u, axis1=1, axis2=2)[..., None]   # ut[c, t]: u[:, c, t]
    err, spread, tmp = np.empty((BATCH, g, r)), np.empty((BATCH, g, r)), np.empty((g, r))
    for c1 in range(0, k, BATCH):
        c2 = min(c1 + BATCH, k)
        for c in range(c1, c2):
            col, q, e, later = wt[c], codes[c], err[c - c1], wt[c + 1:c2]
            np.divide(col, st, out=q)
            np.rint(q, out=q)
            np.clip(q, lo_t[c], hi_t[c], out=q)
            np.multiply(q, st, out=tmp)
            np.subtract(col, tmp, out=tmp)
            np.divide(tmp, diag[:, c], out=e)
            np.multiply(e, ut[c, c + 1:c2], out=spread[:len(later)])
            np.subtract(later, spread[:len(later)], out=later)
        if c2 < k:   # the same product, in the same layout, as on [G, R, K] rows
            wt[c2:] -= (np.ascontiguousarray(err[:c2 - c1].transpose(1, 2, 0)) @ u[:, c1:c2, c2:]).transpose(2, 0, 1)
    return np.ascontiguousarray(codes.transpose(1, 2, 0)) + z


def refine_codes(codes: np.ndarray, goal: np.ndarray, lo, hi, h: np.ndarray, sweeps: int) -> tuple[np.ndarray, int]:
    """Coordinate descent on (q - goal) H (q - goal)^T for each row q of integer ``codes`` [G, R, K]
    (``goal``: the target in code units; H [G, K, K]): each sweep moves every code, in turn, to its
    best value in [lo, hi] given the others, while that lowers the loss. Returns (codes, moves)."""
    q = np.array(codes, np.float64)
    lo, hi = np.broadcast_to(lo, q.shape), np.broadcast_to(hi, q.shape)
    grad = (q - goal) @ h                                      # H symmetric: d loss / dq, halved
    diag = np.diagonal(h, axis1=1, axis2=2)                    # [G, K]
    k, moves = q.shape[2], 0
    for _ in range(sweeps):
        before = moves
        for c1 in range(0, k, BATCH):                          # lazy: the rest of the row once per batch
            c2 = min(c1 + BATCH, k)
            steps = np.zeros(q.shape[:2] + (c2 - c1,))
            local = grad[:, :, c1:c2]
            for j in range(c2 - c1):
                c = c1 + j
                d = diag[:, None, c]
                with np.errstate(divide="ignore", invalid="ignore"):
                    step = np.where(d > 0, np.rint(-local[:, :, j] / d), 0.0)
                step = np.clip(step, lo[:, :, c] - q[:, :, c], hi[:, :, c] - q[:, :, c])
                step[step * (2 * local[:, :, j] + step * d) >= 0] = 0.0   # strictly lower loss only
                if step.any():
                    q[:, :, c] += step
                    local += step[:, :, None] * h[:, None, c, c1:c2]
                    steps[:, :, j] = step
                    moves += int(np.count_nonzero(step))
            grad[:, :, :c1] += steps @ h[:, c1:c2, :c1]
            grad[:, :, c2:] += steps @ h[:, c1:c2, c2:]
        if moves == before:
            break
    return q, moves
