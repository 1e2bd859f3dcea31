"""Calibrated ranges: statistics collected in one process (runner.py) or over shards of the data
(sharded.py), then finalised by the range method (collectors.py)."""
from __future__ import annotations

import math
from functools import partial

from ..ir.model import QModel
from .collectors import finalise
from .kept import KeptSamples
from .runner import collect_stats
from .sharded import sharded_stats

# Ranges are kept to this many significant bits, rounded outward. onnxruntime's float kernels differ
# in the last bits from CPU to CPU (AVX2 and AVX-512 sum in other orders), and the ranges would carry
# that into every scale and every decision taken from them: at 12 bits two CPUs 2 ulps apart round
# alike but for 1 range in 1,000, and a range widens by at most 2**-12 (1/16 of an 8-bit step).
RANGE_BITS = 12


def calibrate_ranges(model: QModel, data, *, method: str = "minmax", percentile: float = 99.999,
                     num_bins: int = 2048, bits: int = 8, symmetric: bool = False,
                     moving_average: bool = False, averaging_constant: float = 0.01,
                     max_samples: int = 0, progress_stream=None, only: set[str] | None = None,
                     kept: KeptSamples | None = None, executor=None):
    """Collect statistics and finalise them: returns (ranges, observed, samples), both dicts of
    tensor name -> (float, float) in graph order (``kept``: see collect_stats). A parallel
    ``executor`` (qpasses.executors) collects them over shards of the data, with the same result."""
    collect = collect_stats
    if executor is not None and executor.parallel:
        collect = partial(sharded_stats, executor)
    stats, samples = collect(model, data, method=method, num_bins=num_bins,
                                   averaging_constant=averaging_constant if moving_average else None,
                                   max_samples=max_samples, progress_stream=progress_stream, only=only,
                                   kept=kept)
    ranges, observed = {}, {}
    for name, st in stats.items():
        lo, hi = finalise(method, st, percentile=percentile, num_bins=num_bins, bits=bits,
                          symmetric=symmetric, moving_average=moving_average)
        ranges[name] = outward(_finite(lo), _finite(hi))
        observed[name] = outward(*(float(v) for v in st.observed))
    return ranges, observed, samples


def outward(lo: float, hi: float, bits: int = RANGE_BITS) -> tuple[float, float]:
    """(lo, hi) rounded outward to ``bits`` significant bits (a non-finite end is left as it is)."""
    def rounded(value: float, up: bool) -> float:
        if not math.isfinite(value) or value == 0.0:
            return value
        mantissa, exponent = math.frexp(value)
        step = (math.ceil if up else math.floor)(mantissa * 2.0**bits)
        return math.ldexp(step, exponent - bits)
    return rounded(lo, False), rounded(hi, True)


def _finite(value) -> float:
    value = float(value)
    return value if math.isfinite(value) else 0.0
