"""Streaming per-tensor statistics whose memory does not grow with the number of samples, and the
pure functions that turn them into a calibrated range.

``Histogram`` keeps ``bins`` integer counts on a grid anchored at 0 with a power-of-two bin width
``w``: bin ``k`` (absolute index) counts values in ``[k*w, (k+1)*w)``. When new values do not fit in
``bins`` bins, ``w`` doubles (adjacent absolute bins merge: ``k -> k >> 1``) as many times as needed
and the window slides; counts stay exact, only resolution is lost. Because ``w`` is a power of two,
``x / w`` is exact in floating point, and because the grid is anchored at 0 the histogram of ``|x|``
is exact too (bin ``-k-1`` mirrors onto bin ``k``).

Finalisers (``minmax_range``, ``percentile_range``, ``entropy_range``, ``mse_range``,
``pow2_range``) are pure functions of the statistics. A tensor that never held a finite value gets
the range (0, 0); a constant tensor gets (v, v).
"""
from __future__ import annotations

import math

import numpy as np

MIN_EXPONENT = -100       # bins are never narrower than 2**-100
SPARSE_BINS = 1024        # up to this many occupied bins are kept as (bin, count) pairs, not a dense array
INDEX_BITS = 22           # |x / w| < 2**22: bin indices are exact even in float32 arithmetic


def _ceil_log2(value: float) -> int:
    """Smallest e with 2**e >= value (value > 0)."""
    mantissa, exponent = math.frexp(value)
    return exponent - 1 if mantissa == 0.5 else exponent


