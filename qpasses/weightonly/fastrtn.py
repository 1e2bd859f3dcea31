"""RTN without per-block weighting or clip search (the quantize-weights default), in fewer passes
over the weight: the same codes, scales and zero points as rtn.choose_params + rtn.centered_codes,
bit for bit (tests/weightonly/test_fastrtn.py).

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


def _bounds(zero_points, bits: int):
    """Clip bounds of centred codes, -z and 2^bits - 1 - z: floats when the chunk has one zero
    point (always when symmetric), else [c, 1, N] arrays; and z in the same form."""
    top = 2 ** bits - 1
    if zero_points.size and np.all(zero_points == zero_points.flat[0]):
        z = float(zero_points.flat[0])
        return -z, top - z, z
    z = zero_points.astype(np.float32)[:, None, :]
    return -z, top - z, z


def _centered_into(q, part, scales, low, high):
    """q = clip(rint(part / s), low, high), as rtn.centered_codes computes it (a product with the
    reciprocal, not a quotient)."""
    np.multiply(part, np.divide(1, np.where(scales == 0, 1, scales))[:, None, :], out=q)
    np.rint(q, out=q)
    np.clip(q, low, high, out=q)


def _refit(q, part, scales, low, high):
    _centered_into(q, part, scales, low, high)
    den = np.einsum("abc,abc->ac", q, q)
    if q.shape[2] > 1 and einsum_sums_in_order():
        num = np.einsum("abc,abc->ac", part, q)
    else:
        num = np.multiply(part, q, out=q).sum(axis=1)
    refitted = scales.copy()   # a block whose codes are all 0 keeps its scale
    return np.divide(num, den, out=refitted, where=den > 0)


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
    scales = np.empty((nb, n), np.float32)
    zps = np.full((nb, n), 2 ** (bits - 1), np.float32) if symmetric else np.empty((nb, n), np.float32)
    if pack:
        words, tmp = np.empty((n, nb, bs // 4), "<u2"), np.empty((step, bs // 4, n), np.float32)
    else:
        codes = np.empty(blocks.shape, np.uint8)
    for a in range(0, nb, step):
        part = blocks[a:a + step]
        q = buf[:len(part)]
        if symmetric:   # blocks.minmax_params' symmetric scales, in fewer small steps
            lo, hi = part.min(axis=1), part.max(axis=1)
            s = np.where(-lo >= hi, lo, hi)
            s /= -(2 ** (bits - 1))
            zq = float(2 ** (bits - 1))
            low, high = -zq, 2 ** bits - 1 - zq
        else:
            s, z = minmax_params(part, bits, symmetric, axis=1)
            low, high, zq = _bounds(z, bits)
            zps[a:a + step] = z
        for _ in range(refine):
            s = _refit(q, part, s, low, high)
        _centered_into(q, part, s, low, high)
        if pack:
            _words_into(words[:, a:a + step], q, zq, tmp[:len(part)])
        else:
            q += zq
            codes[a:a + step] = q
        scales[a:a + step] = s
    zero_points = np.ascontiguousarray(zps.T.astype(np.uint8))
    if pack:
        return Blocked(None, np.ascontiguousarray(scales.T), zero_points, k, bits, symmetric,
                       packed=words.view(np.uint8).reshape(n, nb, bs // 2))
    return Blocked(codes, np.ascontiguousarray(scales.T), zero_points, k, bits, symmetric, columns=True)
