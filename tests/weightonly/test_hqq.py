"""HQQ's in-place loop against the algorithm written plainly, on both of its paths."""
import numpy as np
import pytest

from qpasses.weightonly import hqq
from qpasses.weightonly.blocks import rows_of


def plain_hqq(weight, bits, block_size, integer_zero_points, iterations=hqq.ITERATIONS):
    """(scales, zero points) as the module docstring says: from the min-max start, shrink, zero update,
    per-block best, stop once an update gains less than MIN_GAIN (sums as hqq takes them)."""
    blocks = rows_of(weight, block_size)
    top, ones = 2 ** bits - 1, np.ones(block_size, np.float32)
    scales, zero = hqq.start(blocks, bits, integer_zero_points)   # the start is not what is checked here
    inv = (1 / scales)[..., None]
    scaled = blocks * inv
    beta, best_err, best_zero, total = hqq.BETA, None, zero, np.inf
    for _ in range(iterations + 1):
        codes = np.clip(np.rint(scaled + zero[..., None]), 0, top)
        u = scaled - codes + zero[..., None]
        err = (np.abs(u) @ ones) * scales
        better = np.ones(err.shape, bool) if best_err is None else err < best_err
        best_err, best_zero = np.where(better, err, best_err), np.where(better, zero, best_zero)
        if err.sum() > total * (1 - hqq.MIN_GAIN):
            break
        total = err.sum()
        residual = u * scales[..., None]
        ax = np.abs(residual)
        shrunk = np.sign(residual) * np.maximum(ax - np.power(np.maximum(ax, 1e-8), hqq.LP - 1) / beta, 0)
        zero = (codes - (scaled - shrunk * inv)) @ (ones / block_size)
        beta *= hqq.KAPPA
    if integer_zero_points:
        best_zero = np.clip(np.rint(best_zero), 0, top).astype(np.float32)
    return scales, best_zero, best_err


@pytest.mark.parametrize("spread", [0.02, 3.0])   # residuals all below the shrink threshold / many above
@pytest.mark.parametrize("integer_zero_points", [False, True])
def test_the_loop_computes_the_plain_algorithm(spread, integer_zero_points):
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((96, 40)) * spread).astype(np.float32)
    w[:, 3] *= 20   # an outlier column
    got = hqq.quantize_hqq(w, 4, 32, integer_zero_points)
    scales, zero, _ = plain_hqq(w, 4, 32, integer_zero_points)
    assert np.array_equal(got.scales, scales)
    assert np.allclose(np.asarray(got.zero_points, np.float32), zero, rtol=1e-6, atol=1e-6)


def test_no_block_ends_worse_than_its_min_max_zero_point():
    w = (np.random.default_rng(3).standard_normal((128, 24)) * 4).astype(np.float32)
    blocks = rows_of(w, 32)
    _, first, _ = plain_hqq(w, 4, 32, False, iterations=0)
    got = hqq.quantize_hqq(w, 4, 32, False)

    def error(zero):
        scales = np.asarray(got.scales, np.float32)[..., None]
        codes = np.clip(np.rint(blocks / scales + zero[..., None]), 0, 15)
        return np.abs(blocks - (codes - zero[..., None]) * scales).sum(axis=-1)

    assert np.all(error(np.asarray(got.zero_points, np.float32)) <= error(first) * (1 + 1e-5))
    assert np.mean(error(np.asarray(got.zero_points, np.float32))) < np.mean(error(first))
