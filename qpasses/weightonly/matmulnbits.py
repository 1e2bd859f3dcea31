"""Arrays of com.microsoft.MatMulNBits and of an opset-21 block-wise DequantizeLinear.

MatMulNBits (onnxruntime contrib op): Y = A @ dequant(B)^T with
  B            uint8 [N, n_blocks, block_size * bits / 8], codes along K packed low bits first;
  scales       [N * n_blocks], A's float type;
  zero_points  uint8 [N * ceil(n_blocks * bits / 8)] packed like B, one row of blocks per byte
               run (absent: 2^(bits-1)); or float [N * n_blocks] (not packed);
  attributes   K, N, bits, block_size (a power of two >= 16).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .blocks import Blocked


def pack_codes(codes: np.ndarray, bits: int, fill: int = 0) -> np.ndarray:
    """uint8 codes [..., m] -> bytes [..., m * bits / 8], the first code in the low bits (a last
    partial byte filled with ``fill``)."""
    if bits == 8:
        return np.ascontiguousarray(codes, np.uint8)
    per = 8 // bits
    m = codes.shape[-1]
    padded = np.full(codes.shape[:-1] + (-(-m // per) * per,), fill, np.uint8)
    padded[..., :m] = codes
    grouped = padded.reshape(codes.shape[:-1] + (-1, per)).astype(np.uint8)
    out = np.zeros(grouped.shape[:-1], np.uint8)
    for i in range(per):
        out |= grouped[..., i] << (bits * i)
    return out


def unpack_codes(packed: np.ndarray, bits: int, m: int) -> np.ndarray:
    """Inverse of pack_codes: bytes [..., b] -> codes [..., m]."""
    if bits == 8:
        return packed[..., :m]
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return np.stack(parts, axis=-1).reshape(packed.shape[:-1] + (-1,))[..., :m]


def pack_b(w: Blocked) -> np.ndarray:
    """MatMulNBits' B [N, n_blocks, block_size * bits / 8]. Codes in W's layout are packed into
    bytes, then 32-bit little-endian words along K, so only words (not single codes) are transposed."""
    if w.packed is not None:
        return w.packed
    if not w.columns:
        return pack_codes(w.codes, w.bits)
    nb, bs, n = w.codes.shape
    per = 8 // w.bits
    packed = w.codes[:, 0::per, :].copy()                   # [nb, bs * bits / 8, N] bytes
    for i in range(1, per):
        packed |= w.codes[:, i::per, :] << np.uint8(w.bits * i)
    grouped = packed.reshape(nb, -1, 4, n)
    words = grouped[:, :, 0, :].astype(np.uint32)
    for i in range(1, 4):
        words |= grouped[:, :, i, :].astype(np.uint32) << np.uint32(8 * i)
    rows = np.ascontiguousarray(words.astype("<u4", copy=False).transpose(2, 0, 1))
    return rows.view(np.uint8).reshape(n, nb, bs * w.bits // 8)


def nbits_inputs(w: Blocked, dtype=np.float32) -> dict[str, np.ndarray | None]:
    """B, scales and zero_points (None when symmetric: the op's default 2^(bits-1))."""
    zps = None
    if not w.symmetric or not w.integer_zero_points:
        if w.integer_zero_points:
            zps = pack_codes(w.zero_points.astype(np.uint8), w.bits, 2 ** (w.bits - 1)).reshape(-1)
        else:
            zps = w.zero_points.astype(dtype).reshape(-1)
    return {"B": pack_b(w), "scales": w.scales.astype(dtype, copy=False).reshape(-1), "zero_points": zps}


def nbits_attrs(w: Blocked, n: int) -> dict:
    return {"K": int(w.k), "N": int(n), "bits": int(w.bits), "block_size": int(w.block_size)}


def dq_inputs(w: Blocked, transposed: bool, dtype=np.float32) -> dict[str, np.ndarray | None]:
    """Codes, scale and zero point of a DequantizeLinear(axis, block_size) giving W [K, N]
    (``transposed``: W^T [N, K], axis 1). Symmetric: signed codes and no zero point."""
    if not w.integer_zero_points:
        raise ValueError("block-wise DequantizeLinear needs integer zero points")
    codes = w.kn_codes().T                                        # [N, K]
    zps = w.zero_points
    if w.symmetric:
        kind = ml_dtypes.int4 if w.bits == 4 else np.int8
        values, zero = (codes.astype(np.int16) - 2 ** (w.bits - 1)).astype(kind), None
    else:
        kind = ml_dtypes.uint4 if w.bits == 4 else np.uint8
        values, zero = codes.astype(kind), zps.astype(kind)
    scales = w.scales.astype(dtype)
    if not transposed:
        values, scales = values.T, scales.T
        zero = None if zero is None else zero.T
    return {"x": np.ascontiguousarray(values), "scale": np.ascontiguousarray(scales),
            "zero_point": None if zero is None else np.ascontiguousarray(zero)}
