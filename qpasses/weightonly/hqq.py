"""HQQ (half-quadratic quantization, no data): per block, the zero point is optimised for a sparse
(l_p, p < 1) reconstruction error by alternating a generalised soft-threshold of the residual and
a closed-form zero-point update, the scale fixed from the block's range."""
from __future__ import annotations

import numpy as np

from .blocks import Blocked, encode, minmax_params, rows_of

ITERATIONS, LP, BETA, KAPPA = 20, 0.7, 10.0, 1.01


def _shrink(x: np.ndarray, beta: float, p: float) -> np.ndarray:
    """Proximal step of |x|^p: sign(x) * max(|x| - |x|^(p-1) / beta, 0)."""
    ax = np.abs(x)
    return np.sign(x) * np.maximum(ax - np.power(np.maximum(ax, 1e-8), p - 1) / beta, 0)


def quantize_hqq(weight: np.ndarray, bits: int, block_size: int, integer_zero_points: bool,
                 iterations: int = ITERATIONS) -> Blocked:
    """W [K, N] -> Blocked, asymmetric. ``integer_zero_points``: rounded to the code range at the
    end (DequantizeLinear needs them; MatMulNBits takes float ones)."""
    blocks = rows_of(weight, block_size)
    top = 2 ** bits - 1
    if integer_zero_points:   # a zero point in the code range: the range must contain 0
        scales, zero = minmax_params(blocks, bits, symmetric=False)
    else:
        lo, hi = blocks.min(axis=-1), blocks.max(axis=-1)
        scales = ((hi - lo) / top).astype(np.float32)
        zero = -lo / np.where(scales == 0, 1, scales)
    scales = np.where(scales == 0, 1, scales).astype(np.float32)
    zero = zero.astype(np.float32)
    beta, best_err, best_zero = BETA, None, zero
    for _ in range(iterations):
        codes = np.clip(np.rint(blocks / scales[..., None] + zero[..., None]), 0, top)
        residual = _shrink(blocks - (codes - zero[..., None]) * scales[..., None], beta, LP)
        zero = np.mean(codes - (blocks - residual) / scales[..., None], axis=-1).astype(np.float32)
        beta *= KAPPA
        err = np.abs(blocks - (codes - zero[..., None]) * scales[..., None]).sum(axis=-1)
        if best_err is None:
            best_err, best_zero = err, zero
        else:
            better = err < best_err
            best_err, best_zero = np.where(better, err, best_err), np.where(better, zero, best_zero)
    zero = best_zero
    if integer_zero_points:
        zero = np.clip(np.rint(zero), 0, top).astype(np.float32)
    codes = encode(blocks, scales, zero, bits)
    zps = zero.astype(np.uint8) if integer_zero_points else zero
    return Blocked(codes, scales, zps, weight.shape[0], bits, symmetric=False)