class Histogram:
    """Exact counts on a growing power-of-two grid anchored at 0 (see the module docstring)."""

    def __init__(self, bins: int = 8192):
        self.bins = int(bins)
        # Sparse while few bins are occupied (small tensors; a dense array per tensor is 64 KB,
        # gigabytes for 100k-node graphs): sorted absolute bins and their counts. Else dense.
        self._dense: np.ndarray | None = None
        self._keys = self._vals = np.zeros(0, np.int64)
        self.exponent: int | None = None   # bin width = 2**exponent
        self.offset = 0                    # absolute index of counts[0]
        self.lo, self.hi = math.inf, -math.inf  # extremes of the values counted
        self.zeros = 0                     # exact zeros (quantized without error: 0 is on the grid)

    @property
    def width(self) -> float:
        return math.ldexp(1.0, self.exponent) if self.exponent is not None else 0.0

    @property
    def counts(self) -> np.ndarray:
        """Counts of the ``bins`` bins of the window starting at absolute bin ``offset``."""
        if self._dense is not None:
            return self._dense
        dense = np.zeros(self.bins, np.int64)
        dense[self._keys - self.offset] = self._vals
        return dense

    @property
    def total(self) -> int:
        return int((self._dense if self._dense is not None else self._vals).sum())

    def _index(self, value: float, exponent: int) -> int:
        return math.floor(math.ldexp(value, -exponent))

    def _exponent_for(self, lo: float, hi: float, start: int | None = None) -> int:
        amax = max(abs(lo), abs(hi))
        e = start if start is not None else MIN_EXPONENT if self.exponent is None else self.exponent
        if amax > 0:
            e = max(e, _ceil_log2(amax) - INDEX_BITS)
        if hi > lo:
            e = max(e, _ceil_log2((hi - lo) / (self.bins - 1)))
        while self._index(hi, e) - self._index(lo, e) >= self.bins:
            e += 1
        return e

    def add(self, x: np.ndarray, lo: float | None = None, hi: float | None = None) -> None:
        """Count the values of ``x`` (all finite; ``lo``/``hi`` are its min/max if known)."""
        if x.size == 0:
            return
        if x.dtype not in (np.float32, np.float64):
            x = x.astype(np.float32)
        flat = x.reshape(-1)
        x_lo = float(flat.min()) if lo is None else float(lo)
        x_hi = float(flat.max()) if hi is None else float(hi)
        lo, hi = min(x_lo, self.lo), max(x_hi, self.hi)
        e = self._exponent_for(lo, hi)
        k_lo, k_hi = self._index(lo, e), self._index(hi, e)
        self._regrid(e, k_lo, k_hi)
        self.lo, self.hi = lo, hi
        if x_lo <= 0.0 <= x_hi:
            self.zeros += int(np.count_nonzero(flat == 0))
        scale = flat.dtype.type(math.ldexp(1.0, -e))
        if self._dense is None and self._keys.size + flat.size <= 4 * SPARSE_BINS:
            # counted over the window [k_lo, k_hi] (fewer than ``bins`` bins), the bins held added in
            counts = _bin_counts(flat, scale, k_lo, k_hi - k_lo + 1)
            counts[self._keys - k_lo] += self._vals
            occupied = np.flatnonzero(counts)
            self._keys, self._vals = occupied + k_lo, counts[occupied]
            if self._keys.size > SPARSE_BINS:
                self._densify()
            return
        self._densify()
        self._dense += _bin_counts(flat, scale, self.offset, self.bins)

    def _densify(self) -> None:
        if self._dense is None:
            self._dense = self.counts
            self._keys = self._vals = np.zeros(0, np.int64)

    def _regrid(self, e: int, k_lo: int, k_hi: int) -> None:
        if self.exponent is None:
            self.exponent, self.offset = e, k_lo
            return
        shift = e - self.exponent
        if shift == 0 and self.offset <= k_lo and k_hi < self.offset + self.bins:
            return
        if self._dense is None:   # absolute bins: merge those that fall into one wider bin
            self._keys, self._vals = _merged(self._keys >> min(shift, 62), self._vals)
            self.exponent, self.offset = e, k_lo
            return
        occupied = np.flatnonzero(self.counts)
        absolute = (self.offset + occupied) >> min(shift, 62)   # arithmetic shift: floor division
        merged = np.zeros(self.bins, np.int64)
        np.add.at(merged, absolute - k_lo, self.counts[occupied])
        self._dense, self.exponent, self.offset = merged, e, k_lo

    # -- merging (sharded calibration, qpasses.executors) ----------------------------------------
    # The width needed for a range grows with it and a wider grid only merges whole bins, so the
    # grid is a function of the extremes alone: merging two histograms gives exactly the counts of
    # one histogram fed both samples' values, in any order.
    def merge(self, other: "Histogram") -> None:
        """Add ``other``'s counts (same ``bins``): as if its values had been added here."""
        if other.exponent is None:
            return
        lo, hi = min(self.lo, other.lo), max(self.hi, other.hi)
        start = other.exponent if self.exponent is None else max(self.exponent, other.exponent)
        e = self._exponent_for(lo, hi, start)
        parts = [h._absolute(e) for h in (self, other) if h.exponent is not None]
        keys, vals = _merged(np.concatenate([k for k, _ in parts]), np.concatenate([v for _, v in parts]))
        self.exponent, self.offset = e, self._index(lo, e)
        self.lo, self.hi, self.zeros = lo, hi, self.zeros + other.zeros
        if keys.size <= SPARSE_BINS:
            self._dense, self._keys, self._vals = None, keys, vals
        else:
            self._dense = np.zeros(self.bins, np.int64)
            self._dense[keys - self.offset] = vals
            self._keys = self._vals = np.zeros(0, np.int64)

    def _absolute(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(absolute bin, count) of the occupied bins on the grid of width 2**e (e >= exponent)."""
        if self._dense is None:
            keys, vals = self._keys, self._vals
        else:
            keys = np.flatnonzero(self._dense)
            keys, vals = self.offset + keys, self._dense[keys]
        return keys >> min(e - self.exponent, 62), vals

    # -- views for the finalisers --------------------------------------------------------------
    def occupied(self, zero_atom: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(edges, counts) over the occupied bins; the outer edges are the exact lo and hi. With
        ``zero_atom`` the exact zeros get their own zero-width bin [0, 0]."""
        nz = np.flatnonzero(self.counts)
        if nz.size == 0:
            return np.array([0.0, 0.0]), np.zeros(1, np.int64)
        first, last = int(nz[0]), int(nz[-1])
        counts = self.counts[first:last + 1]
        edges = (np.arange(first, last + 2, dtype=np.float64) + self.offset) * self.width
        edges[0], edges[-1] = self.lo, self.hi
        return self._split_zero(edges, counts, -self.offset - first) if zero_atom else (edges, counts)

    def abs_counts(self, zero_atom: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(edges, counts) of ``|x|`` from 0; the last edge is max|x|."""
        nz = np.flatnonzero(self.counts)
        if nz.size == 0:
            return np.array([0.0, 0.0]), np.zeros(1, np.int64)
        k = self.offset + nz
        mirrored = np.where(k >= 0, k, -k - 1)
        counts = np.zeros(int(mirrored.max()) + 1, np.int64)
        np.add.at(counts, mirrored, self.counts[nz])
        edges = np.arange(counts.size + 1, dtype=np.float64) * self.width
        edges[-1] = max(abs(self.lo), abs(self.hi))
        return self._split_zero(edges, counts, 0) if zero_atom else (edges, counts)

    def _split_zero(self, edges, counts, j: int):
        """Bin ``j`` starts at 0 (the grid is anchored there): move its exact zeros to a bin [0, 0]."""
        if not self.zeros or not 0 <= j < counts.size:
            return edges, counts
        counts = np.concatenate([counts[:j], [self.zeros, counts[j] - self.zeros], counts[j + 1:]])
        return np.insert(edges, j, 0.0), counts


CHUNK = 1 << 16   # values binned at once: the temporaries stay in the core's cache (ddddocr_det's
                  # calibrate: 3.3 -> 2.9 s of CPU on the thread counting, the same counts)


def _bin_counts(flat: np.ndarray, scale, start: int, size: int) -> np.ndarray:
    """Counts of the values x of ``flat`` per bin ``floor(x * scale) - start``, each in [0, size):
    ``scale`` is a power of two, so ``x * scale`` is exact, and so is the difference of two integers
    that is an integer in [0, size), even in float32."""
    counts = np.zeros(size, np.int64)
    buf = np.empty(min(flat.size, CHUNK), flat.dtype)
    index = np.empty(buf.size, np.int32)   # bincount counts int32 faster than intp (whose cast costs more)
    for i in range(0, flat.size, CHUNK):
        t, k = buf[:flat.size - i], index[:flat.size - i]
        np.multiply(flat[i:i + CHUNK], scale, out=t)
        np.floor(t, out=t)
        t -= start
        np.copyto(k, t, casting="unsafe")
        counts += np.bincount(k, minlength=size)
    return counts


def _merged(keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``keys`` with the sums of their ``vals``."""
    order = np.argsort(keys, kind="stable")
    keys, vals = keys[order], vals[order]
    starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    return keys[starts], (np.add.reduceat(vals, starts) if vals.size else vals)


class TensorStats:
    """Running statistics of one tensor: raw min/max, optional moving-average min/max (onnxruntime's
    rule: ``m += c * (new - m)`` per sample) and an optional Histogram."""

    def __init__(self, histogram_bins: int = 0, averaging_constant: float | None = None,
                 mergeable: bool = False):
        self.samples = 0
        self.min, self.max = math.inf, -math.inf
        self.avg: list[float] | None = None
        self.averaging_constant = averaging_constant
        self._hist = Histogram(histogram_bins) if histogram_bins else None
        self._pending: list[np.ndarray] = []   # values ``defer`` left for the histogram to count
        # mergeable: the moving average depends on the order of samples, so a shard keeps its
        # per-sample (min, max) for ``merge`` to replay after the shards before it
        self.ranges: list | None = [] if mergeable and averaging_constant is not None else None

    def update(self, x: np.ndarray, lo: float | None = None, hi: float | None = None) -> None:
        """Add one sample's values (non-finite values are ignored)."""
        x = np.asarray(x)
        if x.size and (lo is None or hi is None):
            lo, hi = x.min(), x.max()
        if x.size and not (math.isfinite(lo) and math.isfinite(hi)):
            x = x[np.isfinite(x)]
            lo, hi = (x.min(), x.max()) if x.size else (None, None)
        if x.size == 0 or lo is None:
            self.samples += 1
            return
        if self._hist is not None:
            self._hist.add(x, lo, hi)
        self.update_range(lo, hi)

    def defer(self, x: np.ndarray, lo: float, hi: float) -> int:
        """``update`` with ``x``'s min and max known, the histogram's counting left for later (it
        counts a batch of samples' values at once; the counts are the same, see Histogram.merge);
        returns the bytes held until then (0: counted now)."""
        if self._hist is None or not (math.isfinite(lo) and math.isfinite(hi)):
            self.update(x, lo, hi)
            return 0
        self._pending.append(np.array(x, dtype=np.float32 if x.dtype != np.float64 else x.dtype).reshape(-1))
        self.update_range(lo, hi)
        return self._pending[-1].nbytes

    def flush(self) -> None:
        """Count the values ``defer`` held."""
        if self._pending:
            values = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
            self._pending = []
            self._hist.add(values)

    @property
    def hist(self) -> Histogram | None:
        """The histogram of every value added (None without histogram bins)."""
        self.flush()
        return self._hist

    def update_range(self, lo: float, hi: float) -> None:
        """Add one sample known only by its min and max (ignored when not finite)."""
        self.samples += 1
        lo, hi = float(lo), float(hi)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        if self.averaging_constant is not None:
            self._average(lo, hi)

    def _average(self, lo: float, hi: float) -> None:
        if self.ranges is not None:
            self.ranges.append((lo, hi))
        if self.avg is None:
            self.avg = [lo, hi]
        else:
            c = self.averaging_constant
            self.avg = [self.avg[0] + c * (lo - self.avg[0]), self.avg[1] + c * (hi - self.avg[1])]

    def merge(self, other: "TensorStats") -> None:
        """Add the statistics of the samples that came after these (a later shard, ``mergeable``):
        the result is the one of a single run over both, in that order."""
        self.samples += other.samples
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        if self._hist is not None and other.hist is not None:
            self.hist.merge(other.hist)
        if self.averaging_constant is not None:
            for lo, hi in other.ranges or ():
                self._average(lo, hi)

    @property
    def observed(self) -> tuple[float, float]:
        """Raw extremes; (0, 0) when no finite value was seen."""
        return (self.min, self.max) if self.min <= self.max else (0.0, 0.0)


# -- finalisers -----------------------------------------------------------------------------------
def _symmetric(lo: float, hi: float) -> tuple[float, float]:
    m = max(abs(lo), abs(hi))
    return (-m, m)


def minmax_range(stats: TensorStats, symmetric: bool = False, moving_average: bool = False) -> tuple[float, float]:
    """The observed (or moving-average) min and max."""
    lo, hi = stats.observed
    if moving_average and stats.avg is not None:
        lo, hi = stats.avg
    return _symmetric(lo, hi) if symmetric else (lo, hi)


def pow2_range(stats: TensorStats, symmetric: bool = False) -> tuple[float, float]:
    """The raw min/max (never clips); compute-qparams makes the scale a power of two."""
    return minmax_range(stats, symmetric)


def _quantile(edges: np.ndarray, counts: np.ndarray, fraction: float) -> float:
    """Value below which ``fraction`` of the counts lie (values uniform inside a bin)."""
    cum = np.concatenate([[0], np.cumsum(counts)])
    target = fraction * cum[-1]
    j = int(np.clip(np.searchsorted(cum, target, side="left"), 1, counts.size))
    inside = (target - cum[j - 1]) / counts[j - 1] if counts[j - 1] else 0.0
    return float(edges[j - 1] + min(max(inside, 0.0), 1.0) * (edges[j] - edges[j - 1]))


def percentile_range(hist: Histogram, percentile: float, symmetric: bool = False) -> tuple[float, float]:
    """Asymmetric: p % of x kept, (100-p)/2 % cut on each side (onnxruntime's meaning of the same
    number). Symmetric: [-t, t], t = p-th percentile of |x|."""
    if hist.total == 0:
        return (0.0, 0.0)
    if symmetric:
        t = _quantile(*hist.abs_counts(zero_atom=True), percentile / 100.0)
        return (-t, t)
    edges, counts = hist.occupied(zero_atom=True)
    cut = (1.0 - percentile / 100.0) / 2
    lo = _quantile(edges, counts, cut)
    hi = _quantile(edges, counts, 1.0 - cut)
    return (min(lo, hi), max(lo, hi))


def _rebin(edges: np.ndarray, counts: np.ndarray, new_edges: np.ndarray) -> np.ndarray:
    """Counts on ``new_edges`` (values assumed uniform inside the old bins)."""
    cum = np.concatenate([[0.0], np.cumsum(counts, dtype=np.float64)])
    return np.diff(np.interp(new_edges, edges, cum))


def _xlogx(x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x, dtype=np.float64)
    pos = x > 0
    out[pos] = x[pos] * np.log(x[pos])
    return out


def kl_thresholds(p: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """KL(P_i || Q_i) for every candidate i in levels..len(p): P_i is ``p[:i]`` with the outliers
    ``p[i:]`` added to its last bin, Q_i is ``p[:i]`` merged into ``levels`` groups and spread back
    evenly over the non-empty bins of each group (TensorRT's scheme). Vectorised over candidates
    with prefix sums. Returns (candidates, kl)."""
    n = p.size
    cand = np.arange(levels, n + 1)
    S = np.concatenate([[0.0], np.cumsum(p)])
    Z = np.concatenate([[0], np.cumsum(p > 0)])
    PL = np.concatenate([[0.0], np.cumsum(_xlogx(p))])
    total = S[-1]
    outliers = total - S[cand]
    last = p[cand - 1]
    bounds = (np.arange(levels + 1)[None, :] * cand[:, None] + levels - 1) // levels   # (C, L+1)
    A = S[bounds[:, 1:]] - S[bounds[:, :-1]]              # level sums of p[:i]
    N = (Z[bounds[:, 1:]] - Z[bounds[:, :-1]]).astype(np.float64)
    N[:, -1] += (last == 0) & (outliers > 0)              # the last bin holds outliers
    eps = 1e-12 * total
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(A > 0, A / np.maximum(N, 1), 0.0)
        cross = np.where(A > 0, A * np.log(np.maximum(q, eps)), 0.0).sum(axis=1)
        cross += outliers * np.log(np.maximum(q[:, -1], eps))
    inside = S[cand]
    p_log_p = PL[cand - 1] + _xlogx(last + outliers) - _xlogx(np.asarray(total))
    q_norm = (inside + outliers) * np.log(np.maximum(inside, eps))
    kl = (p_log_p - (cross - q_norm)) / total
    return cand, np.where(inside > 0, kl, np.inf)   # nothing inside: Q is empty, not a perfect match


ENTROPY_MIN_VALUES = 4   # histogram values per bin below which KL is noise


def entropy_range(hist: Histogram, num_bins: int = 2048, bits: int = 8,
                  symmetric: bool = False) -> tuple[float, float]:
    """KL-divergence threshold (TensorRT style) on a ``num_bins`` histogram of |x| over [0, max|x|].

    Candidate thresholds are the upper edges of bins ``levels..num_bins``; ``levels`` is ``2**bits``
    for one-sided tensors (e.g. after ReLU) and ``2**(bits-1)`` for two-sided ones. The range is
    [-t, t] intersected with the observed range ([-t, t] when ``symmetric``). The observed range
    when KL cannot judge: ``levels`` not below ``num_bins`` (16-bit activations: no clipping is worth
    it), fewer than ``ENTROPY_MIN_VALUES`` values per bin (a squeeze-excitation tensor of 8 values
    per sample: KL of a sparse histogram clipped it to 7 % of its range), or every value on one side
    away from 0 (a HardSigmoid output in [0.13, 0.77]: the candidates below the smallest value look
    like perfect matches, and the range collapsed to a point).
    """
    if hist.total < ENTROPY_MIN_VALUES * num_bins or hist.hi <= hist.lo or hist.lo > 0 or hist.hi < 0:
        return _degenerate(hist, symmetric)
    lo, hi = hist.lo, hist.hi
    one_sided = lo >= 0 or hi <= 0
    levels = 2 ** bits if one_sided else 2 ** (bits - 1)
    amax = max(abs(lo), abs(hi))
    if levels >= num_bins:
        t = amax
    else:
        edges, counts = hist.abs_counts()
        p = _rebin(edges, counts, np.linspace(0.0, amax, num_bins + 1))
        p[0] -= min(hist.zeros, p[0])  # exact zeros (ReLU) quantize without error: their spike must not steer t
        cand, kl = kl_thresholds(p, levels)
        t = float(cand[int(np.argmin(kl))]) * amax / num_bins
    if symmetric:
        return (-t, t)
    return (min(max(lo, -t), hi), max(min(hi, t), lo))   # [-t, t] clipped to the observed range


def _degenerate(hist: Histogram, symmetric: bool) -> tuple[float, float]:
    lo, hi = (hist.lo, hist.hi) if hist.total else (0.0, 0.0)
    return _symmetric(lo, hi) if symmetric else (lo, hi)


class _Moments:
    """Prefix sums of n, n*v, n*v^2 over sorted bin centres: sums over value intervals in O(log n)."""

    def __init__(self, centres: np.ndarray, counts: np.ndarray):
        n = counts.astype(np.float64)
        self.centres = centres
        self.sums = np.zeros((3, n.size + 1))
        np.cumsum(np.stack([n, n * centres, n * centres**2]), axis=1, out=self.sums[:, 1:])

    def index(self, cuts, side: str = "left") -> np.ndarray:
        """``np.searchsorted(centres, cuts, side)``, searching only the centres between the cuts'
        extremes (those below all count for every cut, those above for none): the cuts near 0 that
        ``_expected_mse`` asks about span a few of thousands of bins."""
        cuts = np.asarray(cuts)
        low, high = (cuts.min(), cuts.max()) if cuts.size else (0.0, 0.0)
        if not low <= high:   # NaN
            return np.searchsorted(self.centres, cuts, side)
        a, b = np.searchsorted(self.centres, [low, high], side)
        return a + np.searchsorted(self.centres[a:b], cuts, side)

    def between(self, lo, hi, *ks: int):
        """Sum of n*v^k over lo <= v < hi (arrays broadcast), one array per k (a single k: the array)."""
        i, j = self.index(lo), self.index(hi)
        j = np.maximum(j, i)
        out = [self.sums[k][j] - self.sums[k][i] for k in ks]
        return out[0] if len(out) == 1 else out

    def below(self, cut, *ks: int):
        """Sums of n*v^k over v < cut, as ``between``."""
        return self.between(-np.inf, cut, *ks)

    def above(self, cut, *ks: int):
        """Sums of n*v^k over v > cut, as ``between``."""
        j = self.index(cut, "right")
        out = [self.sums[k][-1] - self.sums[k][j] for k in ks]
        return out[0] if len(out) == 1 else out


def _expected_mse(m: _Moments, lo, hi, step) -> np.ndarray:
    """Expected squared error of quantising to a grid of ``step`` through 0, clipped to [lo, hi]:
    clipped values lose (x - bound)^2; values within half a step of 0 round to 0 and lose x^2;
    every other value loses step^2/12 on average."""
    below, above = m.below(lo, 0, 1, 2), m.above(hi, 0, 1, 2)
    clip = (lo**2 * below[0] - 2 * lo * below[1] + below[2]
            + hi**2 * above[0] - 2 * hi * above[1] + above[2])
    near_lo, near_hi = np.maximum(lo, -step / 2), np.minimum(hi, step / 2)
    near_n, near_sq = m.between(near_lo, near_hi, 0, 2)
    inside = m.sums[0][-1] - below[0] - above[0]
    return np.maximum(clip, 0.0) + near_sq + (inside - near_n) * step**2 / 12


def mse_range(hist: Histogram, bits: int = 8, symmetric: bool = False, candidates: int = 256) -> tuple[float, float]:
    """The range minimising the expected quantisation MSE (``_expected_mse``) of a ``bits``-bit
    grid that contains 0, computed from the histogram.

    Asymmetric: every pair of candidate lower (in [lo, 0]) and upper (in [0, hi]) bounds is tried.
    Symmetric: candidate t in (0, max|x|], step 2t/(2**bits - 2).
    """
    if hist.total == 0 or hist.hi <= hist.lo:
        return _degenerate(hist, symmetric)
    steps = 2 ** bits - 1
    fractions = np.arange(1, candidates + 1) / candidates
    if symmetric:
        edges, counts = hist.abs_counts(zero_atom=True)
        m = _Moments(0.5 * (edges[:-1] + edges[1:]), counts)
        t = fractions * edges[-1]
        cost = _expected_mse(m, 0.0, t, 2 * t / (steps - 1))
        best = float(t[int(np.argmin(cost))])
        return (-best, best)
    edges, counts = hist.occupied(zero_atom=True)
    m = _Moments(0.5 * (edges[:-1] + edges[1:]), counts)
    lo, hi = hist.lo, hist.hi
    uppers = (fractions * hi if hi > 0 else np.zeros(1))[None, :]
    lowers = (fractions * lo if lo < 0 else np.zeros(1))[:, None]
    cost = _expected_mse(m, lowers, uppers, (uppers - lowers) / steps)
    i, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
    low, high = max(float(lowers[i, 0]), lo), min(float(uppers[0, j]), hi)
    if low > high:   # all of one sign, every value clipped onto the bound nearest 0: the range is that bound
        return (high, high) if lo > 0 else (low, low)
    return (low, high)


def finalise(method: str, stats: TensorStats, *, percentile: float = 99.999, num_bins: int = 2048,
             bits: int = 8, symmetric: bool = False, moving_average: bool = False) -> tuple[float, float]:
    """The calibrated range of one tensor for ``method`` (a config.CALIBRATION_METHODS name)."""
    if method == "minmax":
        return minmax_range(stats, symmetric, moving_average)
    if method == "pow2":
        return pow2_range(stats, symmetric)
    if stats.hist is None:
        raise ValueError(f"method '{method}' needs a histogram")
    if method == "percentile":
        return percentile_range(stats.hist, percentile, symmetric)
    if method == "entropy":
        return entropy_range(stats.hist, num_bins, bits, symmetric)
    if method == "mse":
        return mse_range(stats.hist, bits, symmetric)
    raise ValueError(f"unknown calibration method '{method}'")


HISTOGRAM_METHODS = frozenset({"percentile", "entropy", "mse"})


def histogram_bins(num_bins: int) -> int:
    """Internal resolution: 4x num_bins guarantees >= num_bins bins over [0, max|x|] after merging."""
    return 4 * int(num_bins)
