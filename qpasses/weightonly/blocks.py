"""The blocked layout of a weight: codes [N, n_blocks, block_size] with a scale and zero point per block.

A MatMul weight W [K, N] is handled as its transpose W^T [N, K] (one row per output channel), K
zero-padded to a multiple of the block size; codes are unsigned (0 .. 2^bits - 1) and
``w ~ (code - zero_point) * scale``. A symmetric block has zero point 2^(bits-1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Blocked:
    codes: np.ndarray        # uint8 [N, n_blocks, block_size]
    scales: np.ndarray       # float32 [N, n_blocks] (may be negative for symmetric blocks)
    zero_points: np.ndarray  # [N, n_blocks]: uint8 codes, or float32 (HQQ)
    k: int                   # unpadded K
    bits: int
    symmetric: bool

    @property
    def block_size(self) -> int:
        return self.codes.shape[2]

    @property
    def integer_zero_points(self) -> bool:
        return self.zero_points.dtype.kind in "iu"

    def dequantize(self) -> np.ndarray:
        """The weight as it will be computed, [K, N] float32."""
        w = (self.codes.astype(np.float32) - self.zero_points[..., None].astype(np.float32)) \
            * self.scales[..., None].astype(np.float32)
        return w.reshape(w.shape[0], -1)[:, :self.k].T


def rows_of(weight: np.ndarray, block_size: int) -> np.ndarray:
    """W [K, N] -> W^T blocks [N, n_blocks, block_size] float32 (K zero-padded)."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    rows = np.zeros((n, blocks * block_size), np.float32)
    rows[:, :k] = weight.T
    return rows.reshape(n, blocks, block_size)


def encode(blocks: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, bits: int) -> np.ndarray:
    """Round-to-nearest codes of ``blocks`` [..., bs] with per-block ``scales`` and ``zero_points`` [...]."""
    safe = np.where(scales == 0, 1, scales)[..., None]
    zp = zero_points[..., None]
    q = np.rint(blocks / safe) + zp if zero_points.dtype.kind in "iu" or np.all(zp == np.rint(zp)) \
        else np.rint(blocks / safe + zp)
    return np.clip(q, 0, 2 ** bits - 1).astype(np.uint8)


def decode(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray) -> np.ndarray:
    return (codes.astype(np.float32) - zero_points[..., None]) * scales[..., None]


def minmax_params(blocks: np.ndarray, bits: int, symmetric: bool, shrink=1.0):
    """Scales and zero points [N, n_blocks] covering each block (its range times ``shrink``).

    Symmetric: the value of largest magnitude maps to -2^(bits-1) (the scale carries its sign, so a
    block uses all 2^bits levels). Asymmetric: [min(lo, 0), max(hi, 0)] on 0 .. 2^bits - 1."""
    shrink = np.asarray(shrink, np.float32)
    if symmetric:
        idx = np.abs(blocks).argmax(axis=-1)[..., None]
        extreme = np.take_along_axis(blocks, idx, axis=-1)[..., 0]
        scales = (extreme * shrink / -(2 ** (bits - 1))).astype(np.float32)
        return scales, np.full(scales.shape, 2 ** (bits - 1), np.float32)
    lo = np.minimum(blocks.min(axis=-1), 0) * shrink
    hi = np.maximum(blocks.max(axis=-1), 0) * shrink
    scales = ((hi - lo) / (2 ** bits - 1)).astype(np.float32)
    zps = np.clip(np.rint(-lo / np.where(scales == 0, 1, scales)), 0, 2 ** bits - 1).astype(np.float32)
    return scales, zps


def squared_error(blocks: np.ndarray, scales, zero_points, bits: int, weights=None) -> np.ndarray:
    """Per-block sum of (optionally ``weights``-weighted, [..., bs]) squared reconstruction error."""
    err = decode(encode(blocks, scales, zero_points, bits), scales, zero_points) - blocks
    err *= err
    if weights is not None:
        err *= weights
    return err.sum(axis=-1)


def pack(blocks: np.ndarray, scales, zero_points, k: int, bits: int, symmetric: bool) -> Blocked:
    """The Blocked weight for chosen parameters (integer zero points stored as uint8)."""
    codes = encode(blocks, scales, zero_points, bits)
    zps = zero_points.astype(np.uint8) if np.all(zero_points == np.rint(zero_points)) else zero_points.astype(np.float32)
    return Blocked(codes, scales.astype(np.float32), zps, k, bits, symmetric)
