"""The same model, data and config give the same bytes on every x86-64 CPU.

Candidates are judged in onnxruntime's QDQ simulation (evaluate.judging_session: Q/DQ as written,
float arithmetic), not in the int8 kernels of the quantizing CPU (without VNNI, U8S8 pair sums
saturate in int16: judged there, the mask model below promotes 's' and the example scores 31.8 dB
instead of 44.4); calibrated ranges keep RANGE_BITS significant bits, so the last bits in which
AVX2 and AVX-512 float kernels differ do not reach a scale.

The hashes were computed on a CPU with AVX-512 VNNI and are the same under ``qemu-x86_64 -cpu Haswell
.venv/bin/python -m pytest tests/integration/test_cpu_independence.py`` (AVX2, no VNNI). A change to
what the default pipeline writes for these models changes them: put the new ones here, then run the
file under qemu as above (in one process: a subprocess leaves the emulator).
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from qpasses.api import run_pipeline
from qpasses.cli.examples import example_data, example_model
from qpasses.core.context import RunContext
from qpasses.ir.metadata import unpack
from qpasses.ir.model import from_proto
from qpasses.testing import parse

FEEDS = 32


def _values(array) -> str:
    return ", ".join(f"{v:.4f}" for v in np.ravel(array))


def mask_model():
    """An additive attention mask before a MatMul: 's' spans [-10003, 3], its uint8 codes sit near
    255, where U8S8 pair sums saturate without VNNI."""
    w = np.random.default_rng(0).normal(0, 0.5, (16, 8))
    return parse("""
g (float[1, 16] x, float[1, 16] m) => (float[1, 8] y) <float[16, 8] w = {%s}, float k = {-10000.0}>
{ big = Mul(m, k)  s = Add(x, big)  y = MatMul(s, w) }""" % _values(w))


def mask_feeds():
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(0, 1, (1, 16)).astype(np.float32),
             "m": (rng.random((1, 16)) < 0.3).astype(np.float32)} for _ in range(FEEDS)]


def silu_model():
    """Conv, SiLU, Conv: quantize-silu scores its gate."""
    rng = np.random.default_rng(2)
    w, v = rng.normal(0, 0.4, (8, 4, 3, 3)), rng.normal(0, 0.3, (4, 8, 1, 1))
    return parse("""
g (float[1, 4, 8, 8] x) => (float[1, 4, 8, 8] y) <float[8, 4, 3, 3] w = {%s}, float[4, 8, 1, 1] v = {%s}>
{ a = Conv<pads=[1,1,1,1]>(x, w)  g = Sigmoid(a)  s = Mul(a, g)  y = Conv(s, v) }""" % (_values(w), _values(v)))


def silu_feeds():
    rng = np.random.default_rng(3)
    return [{"x": rng.normal(0, 1, (1, 4, 8, 8)).astype(np.float32)} for _ in range(FEEDS)]


def example_feeds():
    images = example_data(FEEDS)["input"]
    return [{"input": image} for image in images]


CASES = {"example": (example_model, example_feeds), "mask": (mask_model, mask_feeds), "silu": (silu_model, silu_feeds)}
GOLDEN = {
    "example": "b1d851b47679c4e8a53eb89baa30d8bf13f33306de60a7a8baa4995d1dfa2cac",
    "mask": "73a337981da344f74992b0a4bd909fbc3cda742382c19cfbecc62f80b4091d2a",
    "silu": "925f2f988c3a40329ec05c29e67eccafda9b17ec555f0b9699a378941562ded8",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_pipeline_writes_the_same_bytes_on_every_cpu(case):
    make, feeds = CASES[case]
    model, _ = run_pipeline(from_proto(make()), None, ctx=RunContext(None, feeds()))
    proto = model.to_proto()
    for prop in proto.metadata_props:   # the text itself: zlib builds (zlib-ng) may pack it differently
        prop.value = unpack(prop.value)
    digest = hashlib.sha256(proto.SerializeToString()).hexdigest()
    assert digest == GOLDEN[case], f"{case}: the default pipeline now writes {digest} (see the module docstring)"
