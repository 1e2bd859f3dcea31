"""Per-input statistics GPTQ and AWQ read: X^T X and mean |x| per channel of every MatMul input,
streamed over the calibration data by the calibration runner (one float run, one sample at a time)."""
from __future__ import annotations

import numpy as np

from ..calibration.runner import collect_stats


class InputStats:
    """Running sum of X^T X (float64 [K, K]), of |x| per channel and the number of rows."""

    def __init__(self):
        self.xtx = None
        self.abs_sum = None
        self.rows = 0
        self.min, self.max = 0.0, 0.0   # the runner's test for body tensors that never ran

    def update(self, x, lo=None, hi=None) -> None:
        x = np.asarray(x, np.float32)
        x = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
        if self.xtx is None:
            self.xtx = np.zeros((x.shape[1], x.shape[1]), np.float64)
            self.abs_sum = np.zeros(x.shape[1], np.float64)
        # float32 products of one sample, summed in float64. x.T @ x would take numpy's syrk path,
        # twice as slow here as gemm on a copy (the same sums up to float32 rounding: tested)
        self.xtx += x.T @ x.copy()
        self.abs_sum += np.abs(x).sum(axis=0)
        self.rows += len(x)

    @property
    def hessian(self) -> np.ndarray:
        """H = 2 X^T X / rows (GPTQ's layer-wise Hessian, averaged over rows)."""
        return (2.0 / max(self.rows, 1)) * self.xtx

    @property
    def mean_abs(self) -> np.ndarray:
        return self.abs_sum / max(self.rows, 1)


def input_stats(model, data, names: set[str]) -> dict[str, InputStats]:
    """{tensor: InputStats} of ``names`` over every calibration sample."""
    stats, _ = collect_stats(model, data, only=set(names), collector=lambda name: InputStats())
    return {name: st for name, st in stats.items() if name in names and st.xtx is not None}
