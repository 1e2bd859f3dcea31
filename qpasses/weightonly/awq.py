"""AWQ: per input channel scales s = mean|x|^alpha (normalised), shared by every weight reading the
same input; W becomes diag(s) W before quantization and the input is divided by s. alpha is chosen
per input on a grid by the output error tr(dW^T H dW) of all those weights together (H = X^T X of
the calibration data, so no activations are kept), and each block's range by the error weighted
with diag(H); at the chosen alpha each block then searches a clipped range (rtn.search_clip),
kept when the output error drops."""
from __future__ import annotations

import numpy as np

from .blocks import Blocked
from .rtn import quantize_rtn

ALPHAS = tuple(i / 10 for i in range(10))   # 0 (plain RTN) .. 0.9


def channel_scales(mean_abs: np.ndarray, alpha: float) -> np.ndarray:
    s = np.power(np.maximum(mean_abs, 1e-8), alpha)
    return (s / np.sqrt(s.max() * s.min())).astype(np.float32)


def output_error(weight: np.ndarray, approx: np.ndarray, hessian: np.ndarray) -> float:
    d = (approx - weight).astype(np.float64)
    return float(np.sum((hessian @ d) * d))


def search(weights: list[np.ndarray], hessian: np.ndarray, mean_abs: np.ndarray, bits: int,
           block_size: int, symmetric: bool, alphas=ALPHAS, quantize=None) -> tuple[np.ndarray, list[Blocked], float]:
    """(scales s [K], the weights diag(s) W quantized, alpha) of least summed output error.
    ``quantize(w, channel_weights)``: another block quantizer (MX), which has no clipped-range stage."""
    diag = np.diag(hessian).astype(np.float32)
    if quantize is None:
        def quantize(w, channel_weights):
            return quantize_rtn(w, bits, block_size, symmetric, channel_weights=channel_weights)
        clip_stage = True
    else:
        clip_stage = False
    best = None
    for alpha in alphas:
        s = channel_scales(mean_abs, alpha)
        importance = diag / (s * s)   # the error of diag(s) W's block, seen at the output
        quantized = [quantize(w * s[:, None], importance) for w in weights]
        err = sum(output_error(w, q.dequantize() / s[:, None], hessian) for w, q in zip(weights, quantized))
        if best is None or err < best[0]:
            best = (err, s, quantized, alpha)
    err, s, _, alpha = best   # then each block's clipped range at the chosen alpha
    if not clip_stage:
        return best[1], best[2], best[3]
    importance = diag / (s * s)
    clipped = [quantize_rtn(w * s[:, None], bits, block_size, symmetric, channel_weights=importance, clip_search=True)
               for w in weights]
    if sum(output_error(w, q.dequantize() / s[:, None], hessian) for w, q in zip(weights, clipped)) < err:
        best = (err, s, clipped, alpha)
    return best[1], best[2], best[3]
