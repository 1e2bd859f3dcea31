"""RTN without per-block weighting or clip search (the quantize-weights default), in fewer passes
over the weight: the same codes, scales and zero points as rtn.choose_params + rtn.centered_codes,
bit for bit (tests/test_weightonly_fastrtn.py).

Per chunk of blocks, in one reused float32 buffer: min, max; then per refit the codes (product,
rint, clip), the sums of squared codes and of w * q (einsum: no product array); then the final
codes. 4-bit codes can go straight to MatMulNBits' B: four codes make one exact float per 16-bit
word (c0 + 16 c1 + 256 c2 + 4096 c3, one matrix product), cast once and transposed as words.
"""
from __future__ import annotations

import functools

import numpy as np

from .blocks import Blocked, minmax_params


def applies(blocks: np.ndarray, bits: int) -> bool:
    """Sums of squared codes are integers below 2^24 (float32 holds them exactly in any order)."""
    return blocks.shape[1] * (2 ** bits - 1) ** 2 < 2 ** 24


@functools.lru_cache(maxsize=1)
def einsum_sums_in_order() -> bool:
    """Whether einsum's sum of products over the middle axis (N >= 2: the last axis runs inside, so
    both add the rows in order) is the product array summed over that axis, bit for bit (no fused
    multiply-add): then w * q needs no product array. With N = 1 both sum along one contiguous
    axis, each in its own order, so N = 1 never takes einsum."""
    rng = np.random.default_rng(0)
    for c, n in ((3, 64), (1, 3), (2, 2)):
        a = (rng.standard_normal((c, 32, n)) * np.exp(rng.uniform(-8, 8, (c, 32, n)))).astype(np.float32)
        b = rng.integers(-8, 8, (c, 32, n)).astype(np.float32)
        if not np.array_equal(np.einsum("abc,abc->ac", a, b), (a * b).sum(axis=1)):
            return False
    return True


def _centered_into(q, part, scales, zero_points, bits: int):
    """q = clip(rint(part / s), -z, 2^bits - 1 - z), as rtn.centered_codes computes it."""
    inverse = (1 / np.where(scales == 0, 1, scales)).astype(np.float32)[:, None, :]
    np.multiply(part, inverse, out=q)
    np.rint(q, out=q)
    top = 2 ** bits - 1
    if zero_points.size and np.all(zero_points == zero_points.flat[0]):
        z = float(zero_points.flat[0])
        np.clip(q, -z, top - z, out=q)
        return z
    zp = zero_points.astype(np.float32)[:, None, :]
    np.clip(q, -zp, top - zp, out=q)
    return zp


def _refit(q, part, scales, zero_points, bits: int):
    _centered_into(q, part, scales, zero_points, bits)
    den = np.einsum("abc,abc->ac", q, q)
    if q.shape[2] > 1 and einsum_sums_in_order():
        num = np.einsum("abc,abc->ac", part, q)
    else:
        num = np.multiply(part, q, out=q).sum(axis=1)
    ok = den > 0
    return np.where(ok, num / np.where(ok, den, 1), scales).astype(np.float32)


_WORD = np.array([1, 16, 256, 4096], np.float32)   # code i of four at bits 4i


def _words_into(out, q, z, tmp):
    """4-bit codes q + z [c, bs, N] -> little-endian 16-bit words [N, c, bs / 4] (first code lowest).
    The products and sums are integers below 2^16: exact in float32 in any order."""
    c, bs, n = q.shape
    np.matmul(_WORD, q.reshape(c, bs // 4, 4, n), out=tmp)
    tmp += np.multiply(z, 4369, dtype=np.float32) if isinstance(z, np.ndarray) else z * 4369   # z * 0x1111
    out[...] = tmp.transpose(2, 0, 1)


def quantize(blocks: np.ndarray, k: int, bits: int, symmetric: bool, refine: int, chunk: int,
             pack: bool = False) -> Blocked:
    """Blocks [n_blocks, bs, N] -> Blocked in W's layout (``pack``, 4 bits: B only, ``packed``)."""
    nb, bs, n = blocks.shape
    step = min(nb, max(1, chunk // (bs * n)))
    pack = pack and bits == 4 and bs % 4 == 0
    buf = np.empty((step, bs, n), np.float32)
    scales, zps = np.empty((nb, n), np.float32), np.empty((nb, n), np.float32)
    if pack:
        words, tmp = np.empty((n, nb, bs // 4), "<u2"), np.empty((step, bs // 4, n), np.float32)
    else:
        codes = np.empty(blocks.shape, np.uint8)
    for a in range(0, nb, step):
        part = blocks[a:a + step]
        q = buf[:len(part)]
        s, z = minmax_params(part, bits, symmetric, axis=1)
        for _ in range(refine):
            s = _refit(q, part, s, z, bits)
        zq = _centered_into(q, part, s, z, bits)
        if pack:
            _words_into(words[:, a:a + step], q, zq, tmp[:len(part)])
        else:
            q += zq
            codes[a:a + step] = q
        scales[a:a + step], zps[a:a + step] = s, z
    zero_points = np.ascontiguousarray(zps.T.astype(np.uint8))
    if pack:
        return Blocked(None, np.ascontiguousarray(scales.T), zero_points, k, bits, symmetric,
                       packed=words.view(np.uint8).reshape(n, nb, bs // 2))
    return Blocked(codes, np.ascontiguousarray(scales.T), zero_points, k, bits, symmetric, columns=True)
