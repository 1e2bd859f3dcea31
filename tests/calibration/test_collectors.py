"""Streaming statistics and range finalisers: exact merging, percentiles, KL, MSE, degenerate data."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qpasses.calibration.collectors import (CHUNK, Histogram, TensorStats, entropy_range, finalise, kl_thresholds,
                                            minmax_range, mse_range, percentile_range)
from qpasses.quant.qparams import dequantize, quantize

SETTINGS = settings(deadline=None, derandomize=True, max_examples=60)
METHODS = ("minmax", "percentile", "entropy", "mse", "pow2")


@st.composite
def chunks(draw):
    """A few arrays of very different scales and offsets (forcing the histogram to grow)."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(1, 300))
        scale = 10.0 ** draw(st.integers(-6, 6))
        shift = draw(st.sampled_from([0.0, 1.0, -1.0])) * scale * draw(st.integers(0, 50))
        seed = draw(st.integers(0, 2**16))
        out.append((np.random.default_rng(seed).standard_normal(n) * scale + shift).astype(np.float32))
    return out


def _exact_counts(hist, values):
    idx = np.floor(values.astype(np.float64) / hist.width).astype(np.int64) - hist.offset
    return np.bincount(idx, minlength=hist.bins)


@SETTINGS
@given(chunks(), st.sampled_from([16, 64, 4096]))
def test_histogram_merging_is_exact(parts, bins):
    hist = Histogram(bins)
    for part in parts:
        hist.add(part)
    values = np.concatenate(parts)
    assert hist.total == values.size
    assert (hist.lo, hist.hi) == (values.min(), values.max())
    assert hist.counts.size == bins
    # every value is counted in the bin that brackets it on the final grid
    np.testing.assert_array_equal(hist.counts, _exact_counts(hist, values))
    # resolution is only lost as needed: the occupied span uses more than a quarter of the bins
    nz = np.flatnonzero(hist.counts)
    if hist.hi - hist.lo > 2.0 ** -90:
        assert nz[-1] - nz[0] + 1 > bins // 4 or hist.width <= max(abs(hist.lo), abs(hist.hi)) * 2.0**-21


@pytest.mark.parametrize("side", ["left", "right"])
def test_moments_index_is_searchsorted(side):
    """_Moments.index searches a window of the centres: the same indices as a search of them all."""
    from qpasses.calibration.collectors import _Moments

    rng = np.random.default_rng(1)
    centres = np.unique(np.round(rng.standard_normal(500), 2))
    m = _Moments(centres, np.ones(centres.size, np.int64))
    for cuts in (rng.uniform(-0.05, 0.05, (16, 16)), centres[200:260], -np.inf, np.inf, 0.0, [],
                 np.array([np.nan, 0.3, -1.0]), rng.uniform(-5, 5, 100)):
        np.testing.assert_array_equal(m.index(cuts, side), np.searchsorted(centres, cuts, side))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_arrays_are_counted_exactly(dtype):
    """Arrays of more than CHUNK values (counted a chunk at a time into the dense counts): every
    value in the bin that brackets it, denormals, zeros and values on bin edges included."""
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(3 * CHUNK + 5) * 3).astype(dtype)
    values[:100], values[100:200] = -1e-42 if dtype == np.float32 else -1e-300, 0.0
    values[200:300] = rng.integers(-700, 700, 100) * 2.0**-8   # on edges of the finer grids
    first = values[:CHUNK // 2] / 4   # a narrower range first: the grid grows when the rest arrive
    hist = Histogram(8192)
    hist.add(first)
    hist.add(values)
    both = np.concatenate([first, values])
    assert hist.total == both.size and hist.zeros == np.count_nonzero(both == 0) >= 200
    np.testing.assert_array_equal(hist.counts, _exact_counts(hist, both))


@SETTINGS
@given(chunks())
def test_abs_counts_fold_negative_bins(parts):
    hist = Histogram(256)
    for part in parts:
        hist.add(part)
    edges, counts = hist.abs_counts()
    a = np.abs(np.concatenate(parts)).astype(np.float64)
    assert counts.sum() == a.size and edges[-1] == a.max()
    exact = np.floor(a / hist.width).astype(np.int64)
    on_edge = (a / hist.width == exact) & (exact > 0)      # |x| on a bin edge from the negative side
    np.testing.assert_allclose(np.bincount(exact, minlength=counts.size)[:counts.size], counts,
                               atol=int(on_edge.sum()))


@SETTINGS
@given(st.integers(0, 2**16), st.sampled_from([90.0, 99.0, 99.9, 99.99, 100.0]), st.booleans())
def test_percentile_close_to_numpy(seed, p, symmetric):
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(4, 20000) * rng.uniform(0.01, 100) + rng.uniform(-5, 5)).astype(np.float32)
    stats = TensorStats(8192)
    for part in np.array_split(x, 7):
        stats.update(part)
    lo, hi = percentile_range(stats.hist, p, symmetric)
    w = stats.hist.width

    def near(value, data, q):
        """Within a bin width of the percentile (between the order statistics around it: in a gap
        between samples every value there is a q-th percentile)."""
        below, above = (np.percentile(data.astype(np.float64), q, method=m) for m in ("lower", "higher"))
        return below - w <= value <= above + w

    if symmetric:
        assert lo == -hi and near(hi, np.abs(x), p)
    else:
        cut = (100 - p) / 2   # two-sided: p % kept, as onnxruntime
        assert near(lo, x, cut) and near(hi, x, 100 - cut)
    assert stats.min <= lo <= hi <= stats.max or symmetric


