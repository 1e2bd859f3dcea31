"""Round-to-nearest with a per-block range search: each block keeps, among a few shrunk ranges,
the one of least squared error (optionally weighted per input channel, as AWQ uses it)."""
from __future__ import annotations

import numpy as np

from .blocks import Blocked, minmax_params, pack, rows_of, squared_error

# range factors tried per block: 1.0 alone is plain min/max RTN (onnxruntime's)
SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8)


def choose_params(blocks: np.ndarray, bits: int, symmetric: bool, shrinks=SHRINKS, weights=None):
    """Per-block (scales, zero points) of least (weighted) squared error over ``shrinks``."""
    best_s, best_z = minmax_params(blocks, bits, symmetric, shrinks[0])
    best_e = squared_error(blocks, best_s, best_z, bits, weights)
    for shrink in shrinks[1:]:
        s, z = minmax_params(blocks, bits, symmetric, shrink)
        e = squared_error(blocks, s, z, bits, weights)
        better = e < best_e
        best_s, best_z, best_e = np.where(better, s, best_s), np.where(better, z, best_z), np.minimum(e, best_e)
    return best_s, best_z


def quantize_rtn(weight: np.ndarray, bits: int, block_size: int, symmetric: bool,
                 shrinks=SHRINKS, channel_weights=None) -> Blocked:
    """W [K, N] -> Blocked. ``channel_weights`` [K]: importance of each input channel in the error."""
    blocks = rows_of(weight, block_size)
    weights = None
    if channel_weights is not None:
        padded = np.zeros(blocks.shape[1] * block_size, np.float32)
        padded[:len(channel_weights)] = channel_weights
        weights = padded.reshape(1, blocks.shape[1], block_size)
    scales, zps = choose_params(blocks, bits, symmetric, shrinks, weights)
    return pack(blocks, scales, zps, weight.shape[0], bits, symmetric)
