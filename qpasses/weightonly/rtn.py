"""Round-to-nearest: each block starts from its min/max range (onnxruntime's RTN) and then refits
its scale by least squares on its own codes, w ~ s (q - z), and re-rounds. For fixed codes the
least-squares scale cannot raise a block's (optionally per-channel weighted) squared error, and
re-rounding on the new scale cannot either, so a refit is never worse than plain RTN.
Everything is vectorised over all blocks of a weight at once, in float32, in W's own layout."""
from __future__ import annotations

import numpy as np

from . import fastrtn
from .blocks import Blocked, columns_of, minmax_params

REFINE = 1   # least-squares refits per block; 0 is plain min/max RTN (onnxruntime's but at exact .5 ties)


def centered_codes(blocks: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, bits: int,
                   axis: int = -1) -> np.ndarray:
    """clip(rint(w / s), -z, 2^bits - 1 - z) as float32, blocks along ``axis`` (one buffer)."""
    inverse = np.expand_dims((1 / np.where(scales == 0, 1, scales)).astype(np.float32), axis)
    zp = np.expand_dims(zero_points.astype(np.float32), axis)
    q = blocks * inverse   # a product, not a quotient, as onnxruntime's kernel rounds
    np.rint(q, out=q)
    if zero_points.size and np.all(zero_points == zero_points.flat[0]):   # symmetric: one zero point
        z = float(zero_points.flat[0])
        return np.clip(q, -z, 2 ** bits - 1 - z, out=q)
    return np.clip(q, -zp, 2 ** bits - 1 - zp, out=q)


def refit_scales(blocks, scales, zero_points, bits: int, weights=None, axis: int = -1) -> np.ndarray:
    """The least-squares scale per block for the codes ``scales`` round to (zero points fixed)."""
    q = centered_codes(blocks, scales, zero_points, bits, axis)
    if weights is None and q.shape[axis] * (2 ** bits - 1) ** 2 < 2 ** 24:
        # sums of squared codes are integers float32 holds exactly in any order: einsum, no temporary;
        # then the products w * q overwrite q (the same products and sums as in a new array)
        sub = "abc"[:q.ndim]
        den = np.einsum(f"{sub},{sub}->{sub.replace(sub[axis], '')}", q, q)
        num = np.multiply(blocks, q, out=q).sum(axis=axis)
    else:
        qw = q if weights is None else q * weights
        num = np.multiply(blocks, qw).sum(axis=axis)
        den = np.multiply(q, qw, out=q).sum(axis=axis)
    ok = den > 0
    return np.where(ok, num / np.where(ok, den, 1), scales).astype(np.float32)


def choose_params(blocks: np.ndarray, bits: int, symmetric: bool, refine: int = REFINE, weights=None,
                  axis: int = -1):
    """Per-block (scales, zero points) along ``axis``: min/max, then ``refine`` least-squares refits."""
    scales, zps = minmax_params(blocks, bits, symmetric, axis=axis)
    for _ in range(refine):
        scales = refit_scales(blocks, scales, zps, bits, weights, axis)
    return scales, zps


CHUNK = 1 << 18   # elements of W quantized at once (blocks are independent): temporaries near L2's size


def quantize_rtn(weight: np.ndarray, bits: int, block_size: int, symmetric: bool,
                 refine: int = REFINE, channel_weights=None, clip_search: bool = False,
                 pack: bool = False) -> Blocked:
    """W [K, N] -> Blocked (codes in W's layout). ``channel_weights`` [K]: importance of each input
    channel in the error; ``clip_search``: ranges from search_clip instead of min/max. ``pack``:
    4-bit codes come as MatMulNBits' B only (fastrtn.py; the same codes, never unpacked here)."""
    blocks = columns_of(weight, block_size)                 # [n_blocks, block_size, N]
    if channel_weights is None and not clip_search and fastrtn.applies(blocks, bits):
        return fastrtn.quantize(blocks, weight.shape[0], bits, symmetric, refine, CHUNK, pack)
    weights = None
    if channel_weights is not None:
        padded = np.zeros(blocks.shape[0] * block_size, np.float32)
        padded[:len(channel_weights)] = channel_weights
        weights = padded.reshape(blocks.shape[0], block_size, 1)
    nb, _, n = blocks.shape
    codes = np.empty(blocks.shape, np.uint8)
    scales, zps = np.empty((nb, n), np.float32), np.empty((nb, n), np.float32)
    step = max(1, CHUNK // (block_size * n))
    for a in range(0, nb, step):
        part, w = blocks[a:a + step], None if weights is None else weights[a:a + step]
        if clip_search:
            s, z = search_clip(part, bits, symmetric, w, axis=1)
        else:
            s, z = choose_params(part, bits, symmetric, refine, w, axis=1)
        q = centered_codes(part, s, z, bits, axis=1)
        np.add(q, z[:, None, :], out=codes[a:a + step], casting="unsafe")
        scales[a:a + step], zps[a:a + step] = s, z
    return Blocked(codes, np.ascontiguousarray(scales.T), np.ascontiguousarray(zps.T.astype(np.uint8)),
                   weight.shape[0], bits, symmetric, columns=True)


CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)   # range factors searched by search_clip


def squared_error(blocks, scales, zero_points, bits: int, weights=None, axis: int = -1) -> np.ndarray:
    """Per-block (optionally weighted) squared error of rounding with these parameters."""
    q = centered_codes(blocks, scales, zero_points, bits, axis)
    q *= np.expand_dims(scales, axis)
    q -= blocks
    q *= q
    if weights is not None:
        q *= weights
    return q.sum(axis=axis)


def search_clip(blocks: np.ndarray, bits: int, symmetric: bool, weights=None, axis: int = -1, clips=CLIPS):
    """Per block, the clipped range (then one least-squares refit) of least weighted error."""
    best = None
    for clip in clips:
        s, z = minmax_params(blocks, bits, symmetric, clip, axis=axis)
        s = refit_scales(blocks, s, z, bits, weights, axis)
        e = squared_error(blocks, s, z, bits, weights, axis)
        if best is None:
            best = [s, z, e]
            continue
        better = e < best[2]
        best = [np.where(better, s, best[0]), np.where(better, z, best[1]), np.minimum(e, best[2])]
    return best[0], best[1]