def test_percentile_of_relu_output_keeps_zero_exact():
    x = np.maximum(np.random.default_rng(0).standard_normal(10000), 0).astype(np.float32)
    stats = TensorStats(256)
    stats.update(x)
    lo, hi = percentile_range(stats.hist, 99.9)
    assert lo == 0.0 and 0 < hi < x.max()
    assert percentile_range(stats.hist, 40.0, symmetric=True) == (0.0, 0.0)  # 50% of |x| are exact zeros


def _naive_kl(p, levels):
    """Straightforward per-candidate KL, as written in TensorRT's description (reference)."""
    out = []
    for i in range(levels, p.size + 1):
        ref = p[:i].copy()
        ref[-1] += p[i:].sum()
        cand = p[:i]
        q = np.zeros(i)
        for lv in range(levels):
            a, b = -(-lv * i // levels), -(-(lv + 1) * i // levels)
            nonzero = ref[a:b] > 0
            if nonzero.any():
                q[a:b][nonzero] = cand[a:b].sum() / nonzero.sum()
        pn, qn = ref / ref.sum(), q / q.sum()
        mask = pn > 0
        out.append(np.sum(pn[mask] * np.log(pn[mask] / np.maximum(qn[mask], 1e-12 * ref.sum() / q.sum()))))
    return np.array(out)


@SETTINGS
@given(st.integers(0, 2**16), st.sampled_from([4, 8]))
def test_vectorised_kl_matches_naive(seed, levels):
    rng = np.random.default_rng(seed)
    p = rng.integers(0, 5, 40).astype(np.float64) * (rng.random(40) < 0.7)
    p[0] += 1
    cand, kl = kl_thresholds(p, levels)
    np.testing.assert_array_equal(cand, np.arange(levels, 41))
    naive = _naive_kl(p, levels)
    finite = naive < 10
    np.testing.assert_allclose(kl[finite], naive[finite], rtol=1e-9, atol=1e-12)


def _heavy(seed, n=50000, one_sided=False):
    """Student-t with 2.5 degrees of freedom (heavy tails)."""
    x = np.random.default_rng(seed).standard_t(2.5, n).astype(np.float32)
    return np.maximum(x, 0) if one_sided else x


@pytest.mark.parametrize("one_sided", [False, True])
def test_entropy_is_not_minmax_on_heavy_tails(one_sided):
    stats = TensorStats(8192)
    stats.update(_heavy(1, one_sided=one_sided))
    lo, hi = entropy_range(stats.hist, 2048, 8)
    assert hi < 0.5 * stats.max
    assert lo == 0.0 if one_sided else lo > 0.5 * stats.min


def test_entropy_keeps_gaussian_mostly_unclipped_and_ignores_the_relu_spike():
    x = np.random.default_rng(0).standard_normal(200000).astype(np.float32)
    for data in (x, np.maximum(x, 0)):
        stats = TensorStats(8192)
        stats.update(data)
        lo, hi = entropy_range(stats.hist, 2048, 8)
        assert 3.0 < hi <= stats.max


def test_kl_of_a_candidate_with_nothing_inside_is_infinite():
    p = np.concatenate([np.zeros(10), np.full(10, 5.0)])
    cand, kl = kl_thresholds(p, 4)
    assert np.all(np.isinf(kl[cand <= 10])) and np.all(np.isfinite(kl[cand > 10]))


@pytest.mark.parametrize("values", [
    np.random.default_rng(0).uniform(0.13, 0.77, 100000),     # one side, away from 0 (HardSigmoid)
    -np.random.default_rng(1).uniform(0.65, 1.6, 100000),     # ... below 0
    np.random.default_rng(1).standard_t(2.5, 500),            # too few values for 2048 bins
], ids=["positive", "negative", "sparse"])
def test_entropy_keeps_the_observed_range_where_kl_cannot_judge(values):
    stats = TensorStats(8192)
    stats.update(values.astype(np.float32))
    assert entropy_range(stats.hist, 2048, 8) == (stats.hist.lo, stats.hist.hi)


def _quant_mse(x, lo, hi, bits=8):
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / (2**bits - 1)
    zp = int(round(-lo / scale))
    qt = "uint8" if bits == 8 else "uint16"
    return float(np.mean((dequantize(quantize(x, scale, zp, qt), scale, zp).astype(np.float64) - x) ** 2))


@settings(deadline=None, derandomize=True, max_examples=15)
@given(st.integers(0, 2**16), st.sampled_from(["laplace", "t4", "t2.5"]), st.booleans())
def test_mse_beats_minmax_on_heavy_tails(seed, dist, one_sided):
    rng = np.random.default_rng(seed)
    x = {"laplace": lambda: rng.laplace(size=100000), "t4": lambda: rng.standard_t(4, 100000),
         "t2.5": lambda: rng.standard_t(2.5, 100000)}[dist]().astype(np.float32)
    x = np.maximum(x, 0) if one_sided else x
    stats = TensorStats(8192)
    stats.update(x)
    lo, hi = mse_range(stats.hist, 8)
    assert stats.min <= lo <= hi <= stats.max
    ratio = _quant_mse(x, lo, hi) / _quant_mse(x, stats.min, stats.max)
    assert ratio < 1.0
    if dist != "t2.5" and not one_sided:  # clipping pays off clearly unless a few extremes dominate
        assert ratio < 0.9


def test_mse_keeps_isolated_extremes():
    """A few huge outliers cost more clipped than the rounding noise they add: no clipping."""
    x = np.concatenate([np.random.default_rng(0).uniform(-1, 1, 5000), [40.0, -40.0]]).astype(np.float32)
    stats = TensorStats(8192)
    stats.update(x)
    assert mse_range(stats.hist, 8) == pytest.approx((-40.0, 40.0), rel=0.02)


def test_mse_barely_clips_at_16_bits_and_symmetric_mode():
    x = _heavy(3)
    stats = TensorStats(8192)
    stats.update(x)
    lo8, hi8 = mse_range(stats.hist, 8)
    lo16, hi16 = mse_range(stats.hist, 16)
    assert hi16 > hi8 and lo16 < lo8
    lo, hi = mse_range(stats.hist, 8, symmetric=True)
    assert lo == -hi and 0 < hi < max(-stats.min, stats.max)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_mse_on_a_narrow_band_of_one_sign_gives_an_ordered_range(sign):
    """Values in [0.6233, 0.6255] at 4 bits: the best grid through 0 clips them all to a bound below
    the smallest; the range collapses onto that bound instead of coming out inverted."""
    x = sign * np.random.default_rng(0).uniform(0.6233, 0.6255, 64).astype(np.float32)
    stats = TensorStats(8192)
    stats.update(x)
    lo, hi = mse_range(stats.hist, 4)
    assert lo <= hi
    assert (lo == hi and 0 < hi <= stats.max) if sign > 0 else (lo == hi and stats.min <= lo < 0)


DEGENERATE = {
    "constant": [np.full(10, 3.5, np.float32)],
    "all zero": [np.zeros(100, np.float32), np.zeros(7, np.float32)],
    "single value": [np.array([-2.0], np.float32)],
    "empty": [np.zeros(0, np.float32)],
    "all nan": [np.full(4, np.nan, np.float32)],
    "inf and one value": [np.array([np.inf, -np.inf, 1.0], np.float32)],
    "huge": [np.array([3e38, 3e38], np.float32)],
    "tiny": [np.array([1e-40, 0], np.float32)],
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", list(DEGENERATE))
def test_degenerate_tensors_give_finite_ranges(case, method):
    stats = TensorStats(256, averaging_constant=0.01)
    for part in DEGENERATE[case]:
        stats.update(part)
    for symmetric in (False, True):
        lo, hi = finalise(method, stats, num_bins=64, symmetric=symmetric, moving_average=True)
        assert math.isfinite(lo) and math.isfinite(hi) and lo <= hi
    finite = np.concatenate(DEGENERATE[case])
    finite = finite[np.isfinite(finite)]
    if finite.size:
        assert stats.observed == (finite.min(), finite.max())
    else:
        assert stats.observed == (0.0, 0.0)


def test_moving_average_follows_onnxruntime_rule():
    stats = TensorStats(0, averaging_constant=0.5)
    for lo, hi in [(-1, 1), (-3, 5), (-1, 1)]:
        stats.update_range(lo, hi)
    assert stats.avg == [-1.5, 2.0]
    assert minmax_range(stats, moving_average=True) == (-1.5, 2.0)
    assert minmax_range(stats) == (-3.0, 5.0)
    assert minmax_range(stats, symmetric=True) == (-5.0, 5.0)


def test_histogram_memory_is_fixed():
    hist = Histogram(512)
    rng = np.random.default_rng(0)
    for i in range(50):
        hist.add((rng.standard_normal(1000) * 2.0**i).astype(np.float32))
    assert hist.counts.shape == (512,) and hist.total == 50000
