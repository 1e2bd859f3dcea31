"""OCP MX block formats on standard ops: 32 elements along K share one power-of-two scale (E8M0),
emitted as an opset-21 block-wise DequantizeLinear whose float scales are exact powers of two.

MXINT8: int8 elements (an implicit 2^-6 in the spec, folded into the DequantizeLinear scale);
MXFP8: float8 E4M3 / E5M2 elements; MXFP4: E2M1 values, stored as float8 E4M3 (which holds every
E2M1 value exactly) because onnxruntime 1.32 has no CPU kernel for float4e2m1 (DequantizeLinear or
Cast, opsets 23/24), nor for a float8e8m0 scale. As in the spec, a block's exponent is
floor(log2 amax) - emax (emax: the element's largest power of two), elements saturate and round to
nearest even; ``NEIGHBOURS`` also tries the exponents next to it and keeps the one of least
(optionally weighted) squared block error, the spec's on ties.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .blocks import columns_of

BLOCK = 32
NEIGHBOURS = (0, 1, -1)   # exponent offsets tried per block, the spec's (0) first
E8M0 = (-127, 127)        # the shared scale's exponent range


@dataclass(frozen=True)
class Element:
    scheme: str
    storage: type        # what the DequantizeLinear input holds
    emax: int            # exponent of the element's largest power of two
    maxval: float        # largest finite element (saturation)
    bits: int
    implicit: int = 0    # MXINT8: elements are code * 2^-6
    grid: type | None = None   # the values rounded to (default: storage)

    def round(self, v: np.ndarray) -> np.ndarray:
        """Nearest element values (ties to even, saturating), float32."""
        if self.storage is np.int8:
            return np.clip(np.rint(v), -self.maxval, self.maxval).astype(np.float32)
        return np.clip(v, -self.maxval, self.maxval).astype(self.grid or self.storage).astype(np.float32)


ELEMENTS = {e.scheme: e for e in (
    Element("mxint8", np.int8, 6, 127.0, 8, implicit=6),
    Element("mxfp8_e4m3", ml_dtypes.float8_e4m3fn, 8, 448.0, 8),
    Element("mxfp8_e5m2", ml_dtypes.float8_e5m2, 15, 57344.0, 8),
    Element("mxfp4", ml_dtypes.float8_e4m3fn, 2, 6.0, 4, grid=ml_dtypes.float4_e2m1fn),
)}


def exponent_bounds(element: Element, dtype) -> tuple[int, int]:
    """Exponents of the DequantizeLinear scale: E8M0's range (shifted by the implicit factor),
    within what ``dtype`` (the model's float type) holds as a power of two."""
    lo, hi = E8M0[0] - element.implicit, E8M0[1] - element.implicit
    if np.dtype(dtype) == np.float16:
        lo, hi = max(lo, -24), min(hi, 15)
    return lo, hi


def ocp_exponents(amax: np.ndarray, element: Element, bounds) -> np.ndarray:
    """floor(log2 amax) - emax per block (exact, from frexp); all-zero blocks get the lowest."""
    _, e = np.frexp(amax.astype(np.float32))
    x = np.where(amax > 0, e.astype(np.int32) - 1 - element.emax, bounds[0])
    return np.clip(x, *bounds).astype(np.int32)


def block_error(blocks, exps, element: Element, weights=None, axis: int = 1) -> np.ndarray:
    e = np.expand_dims(exps, axis)
    d = np.ldexp(element.round(np.ldexp(blocks, -e)), e) - blocks
    d *= d
    if weights is not None:
        d *= weights
    return d.sum(axis=axis)


def choose_exponents(blocks, element: Element, bounds, weights=None, axis: int = 1, neighbours=None):
    """Per block along ``axis``: the exponent among the spec's and its ``neighbours`` of least error."""
    base = ocp_exponents(np.abs(blocks).max(axis=axis), element, bounds)
    best, best_err = base, None
    for off in (NEIGHBOURS if neighbours is None else neighbours):
        exps = np.clip(base + off, *bounds).astype(np.int32)
        err = block_error(blocks, exps, element, weights, axis)
        if best_err is None:
            best, best_err = exps, err
            continue
        better = err < best_err
        best, best_err = np.where(better, exps, best), np.where(better, err, best_err)
    return best


@dataclass
class MXBlocked:
    """Elements [n_blocks, BLOCK, N] (storage type) and exponents [n_blocks, N] of W [K, N]."""

    codes: np.ndarray
    exponents: np.ndarray
    k: int
    element: Element
    symmetric: bool = True

    @property
    def block_size(self) -> int:
        return self.codes.shape[1]

    @property
    def n(self) -> int:
        return self.codes.shape[2]

    @property
    def bits(self) -> int:
        return self.element.bits

    def scales(self, dtype=np.float32) -> np.ndarray:
        return np.ldexp(np.ones(self.exponents.shape, np.float32), self.exponents).astype(dtype)

    def dequantize(self) -> np.ndarray:
        """W [K, N] float32, as the DequantizeLinear computes it."""
        w = self.codes.astype(np.float32) * self.scales()[:, None, :]
        return w.reshape(-1, self.n)[:self.k]

    def dq_arrays(self, transposed: bool, dtype=np.float32) -> dict:
        """DequantizeLinear(axis, block_size) inputs giving W [K, N] (W^T [N, K] if ``transposed``)."""
        x, scale = self.codes.reshape(-1, self.n)[:self.k], self.scales(dtype)
        if transposed:
            x, scale = x.T, scale.T
        return {"x": np.ascontiguousarray(x), "scale": np.ascontiguousarray(scale), "zero_point": None}


CHUNK = 1 << 20   # elements quantized at once (bounded temporaries)


def quantize_mx(weight: np.ndarray, scheme: str, dtype=np.float32, channel_weights=None,
                neighbours=None) -> MXBlocked:
    """W [K, N] -> MXBlocked; ``channel_weights`` [K] weigh each input channel's error (AWQ)."""
    element = ELEMENTS[scheme]
    bounds = exponent_bounds(element, dtype)
    blocks = columns_of(weight, BLOCK)                      # [n_blocks, BLOCK, N]
    nb, _, n = blocks.shape
    weights = None
    if channel_weights is not None:
        padded = np.zeros(nb * BLOCK, np.float32)
        padded[:len(channel_weights)] = channel_weights
        weights = padded.reshape(nb, BLOCK, 1)
    codes = np.empty(blocks.shape, element.storage)
    exps = np.empty((nb, n), np.int32)
    step = max(1, CHUNK // (BLOCK * n))
    for a in range(0, nb, step):
        part = blocks[a:a + step]
        e = choose_exponents(part, element, bounds, None if weights is None else weights[a:a + step],
                             neighbours=neighbours)
        codes[a:a + step] = element.round(np.ldexp(part, -e[:, None, :])).astype(element.storage)
        exps[a:a + step] = e
    return MXBlocked(codes, exps, weight.shape[0], element)
