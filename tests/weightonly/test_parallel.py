"""Speed work with the same bytes: weights on threads (results in order, bounded in flight), the
Hessian products, GPTQ on the weights sharing an input at once."""
import hashlib
import threading
import time

import numpy as np
import pytest

from qpasses.api import run_pipeline
from qpasses.executors import threads as parallel

from tests.passes.test_quantize_weights import mlp


def digest(proto, feeds, **wo):
    model, _ = run_pipeline(proto, config={"mode": "weight_only", "weight_only": wo}, calibration_data=feeds)
    return hashlib.sha256(model.to_proto(metadata=False).SerializeToString()).hexdigest()


@pytest.mark.parametrize("wo", [{"algorithm": "rtn", "format": "matmulnbits"}, {"algorithm": "rtn", "bits": 8},
                                {"algorithm": "gptq", "format": "matmulnbits"}, {"algorithm": "awq"},
                                {"algorithm": "hqq", "format": "matmulnbits"}, {"algorithm": "gptq", "scheme": "mxfp4"}])
def test_threads_give_the_same_bytes(wo, monkeypatch):
    proto, feeds = mlp(k=96, n=64, outliers=True, layernorm=True)
    monkeypatch.setattr(parallel, "THREADS", 1)
    one = digest(proto, feeds, **wo)
    monkeypatch.setattr(parallel, "THREADS", 3)
    assert digest(proto, feeds, **wo) == one


def test_in_order_keeps_order_and_bounds_the_jobs_in_flight(monkeypatch):
    monkeypatch.setattr(parallel, "THREADS", 2)
    lock, state = threading.Lock(), {"started": 0, "consumed": 0, "ahead": 0}

    def job(i):
        with lock:
            state["started"] += 1
            state["ahead"] = max(state["ahead"], state["started"] - state["consumed"])
        time.sleep(0.002 * (i % 3))
        return i

    out = []
    for value in parallel.in_order(list(range(12)), job):
        out.append(value)
        with lock:
            state["consumed"] += 1
    assert out == list(range(12))
    assert state["ahead"] <= 4   # threads + 1 submitted beyond the result being handed over


def test_one_thread_runs_inline(monkeypatch):
    monkeypatch.setattr(parallel, "THREADS", 1)
    names = list(parallel.in_order([1, 2], lambda _: threading.current_thread().name))
    assert names == [threading.current_thread().name] * 2


@pytest.mark.parametrize("shape", [(64, 3072), (128, 256), (7, 96)])
def test_hessian_gemm_is_numpys_syrk_within_float32_rounding(shape):
    """InputStats multiplies x.T by a copy of x (gemm: twice as fast as the syrk numpy picks for
    x.T @ x). Both sum n float32 products in float32, in the order the BLAS kernel of this CPU
    picks (the same bits with AVX-512 kernels, not with AVX2 ones): each lies within
    gamma_n * sum|products| of the exact sum, gamma_n = n*u / (1 - n*u), u = 2**-24 (Higham,
    Accuracy and Stability of Numerical Algorithms, 3.1), so they differ by at most twice that."""
    from qpasses.weightonly.hessian import InputStats

    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(shape).astype(np.float32) * np.float32(3) for _ in range(3)]
    st, want = InputStats(), np.zeros((shape[1], shape[1]))
    exact, magnitude = np.zeros_like(want), np.zeros_like(want)
    for x in xs:
        st.update(x)
        want += x.T @ x
        wide = x.astype(np.float64)
        exact += wide.T @ wide   # products of float32 values are exact in float64; sums of 3072 of them nearly
        magnitude += np.abs(wide).T @ np.abs(wide)
    u = 2.0**-24
    gamma = shape[0] * u / (1 - shape[0] * u)
    assert np.all(np.abs(st.xtx - exact) <= gamma * magnitude)
    assert np.all(np.abs(st.xtx - want) <= 2 * gamma * magnitude)


@pytest.mark.parametrize("symmetric, act_order, scheme", [(True, False, None), (False, True, None),
                                                          (True, True, "mxfp8_e4m3"), (True, False, "mxint8")])
def test_gptq_on_weights_sharing_an_input_is_gptq_on_each(symmetric, act_order, scheme):
    from qpasses.weightonly.gptq import quantize_gptq, quantize_gptq_shared
    from qpasses.weightonly.mx import ELEMENTS

    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, 80)).astype(np.float32)
    x[:, :2] *= 20
    h = (2.0 / len(x)) * (x.T.astype(np.float64) @ x)
    ws = [(rng.standard_normal((80, n)) * 0.05).astype(np.float32) for n in (48, 17, 64)]
    element = ELEMENTS.get(scheme)
    together = quantize_gptq_shared(ws, h, 4, 32, symmetric, 0.01, act_order, element=element)
    for w, got in zip(ws, together, strict=True):
        alone = quantize_gptq(w, h, 4, 32, symmetric, 0.01, act_order, element=element)
        np.testing.assert_array_equal(got.codes, alone.codes)
        np.testing.assert_array_equal(got.dequantize(), alone.dequantize())
        if element is None:
            np.testing.assert_array_equal(got.scales, alone.scales)
            np.testing.assert_array_equal(got.zero_points, alone.zero_points)


@pytest.mark.parametrize("cpus, busy, want", [(2, 0, 2), (2, 1, 1), (2, 5, 1), (8, 3, 4), (1, 0, 1)])
def test_threads_leave_the_busy_cpus_alone(monkeypatch, cpus, busy, want):
    monkeypatch.setattr(parallel, "THREADS", 0)
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda _: set(range(cpus)), raising=False)
    monkeypatch.setattr(parallel.os, "cpu_count", lambda: 8 if cpus == 8 else 2)
    monkeypatch.setattr(parallel, "others_running", lambda: busy)
    assert parallel.thread_count() == want
    assert parallel.thread_count(parallel.MIN_VALUES - 1) == 1


@pytest.mark.parametrize("loadavg, want", [("0.52 0.41 0.30 3/412 9876\n", 2), ("0.00 0.00 0.00 1/80 5\n", 0),
                                           ("0.00 0.00 0.00 0/80 5\n", 0), ("garbage\n", 0)])
def test_others_running_reads_the_runnable_count(monkeypatch, tmp_path, loadavg, want):
    fake = tmp_path / "loadavg"
    fake.write_text(loadavg)
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(fake if path == "/proc/loadavg" else path, *a, **k))
    assert parallel.others_running() == want
