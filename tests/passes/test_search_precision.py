"""search-precision: the fewest tensors kept at a higher precision for the outputs to meet a target."""
from __future__ import annotations

import math

import numpy as np
import pytest

from qpasses.api import run_pipeline
from qpasses.context import RunContext
from qpasses.decisions import float_reasons
from qpasses.evaluate import compare
from qpasses.ir import from_proto
from qpasses.objective import Objective
from qpasses.passes.search_precision import SearchPrecision
from qpasses.pipeline import PassManager
from qpasses.testing import parse

# A detector head: box coordinates (0..320) and class probabilities (0..1) in one output: one 8-bit
# grid over [0, 320] would erase the probabilities, which the pooled output SNR does not see.
MASKED = """
g (float[1, 4, 8] x, float[1, 2, 8] c) => (float[1, 6, 8] y) <float k = {80.0}>
{
  b = Mul(x, k)
  p = Sigmoid(c)
  y = Concat <axis = 1> (b, p)
}
"""
OPS = ["Mul", "Sigmoid", "Concat"]
PRELUDE = "annotate-types,calibrate{hold_out=8}"


def _feeds(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        out.append({"x": rng.uniform(0.0, 4.0, (1, 4, 8)).astype(np.float32),
                    "c": rng.normal(0.0, 2.0, (1, 2, 8)).astype(np.float32)})
    return out


# A Tanh over values whose range a few outliers (+-1000) stretch: one 8-bit grid over that range
# rounds the bulk (|x| < 3) to 0, and the output is lost; kept float, the input costs nothing.
OUTLIERS = """
g (float[1, 64] x) => (float[1, 64] y)
{
  y = Tanh(x)
}
"""


def _outlier_feeds(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(n):
        x = rng.normal(0.0, 1.0, (1, 64)).astype(np.float32)
        x[0, rng.integers(0, 64)] = rng.choice([-1000.0, 1000.0])
        feeds.append({"x": x})
    return feeds


def _search(config=None, n=40, **options):
    model = from_proto(parse(OUTLIERS))
    ctx = RunContext({"op_types_to_quantize": ["Tanh"], "calibration": {"method": "minmax"}, **(config or {})},
                     _outlier_feeds(n))
    PassManager(PRELUDE).run(model, ctx)
    records = PassManager([SearchPrecision(**options)]).run(model, ctx)
    return model, ctx, records[0]


def _snr(model, ctx, text=OUTLIERS, feeds=None) -> float:
    """The worst component's SNR on new data."""
    run_pipeline(model, "compute-qparams,fix-bias-scales,insert-qdq,insert-converts", ctx=ctx)
    reference = from_proto(parse(text))
    result = compare(reference, model, feeds or _outlier_feeds(16, seed=9), objective=Objective("snr", model=reference))
    return result["objective"]["overall"]


def test_without_the_search_the_outliers_erase_the_output():
    model = from_proto(parse(OUTLIERS))
    ctx = RunContext({"op_types_to_quantize": ["Tanh"], "calibration": {"method": "minmax"}}, _outlier_feeds(40))
    PassManager(PRELUDE).run(model, ctx)
    assert _snr(model, ctx) < 10


def test_promotes_the_stretched_input_and_meets_the_target_on_new_data():
    model, ctx, record = _search(target=25)
    decision = model.decisions["precision_search"]
    assert decision["met"] and decision["held_out"] and decision["quantized"] < 10
    assert decision["promoted"] == ["x"] and "x" not in model.quant and "y" in model.quant
    assert "search-precision" in float_reasons(model)["x"]["pass"]
    assert record.modified and 1 < decision["evaluations"] <= 2 * math.log2(4) + 16
    assert _snr(model, ctx) >= 25


def test_nothing_is_promoted_when_the_target_holds():
    model = from_proto(parse(MASKED))   # its Concat of mixed ranges stays float (compute-qparams' rule)
    ctx = RunContext({"op_types_to_quantize": OPS}, _feeds(40))
    PassManager(PRELUDE).run(model, ctx)
    before = model.quant.to_json()
    PassManager([SearchPrecision(target=20)]).run(model, ctx)
    decision = model.decisions["precision_search"]
    assert decision["promoted"] == [] and decision["evaluations"] == 1 and decision["quantized"] >= 20
    assert model.quant.to_json() == before


def test_a_second_run_changes_nothing():
    model, ctx, _ = _search(target=25)
    table = model.quant.to_json()
    again = PassManager([SearchPrecision(target=25)]).run(model, ctx)[0]
    assert not again.modified and model.quant.to_json() == table


def test_uint16_fallback_retypes_the_promoted_tensors():
    model, ctx, _ = _search(target=25, fallback="uint16")
    promoted = model.decisions["precision_search"]["promoted"]
    assert promoted and all(model.quant[n].qtype == "uint16" for n in promoted)
    assert any("search-precision" in line for line in model.quant[promoted[0]].why)
    assert _snr(model, ctx) >= 25


def test_without_held_out_feeds_it_says_so():
    model, _, _ = _search(target=25, n=12)   # too few samples to hold any out
    assert model.decisions["precision_search"]["held_out"] is False


@pytest.mark.parametrize("target", [0.0])
def test_target_zero_does_nothing(target):
    model, ctx, record = _search(target=target)
    assert not record.modified and "precision_search" not in model.decisions


def test_a_concat_of_mixed_ranges_stays_float_with_its_reason():
    """compute-qparams leaves a Concat whose inputs span ranges > 16x apart float: the search has
    nothing left to fix."""
    model = from_proto(parse(MASKED))
    ctx = RunContext({"op_types_to_quantize": OPS}, _feeds(40))
    run_pipeline(model, PRELUDE + ",compute-qparams", ctx=ctx)
    assert "y" not in model.quant and "b" in model.quant and "p" in model.quant
    reason = float_reasons(model)["y"]["reason"]
    assert "Concat" in reason and "x apart" in reason and "'p'" in reason
    assert _snr(model, ctx, MASKED, _feeds(16, seed=9)) > 25
