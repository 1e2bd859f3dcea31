"""Per-channel activation statistics and the SmoothQuant scale chosen by measured error (smooth-quant).

capture runs the float model once over a few calibration feeds with the activations of interest as
extra outputs; choose measures, for each migration strength alpha, the error of the layer's output
with per-tensor activations and per-channel weights fake-quantized in numpy, and keeps the best."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import helper

from ..calibration.data import model_inputs, open_data
from ..evaluation.evaluate import session
from ..ir.model import QModel


@dataclass
class ChannelStats:
    """Per input channel min, max and max |x| over the calibration feeds, and a sample of rows."""

    cmin: np.ndarray
    cmax: np.ndarray
    rows: np.ndarray      # [M, K]

    @property
    def amax(self) -> np.ndarray:
        return np.maximum(np.abs(self.cmin), np.abs(self.cmax))


def capture(model: QModel, tensors: dict[str, np.dtype], data, samples: int,
            max_rows: int) -> tuple[dict[str, ChannelStats], int]:
    """One float run over the first ``samples`` feeds with ``tensors`` (name -> dtype) as extra
    outputs, streaming: per channel (last axis) min/max and up to ``max_rows`` rows (evenly spaced
    in each feed) per tensor. Returns ({tensor: stats}, feeds read)."""
    proto = model.to_proto(metadata=False)
    inputs = {vi.name for vi in proto.graph.input}
    present = {vi.name for vi in proto.graph.output}
    names = list(tensors)
    for name, dtype in tensors.items():
        if name not in present and name not in inputs:
            proto.graph.output.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), None))
    sess = session(proto)
    fetch = [n for n in names if n not in inputs]
    per_feed = max(1, math.ceil(max_rows / max(samples, 1)))
    acc: dict[str, list] = {n: [None, None, []] for n in names}
    count = 0
    for feed in open_data(data).validated(model_inputs(proto), samples):
        values = dict(zip(fetch, sess.run(fetch, feed))) if fetch else {}
        for name in names:
            x = np.asarray(values[name] if name in values else feed[name], np.float32)
            x = x.reshape(-1, x.shape[-1])
            lo, hi = x.min(axis=0), x.max(axis=0)
            slot = acc[name]
            slot[0] = lo if slot[0] is None else np.minimum(slot[0], lo)
            slot[1] = hi if slot[1] is None else np.maximum(slot[1], hi)
            take = np.unique(np.linspace(0, len(x) - 1, min(per_feed, len(x))).round().astype(np.int64))
            slot[2].append(x[take])
        count += 1
    if not count:
        return {}, 0
    return {n: ChannelStats(lo, hi, np.concatenate(rows)[:max_rows]) for n, (lo, hi, rows) in acc.items()}, count


# -- plan: the scale of one group, by measured error -----------------------------------------------
def fake_quant_activation(x: np.ndarray, lo: float, hi: float, bits: int) -> np.ndarray:
    """Asymmetric per-tensor fake quantization of ``x`` on [min(lo, 0), max(hi, 0)]."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    levels = 2 ** bits - 1
    scale = (hi - lo) / levels if hi > lo else 1.0
    zp = np.round(-lo / scale)
    return ((np.clip(np.round(x / scale) + zp, 0, levels) - zp) * scale).astype(np.float32)


def fake_quant_weight(w: np.ndarray, bits: int, per_channel: bool) -> np.ndarray:
    """Symmetric fake quantization of a [K, N] weight, per output channel (N) or per tensor."""
    qmax = 2 ** (bits - 1) - 1
    amax = np.abs(w).max(axis=0, keepdims=True) if per_channel else np.abs(w).max(keepdims=True)
    scale = np.where(amax > 0, amax / qmax, 1.0)
    return (np.clip(np.round(w / scale), -qmax, qmax) * scale).astype(np.float32)


