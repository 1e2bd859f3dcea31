"""GPTQ: quantize the input channels of W one at a time and spread each one's error over the
channels not yet quantized, weighted by the inverse Hessian H = 2 X^T X / n of the layer's input
(damped, optionally in order of decreasing diag(H), in lazy batches of COLUMNS channels).

Block parameters (scale, zero point) are chosen by rtn.choose_params on the weights as they are
when a block's first channel is reached; with act_order they are fixed beforehand from the
original weights (blocks stay contiguous along K, as MatMulNBits and DequantizeLinear need)."""
from __future__ import annotations

import numpy as np

from .blocks import Blocked, encode, rows_of
from .rtn import SHRINKS, choose_params

COLUMNS = 128


def _inverse_cholesky(h: np.ndarray, damping: float) -> np.ndarray:
    """Upper Cholesky factor of H^-1 (after adding damping * mean(diag H) to the diagonal)."""
    h = h.copy()
    h[np.diag_indices_from(h)] += damping * max(float(np.mean(np.diag(h))), 1e-8)
    for extra in (0.0, 1e-6, 1e-4, 1e-2):
        try:
            if extra:
                h[np.diag_indices_from(h)] += extra * float(np.mean(np.diag(h)))
            lower = np.linalg.cholesky(h)
            inv = np.linalg.inv(lower)
            return np.linalg.cholesky(inv.T @ inv).T
        except np.linalg.LinAlgError:
            continue
    raise np.linalg.LinAlgError("the Hessian is not positive definite even after damping")


def quantize_gptq(weight: np.ndarray, hessian: np.ndarray, bits: int, block_size: int, symmetric: bool,
                  damping: float = 0.01, act_order: bool = True, shrinks=SHRINKS) -> Blocked:
    """W [K, N] and H [K, K] -> Blocked."""
    k, n = weight.shape
    blocks = rows_of(weight, block_size)                    # [N, nb, bs]
    nb = blocks.shape[1]
    kp = nb * block_size
    w = blocks.reshape(n, kp).astype(np.float64)            # rows: outputs, columns: inputs
    h = np.zeros((kp, kp), np.float64)
    h[:k, :k] = hessian
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(kp)
    w, h = w[:, perm], h[np.ix_(perm, perm)]
    u = _inverse_cholesky(h, damping)
    scales = np.zeros((n, nb), np.float32)
    zeros = np.zeros((n, nb), np.float32)
    fixed = np.zeros(nb, bool)
    if act_order:   # static block parameters from the original weights
        scales, zeros = choose_params(blocks, bits, symmetric, shrinks)
        fixed[:] = True
    codes = np.zeros((n, kp), np.uint8)
    group = perm // block_size
    columns = max(COLUMNS, block_size)   # a lazy batch holds whole blocks
    for i1 in range(0, kp, columns):
        i2 = min(i1 + columns, kp)
        w1 = w[:, i1:i2].copy()
        err1 = np.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = group[i1 + i]
            if not fixed[g]:   # in order: the block's columns as GPTQ has updated them
                cols = w1[:, i:i + block_size].astype(np.float32)[:, None, :]
                s, z = choose_params(cols, bits, symmetric, shrinks)
                scales[:, g], zeros[:, g], fixed[g] = s[:, 0], z[:, 0], True
            col = w1[:, i]
            q = encode(col[:, None].astype(np.float32), scales[:, g], zeros[:, g], bits)[:, 0]
            codes[:, perm[i1 + i]] = q
            deq = (q.astype(np.float64) - zeros[:, g]) * scales[:, g]
            e = (col - deq) / u1[i, i]
            w1[:, i:] -= np.outer(e, u1[i, i:])
            err1[:, i] = e
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    return Blocked(codes.reshape(n, nb, block_size), scales, zeros.astype(np.uint8), k, bits, symmetric)
