"""GPTQ: quantize the input channels of W one at a time and spread each one's error over the
channels not yet quantized, weighted by the inverse Hessian H = 2 X^T X / n of the layer's input
(damped, optionally in order of decreasing diag(H)).

As in the GPTQ paper, the inverse enters only through U, the upper Cholesky factor of H^-1
(one Cholesky factorisation and one triangular inverse, by blocks), and updates are lazy: inside a
batch of COLUMNS channels each channel updates the rest of the batch, and the batch's errors reach
the later channels in one matrix product. Block parameters (scale, zero point) are chosen by
rtn.choose_params on the weights as they are when a block's first channel is reached; with
act_order they are fixed beforehand from the original weights (blocks stay contiguous along K, as
MatMulNBits and DequantizeLinear need). With an MX ``element`` the per-block parameter is a
power-of-two exponent (mx.choose_exponents) and each column rounds to the element grid."""
from __future__ import annotations

import numpy as np

from ..quant.rounding import inverse_cholesky
from .blocks import Blocked, rows_of
from .mx import Element, MXBlocked, choose_exponents, exponent_bounds
from .rtn import REFINE, choose_params

COLUMNS = 128


def _block(w1: np.ndarray, i: int, block_size: int) -> np.ndarray:
    """The block starting at column i, [N, 1, block_size], column-major: its sums then run in the
    order they always have (float32 sums depend on the layout), so the bytes do not change."""
    return np.asfortranarray(w1[:, None, i:i + block_size])


def quantize_gptq(weight: np.ndarray, hessian: np.ndarray, bits: int, block_size: int, symmetric: bool,
                  damping: float = 0.01, act_order: bool = True, refine: int = REFINE,
                  element: Element | None = None, dtype=np.float32) -> Blocked | MXBlocked:
    """W [K, N] and H [K, K] -> Blocked (MXBlocked with an MX ``element``)."""
    k, n = weight.shape
    blocks = rows_of(weight, block_size)                    # [N, nb, bs]
    nb = blocks.shape[1]
    kp = nb * block_size
    w = blocks.reshape(n, kp).copy()                        # rows: outputs, columns: inputs
    h = np.zeros((kp, kp), np.float64)
    h[:k, :k] = hessian
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(kp)
    # w[:, perm] comes out column-major: back to rows, or every rank-1 update below is strided (2-3x slower)
    w, h = np.ascontiguousarray(w[:, perm]), h[np.ix_(perm, perm)]
    u = inverse_cholesky(h, damping).astype(np.float32)
    scales = np.zeros((n, nb), np.float32)
    zeros = np.zeros((n, nb), np.float32)
    fixed = np.zeros(nb, bool)
    bounds = exponent_bounds(element, dtype) if element else None
    exps = np.zeros((n, nb), np.int32)
    if act_order:   # static block parameters from the original weights
        if element:
            exps = choose_exponents(blocks, element, bounds, axis=-1)
        else:
            scales, zeros = choose_params(blocks, bits, symmetric, refine)
        fixed[:] = True
    codes = np.zeros((n, kp), np.float32 if element else np.uint8)
    group = perm // block_size
    top = 2 ** bits - 1
    columns = max(COLUMNS, block_size)   # a lazy batch holds whole blocks
    for i1 in range(0, kp, columns):
        i2 = min(i1 + columns, kp)
        w1 = w[:, i1:i2]
        err1 = np.empty_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = group[i1 + i]
            col = w1[:, i]
            if element:
                if not fixed[g]:
                    exps[:, g], fixed[g] = choose_exponents(_block(w1, i, block_size), element, bounds,
                                                            axis=-1)[:, 0], True
                q = element.round(np.ldexp(col, -exps[:, g]))
                codes[:, perm[i1 + i]] = q
                e = (col - np.ldexp(q, exps[:, g])) / u1[i, i]
            else:
                if not fixed[g]:   # in order: the block's columns as GPTQ has updated them
                    s, z = choose_params(_block(w1, i, block_size), bits, symmetric, refine)
                    scales[:, g], zeros[:, g], fixed[g] = s[:, 0], z[:, 0], True
                s, z = scales[:, g], zeros[:, g]
                q = np.clip(np.rint(col / np.where(s == 0, 1, s)) + z, 0, top)
                codes[:, perm[i1 + i]] = q
                e = (col - (q - z) * s) / u1[i, i]
            w1[:, i + 1:] -= np.outer(e, u1[i, i + 1:])
            err1[:, i] = e
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    if element:
        return MXBlocked(np.ascontiguousarray(codes.T.astype(element.storage)).reshape(nb, block_size, n),
                         exps.T.copy(), k, element)
    return Blocked(codes.reshape(n, nb, block_size), scales, zeros.astype(np.uint8), k, bits, symmetric)


def quantize_gptq_shared(weights: list[np.ndarray], hessian: np.ndarray, bits: int, block_size: int,
                         symmetric: bool, damping: float = 0.01, act_order: bool = True,
                         element: Element | None = None, dtype=np.float32) -> list[Blocked | MXBlocked]:
    """Weights reading the same input (one Hessian) as one: their output channels side by side, so
    one factorisation and one column loop serve them all. Rows never mix in GPTQ, so each weight
    gets what quantize_gptq gives it alone."""
    if len(weights) == 1:
        return [quantize_gptq(weights[0], hessian, bits, block_size, symmetric, damping, act_order,
                              element=element, dtype=dtype)]
    together = quantize_gptq(np.concatenate(weights, axis=1), hessian, bits, block_size, symmetric, damping,
                             act_order, element=element, dtype=dtype)
    out, start = [], 0
    for w in weights:
        cols = slice(start, start + w.shape[1])
        start += w.shape[1]
        if element:
            out.append(MXBlocked(together.codes[..., cols].copy(), together.exponents[:, cols].copy(),
                                 together.k, element))
        else:
            out.append(Blocked(together.codes[cols].copy(), together.scales[cols].copy(),
                               together.zero_points[cols].copy(), together.k, bits, symmetric))
    return out