def smoothing_scale(amax: np.ndarray, wmax: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|x_j|^alpha / max|W_j|^(1-alpha) (zero ranges floored at 1e-5 of the largest)."""
    a = np.maximum(amax.astype(np.float64), 1e-5 * max(float(amax.max(initial=0.0)), 1e-30))
    w = np.maximum(wmax.astype(np.float64), 1e-5 * max(float(wmax.max(initial=0.0)), 1e-30))
    return np.clip(a ** alpha / w ** (1.0 - alpha), 1e-6, 1e6)


def layer_error(stats: ChannelStats, weights: list[np.ndarray], s: np.ndarray | None, *, activation_bits: int = 8,
                weight_bits: int = 8, per_channel: bool = True, refs: list[np.ndarray] | None = None) -> float:
    """Relative squared error sum ||Q(x/s) Q(s W) - x W||^2 / sum ||x W||^2 over the readers, on the
    sampled rows, with the activation range from the per-channel min/max of all feeds (``refs``:
    the float outputs x W, when already computed)."""
    x = stats.rows
    if s is None:
        xs, lo, hi = x, stats.cmin.min(), stats.cmax.max()
    else:
        xs, lo, hi = x / s.astype(np.float32), (stats.cmin / s).min(), (stats.cmax / s).max()
    xq = fake_quant_activation(xs, lo, hi, activation_bits)
    err = sig = 0.0
    for k, w in enumerate(weights):
        ws = w if s is None else (w.astype(np.float64) * s[:, None]).astype(np.float32)
        ref = refs[k] if refs is not None else x @ w
        got = xq @ fake_quant_weight(ws, weight_bits, per_channel)
        err += float(np.sum(np.square(got - ref, dtype=np.float64)))
        sig += float(np.sum(np.square(ref, dtype=np.float64)))
    return err / sig if sig > 0 else 0.0


@dataclass
class Choice:
    alpha: float | None          # None: leave the layer alone
    scale: np.ndarray | None
    errors: dict                 # alpha (or "none") -> relative error
    outlier_ratio: float


def outlier_ratio(amax: np.ndarray) -> float:
    """max_j max|x_j| / median_j max|x_j|: how far the largest channels stand above the rest."""
    median = float(np.median(amax))
    top = float(amax.max(initial=0.0))
    return top / median if median > 0 else (math.inf if top > 0 else 1.0)


def choose(stats: ChannelStats, weights: list[np.ndarray], alphas: list[float], *, min_ratio: float,
           min_gain_db: float, activation_bits: int = 8, weight_bits: int = 8, per_channel: bool = True) -> Choice:
    """The alpha of ``alphas`` whose smoothing gives the least measured error, when the activation
    has outlier channels (``outlier_ratio`` >= ``min_ratio``) and it beats no smoothing by
    ``min_gain_db`` dB; else no smoothing."""
    ratio = outlier_ratio(stats.amax)
    if ratio < min_ratio:
        return Choice(None, None, {}, ratio)
    kw = dict(activation_bits=activation_bits, weight_bits=weight_bits, per_channel=per_channel,
              refs=[stats.rows @ w for w in weights])
    errors = {"none": layer_error(stats, weights, None, **kw)}
    wmax = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
    best, best_scale = None, None
    for alpha in alphas:
        s = smoothing_scale(stats.amax, wmax, alpha)
        errors[alpha] = layer_error(stats, weights, s, **kw)
        if best is None or errors[alpha] < errors[best]:
            best, best_scale = alpha, s
    if best is None or not errors[best] < errors["none"] * 10 ** (-min_gain_db / 10):
        return Choice(None, None, errors, ratio)
    return Choice(best, best_scale, errors, ratio)


def rereadable(data) -> bool:
    """Whether reading the calibration data here leaves it whole for calibrate: not a one-shot
    iterator, not an onnxruntime-style reader without rewind() (CalibrationData.rereadable)."""
    return bool(getattr(data, "rereadable", True))
