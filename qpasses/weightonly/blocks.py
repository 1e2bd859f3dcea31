"""The blocked layout of a weight: codes [N, n_blocks, block_size] with a scale and zero point per block.

RTN computes in W's own layout ([n_blocks, block_size, N], ``columns``): no transpose of the float weight.

A MatMul weight W [K, N] is handled as its transpose W^T [N, K] (one row per output channel), K
zero-padded to a multiple of the block size; codes are unsigned (0 .. 2^bits - 1) and
``w ~ (code - zero_point) * scale``. A symmetric block has zero point 2^(bits-1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Blocked:
    codes: np.ndarray        # uint8 [N, n_blocks, block_size], or [n_blocks, block_size, N] if columns
    scales: np.ndarray       # float32 [N, n_blocks] (may be negative for symmetric blocks)
    zero_points: np.ndarray  # [N, n_blocks]: uint8 codes, or float32 (HQQ)
    k: int                   # unpadded K
    bits: int
    symmetric: bool
    columns: bool = False    # codes laid out along W [K, N] (as RTN computes them, no transpose)
    packed: np.ndarray | None = None   # 4-bit codes as MatMulNBits' B [N, n_blocks, bs / 2] (codes None)

    @property
    def block_size(self) -> int:
        if self.codes is None:
            return self.packed.shape[2] * 2
        return self.codes.shape[1 if self.columns else 2]

    @property
    def n(self) -> int:
        if self.codes is None:
            return self.packed.shape[0]
        return self.codes.shape[2 if self.columns else 0]

    @property
    def integer_zero_points(self) -> bool:
        return self.zero_points.dtype.kind in "iu"

    def rows(self) -> np.ndarray:
        """Codes [N, n_blocks, block_size]."""
        if self.codes is None:   # low nibble first
            return np.stack([self.packed & 15, self.packed >> 4], axis=-1).reshape(self.packed.shape[:2] + (-1,))
        return np.ascontiguousarray(self.codes.transpose(2, 0, 1)) if self.columns else self.codes

    def kn_codes(self) -> np.ndarray:
        """Codes [K, N] (W's own layout)."""
        if self.columns:
            return self.codes.reshape(-1, self.n)[:self.k]
        return self.rows().reshape(self.n, -1)[:, :self.k].T

    def dequantize(self) -> np.ndarray:
        """The weight as it will be computed, [K, N] float32."""
        codes = self.rows()
        w = (codes.astype(np.float32) - self.zero_points[..., None].astype(np.float32)) \
            * self.scales[..., None].astype(np.float32)
        return w.reshape(w.shape[0], -1)[:, :self.k].T


def columns_of(weight: np.ndarray, block_size: int) -> np.ndarray:
    """W [K, N] -> blocks [n_blocks, block_size, N] float32 (a view unless K needs zero padding)."""
    k, n = weight.shape
    w = np.asarray(weight, np.float32)
    blocks = -(-k // block_size)
    if blocks * block_size != k or not w.flags.c_contiguous:
        padded = np.zeros((blocks * block_size, n), np.float32)
        padded[:k] = w
        w = padded
    return w.reshape(blocks, block_size, n)


def rows_of(weight: np.ndarray, block_size: int) -> np.ndarray:
    """W [K, N] -> W^T blocks [N, n_blocks, block_size] float32 (K zero-padded)."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    rows = np.zeros((n, blocks * block_size), np.float32)
    rows[:, :k] = weight.T
    return rows.reshape(n, blocks, block_size)


def encode(blocks: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, bits: int) -> np.ndarray:
    """Round-to-nearest codes of ``blocks`` [..., bs] with per-block ``scales`` and ``zero_points`` [...]."""
    safe = np.where(scales == 0, 1, scales).astype(np.float32)[..., None]
    zp = zero_points[..., None].astype(np.float32)
    q = blocks / safe
    if zero_points.dtype.kind in "iu" or np.all(zp == np.rint(zp)):
        np.rint(q, out=q)
        q += zp
    else:
        q += zp
        np.rint(q, out=q)
    np.clip(q, 0, 2 ** bits - 1, out=q)
    return q.astype(np.uint8)


def decode(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray) -> np.ndarray:
    return (codes.astype(np.float32) - zero_points[..., None]) * scales[..., None]


def minmax_params(blocks: np.ndarray, bits: int, symmetric: bool, shrink=1.0, axis: int = -1):
    """Scales and zero points covering each block along ``axis`` (its range times ``shrink``).

    Symmetric: the value of largest magnitude maps to -2^(bits-1) (the scale carries its sign, so a
    block uses all 2^bits levels). Asymmetric: [min(lo, 0), max(hi, 0)] on 0 .. 2^bits - 1."""
    shrink = np.asarray(shrink, np.float32)
    if symmetric:
        lo, hi = blocks.min(axis=axis), blocks.max(axis=axis)
        extreme = np.where(-lo >= hi, lo, hi)   # of largest magnitude; a tie takes the negative, as onnxruntime
        scales = (extreme * shrink / -(2 ** (bits - 1))).astype(np.float32)
        return scales, np.full(scales.shape, 2 ** (bits - 1), np.float32)
    lo = np.minimum(blocks.min(axis=axis), 0) * shrink
    hi = np.maximum(blocks.max(axis=axis), 0) * shrink
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
