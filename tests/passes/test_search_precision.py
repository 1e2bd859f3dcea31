"""search-precision: the fewest tensors kept at a higher precision for the outputs to meet a target."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from onnx import helper, numpy_helper

from qpasses.api import run_pipeline
from qpasses.core.context import RunContext
from qpasses.core.pipeline import PassManager
from qpasses.evaluation.evaluate import compare
from qpasses.evaluation.objective import Objective
from qpasses.evaluation.summary import weighted_ops
from qpasses.ir.decisions import float_reasons
from qpasses.ir.model import from_proto
from qpasses.passes.search_precision import SearchPrecision
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
    # the why-line leads with what made it float (the output gain), then why this tensor
    reason = float_reasons(model)["x"]["reason"]
    assert re.match(r"kept float: keeping 1 of \d+ tensors float takes the worst output component's snr from "
                    r"[-0-9.]+.* to [0-9.]+.*; this one ranks 1 of \d+ by local quantization error "
                    r"\([-+][0-9.]+ dB of its typical value\)$", reason), reason
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


def test_a_score_must_clear_the_target_by_one_standard_error():
    """8 feeds are few: the check's score less one standard error (jackknife over its feeds) must
    reach the target; ``confidence=0`` compares the score itself."""
    def decision(**options):
        model = from_proto(parse(MASKED))
        ctx = RunContext({"op_types_to_quantize": OPS}, _feeds(40))
        PassManager(PRELUDE).run(model, ctx)
        PassManager([SearchPrecision(**options)]).run(model, ctx)
        return model.decisions["precision_search"]

    probe = decision(target=1000.0)
    score, counted = probe["quantized"], probe["quantized_counted"]
    assert counted < score - 0.2
    between = (score + counted) / 2
    loose = decision(target=between, confidence=0.0)
    assert loose["promoted"] == [] and loose["quantized_counted"] == score
    strict = decision(target=between)
    assert strict["confidence"] == 1.0 and strict["quantized"] == score and strict["promoted"]
    assert strict["met"] and strict["reached_counted"] >= between


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


# opset 11: Unsqueeze/Squeeze take axes as an attribute, so raising the opset for 16-bit Q/DQ (21)
# goes through onnx.version_converter
OLD_OPSET = """
<ir_version: 8, opset_import: ["" : 11]>
g (float[1, 64] x) => (float[1, 64] y) <float k = {3.0}>
{
  u = Unsqueeze <axes = [0]> (x)
  a = Tanh(u)
  b = Mul(a, k)
  c = Tanh(b)
  d = Mul(c, k)
  t = Tanh(d)
  y = Squeeze <axes = [0]> (t)
}
"""


def test_trials_raise_the_opset_once_with_the_same_decision(monkeypatch):
    import onnx.version_converter

    import qpasses.passes.search_precision.checks as search_precision

    real, calls = onnx.version_converter.convert_version, []

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    def run():
        model = from_proto(parse(OLD_OPSET))
        ctx = RunContext({"op_types_to_quantize": ["Tanh", "Mul"], "calibration": {"method": "minmax"}},
                         _outlier_feeds(40))
        PassManager(PRELUDE).run(model, ctx)
        PassManager([SearchPrecision(target=30, fallback="uint16")]).run(model, ctx)
        return model.decisions["precision_search"]

    monkeypatch.setattr(onnx.version_converter, "convert_version", counted)
    once = run()
    assert once["met"] and once["evaluations"] > 2
    assert len(calls) <= 2, calls   # the first trial's and the copy later trials start from (per opset)
    monkeypatch.setattr(search_precision, "require_opset", lambda model, opset: False)   # every trial raises
    calls.clear()
    assert run() == once and len(calls) > 2


def test_the_float_outputs_calibrate_kept_are_its_reference(monkeypatch):
    """Without held-out feeds the first feeds are calibrate's: their float outputs are reused (no
    second float run), and the decision is the one a resumed run (empty cache) reaches."""
    decisions = []
    for resumed in (False, True):
        model = from_proto(parse(OUTLIERS))
        ctx = RunContext({"op_types_to_quantize": ["Tanh"], "calibration": {"method": "minmax"}}, _outlier_feeds(40))
        PassManager("annotate-types,calibrate").run(model, ctx)
        assert len(ctx.cache["kept_samples"].feeds) == 32
        if resumed:
            ctx.cache.clear()
        else:
            monkeypatch.setattr("qpasses.evaluation.evaluate.Reference.run", None)   # a float run would fail
        PassManager([SearchPrecision(target=25, confirm_samples=0)]).run(model, ctx)   # its 8 more: read again
        monkeypatch.undo()
        assert resumed or ctx.cache["kept_samples"].feeds   # left for the run's caller (the CLI's SNR line)
        decisions.append(model.decisions["precision_search"])
    assert decisions[0] == decisions[1] and decisions[0]["promoted"] == ["x"] and decisions[0]["held_out"] is False


@pytest.mark.parametrize("resumed", [False, True])
@pytest.mark.parametrize(("options", "feeds"), [({}, 32), ({"output_values": 64 * 10}, 10),
                                                ({"output_values": 64}, 8), ({"samples": 12}, 12)])
def test_small_outputs_are_checked_on_more_feeds(resumed, options, feeds):
    """An output of 64 values a feed: up to ``samples`` feeds until they hold ``output_values``
    values, never under 8; the same count from calibrate's kept outputs or a second float run."""
    model = from_proto(parse(OUTLIERS))
    ctx = RunContext({"op_types_to_quantize": ["Tanh"], "calibration": {"method": "minmax"}}, _outlier_feeds(40))
    PassManager("annotate-types,calibrate").run(model, ctx)
    if resumed:
        ctx.cache.clear()
    PassManager([SearchPrecision(target=25, **options)]).run(model, ctx)
    assert model.decisions["precision_search"]["feeds"] == feeds


def test_the_shortfall_line_says_what_the_score_counted_as():
    from qpasses.evaluation.summary import shortfall

    decision = {"reached": 24.5, "reached_counted": 23.9, "confidence": 1.0, "metric": "snr", "target": 25.0,
                "promoted": ["a", "b"]}
    assert shortfall(decision) == ("reached 24.5 snr (counted as 23.9: less 1 standard error), short of the "
                                   "target 25, with 2 tensors promoted")
    plain = decision | {"confidence": 0.0, "reached_counted": 24.5}
    assert shortfall(plain) == "reached 24.5 snr, short of the target 25, with 2 tensors promoted"
    blocked = plain | {"blocking": {"conv3.w": -12.34, "relu2": -20.0}}
    assert shortfall(blocked) == ("reached 24.5 snr, short of the target 25, with 2 tensors promoted; next in "
                                  "the ranking, not promoted: conv3.w (local error -12.3 dB), relu2 (local error "
                                  "-20.0 dB)")
    unconfirmed = plain | {"reached": 26.5, "feeds": 12, "confirmed": {"feeds": 24, "added": 4, "score": 22.1,
                                                                        "counted": 21.0, "met": False}}
    assert shortfall(unconfirmed) == ("reached 26.5 snr on its 12 check feeds but 22.1 on all 24 calibration "
                                      "feeds it confirmed on, short of the target 25, with 2 tensors promoted")


def test_a_search_that_kept_most_of_the_int8_speed_up_float_says_so():
    """yolo_detector's 12 dB target left 29 % of the weighted ops' int8 latency gain 8-bit: its output ran
    slower than the float model. The run's summary warns, with the ways to measure and to trade."""
    from qpasses.api import run_summary_lines
    from qpasses.evaluation.summary import slow_share

    decision = {"metric": "snr", "target": 12.0, "int8_share": 0.286, "met": True}
    assert slow_share(decision) == (
        "search-precision kept 71 % of the latency the weighted ops' int8 kernels save in float for the snr "
        "target 12: the model may run no faster than the float one (--vs-onnxruntime measures it; --target "
        "snr=0 keeps every weighted op 8-bit)")
    assert slow_share(decision | {"int8_share": 0.8}) == "" and slow_share({"metric": "snr", "target": 12.0}) == ""
    model = from_proto(parse(OUTLIERS))
    model.decisions["precision_search"] = decision
    assert run_summary_lines(model)[-1] == f"warning: {slow_share(decision)}"


def _chain(layers: int = 5, d: int = 32):
    """x -> (MatMul -> Tanh) x layers, seeded weights."""
    rng = np.random.default_rng(0)
    nodes, weights, prev = [], [], "x"
    for i in range(layers):
        weights.append(numpy_helper.from_array((rng.normal(0, 1, (d, d)) / np.sqrt(d)).astype(np.float32), f"w{i}"))
        out = "y" if i == layers - 1 else f"h{i}"
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]), helper.make_node("Tanh", [f"m{i}"], [out])]
        prev = out
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, d])],
                              [helper.make_tensor_value_info("y", 1, [1, d])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _spiky_feeds(n: int, d: int = 32, spike: float = 50.0) -> list[dict]:
    rng = np.random.default_rng(0)
    feeds = []
    for _ in range(n):
        x = rng.normal(0, 1, (1, d)).astype(np.float32)
        x[0, rng.integers(0, d)] = spike * rng.choice([-1, 1])
        feeds.append({"x": x})
    return feeds


@pytest.mark.parametrize("options", [{}, {"target": 12.0}])
def test_without_a_target_it_aims_higher_within_the_8_bit_share(options):
    """The chain meets the 12 dB target as it is, and reads measurably below 25 dB (spikes 1000x
    the rest). Without a target given, search-precision goes on towards 25 dB while 80 % of the 5
    MatMuls stay 8-bit; a target given (even 12) stops there."""
    model = from_proto(_chain())
    ctx = RunContext({}, _spiky_feeds(40, spike=1000.0))
    PassManager(PRELUDE).run(model, ctx)
    PassManager([SearchPrecision(**options)]).run(model, ctx)
    decision = model.decisions["precision_search"]
    assert 12 < decision["quantized_counted"] < 25 and decision["met"]
    if options:
        assert decision["promoted"] == [] and "aim" not in decision
        return
    assert decision["aim"] == 25 and decision["keep_8bit"] == 0.8 and decision["aimed"] in ("local-error ranking", "graph order")
    assert decision["promoted"] and decision["reached"] > decision["quantized"]
    run_pipeline(model, "compute-qparams,fix-bias-scales,insert-qdq,insert-converts", ctx=ctx)
    eight, total = weighted_ops(model.to_proto())
    assert total == 5 and eight >= 4
    reason = float_reasons(model)[decision["promoted"][0]]["reason"]
    assert f"aim 25 with 80% of the weighted ops' int8 latency gain 8-bit: taken over the {decision['aimed']}" in reason
    ranked = [float_reasons(model)[name]["reason"] for name in decision["promoted"]]
    assert all(("; this one ranks " in r) != ("; this one was taken in graph order" in r) for r in ranked), ranked


def test_a_given_target_is_cleared_with_room_on_the_feeds_the_ranges_came_from():
    """Checks on feeds calibrate computed the ranges from read above new data: a target given must
    hold with ``in_sample_db`` to spare there; on held-out feeds, and for the default target, as is."""
    def decide(passes, **options):
        model = from_proto(parse(OUTLIERS))
        ctx = RunContext({"op_types_to_quantize": ["Tanh"], "calibration": {"method": "minmax"}}, _outlier_feeds(40))
        PassManager(passes).run(model, ctx)
        PassManager([SearchPrecision(**options)]).run(model, ctx)
        return model.decisions["precision_search"]

    roomy = decide("annotate-types,calibrate", target=25)
    assert roomy["target"] == 25 and roomy["checked_at"] == 26 and roomy["met"]
    assert roomy["reached_counted"] >= 26 or not roomy["promoted"]
    for passes, options in (("annotate-types,calibrate", {"target": 25, "in_sample_db": 0}),
                            ("annotate-types,calibrate{hold_out=8}", {"target": 25}),
                            ("annotate-types,calibrate", {})):
        decision = decide(passes, **options)
        assert "checked_at" not in decision, (passes, options)


# A MatMul whose input the calibrated range clips: the first 32 feeds hold none of the spikes (+-40)
# the next 24 do, so the first 32 alone say that 8 bits everywhere meet the target.
CLIPPED = """
g (float[1, 64] x) => (float[1, 8] y) <float[64, 8] w = {%s}>
{
  y = MatMul(x, w)
}
""" % ", ".join(f"{v:.4f}" for v in np.random.default_rng(3).normal(0.0, 0.2, 512))


def _late_spike_feeds(calm: int, spiky: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    feeds = []
    for i in range(calm + spiky):
        x = rng.normal(0.0, 1.0, (1, 64)).astype(np.float32)
        if i >= calm:
            x[0, rng.integers(0, 64)] = rng.choice([-40.0, 40.0])
        feeds.append({"x": x})
    return feeds


@pytest.mark.parametrize("resumed", [False, True])
def test_a_target_met_on_the_check_feeds_is_confirmed_on_the_next_ones(resumed, monkeypatch):
    """The check feeds meet the target with nothing promoted; the next feeds do not: the worst of them
    join the check feeds, the clipped input is kept float, and the rest then confirm the target
    (the same from calibrate's kept outputs or from reading the data again)."""
    from qpasses.analysis import op_costs

    monkeypatch.setattr(op_costs, "shipped", lambda: {})   # no costs: members given back by count
    results = {}
    for confirm in (0, 32):
        model = from_proto(parse(CLIPPED))
        ctx = RunContext({"op_types_to_quantize": ["MatMul"], "calibration": {"method": "percentile", "percentile": 99.0}},
                         _late_spike_feeds(32, 24))
        PassManager("annotate-types,calibrate").run(model, ctx)
        if resumed:
            ctx.cache.clear()
        PassManager([SearchPrecision(target=20, confirm_samples=confirm)]).run(model, ctx)
        decision = model.decisions["precision_search"]
        results[confirm] = (decision, _snr(model, ctx, CLIPPED, _late_spike_feeds(0, 16, seed=5)))
    (plain, plain_snr), (confirmed, confirmed_snr) = results[0], results[32]
    assert plain["met"] and plain["promoted"] == [] and plain["feeds"] == 32 and "confirmed" not in plain
    assert plain_snr < 15
    assert confirmed["confirmed"]["feeds"] == 56 and confirmed["confirmed"]["added"] == 16
    assert confirmed["confirmed"]["met"] and confirmed["confirmed"]["counted"] >= 21   # 20 + 1 dB in-sample
    assert confirmed["feeds"] == 48 and confirmed["promoted"] == ["x"] and confirmed["met"]
    assert confirmed_snr > 25 and confirmed["evaluations"] <= int(2 * math.log2(2)) + 16


def test_no_confirmation_without_feeds_after_the_checked_ones():
    model, _, _ = _search(n=32, target=25)
    assert "confirmed" not in model.decisions["precision_search"]


def test_held_out_checks_are_confirmed_on_the_held_out_feeds_after_them():
    """calibrate{hold_out=16}: the search checks the first 8 held-out feeds (outputs of 64 values,
    output_values=64) and confirms on all 16 of them, none of the feeds the ranges came from."""
    model = from_proto(parse(OUTLIERS))
    feeds = _outlier_feeds(64)
    ctx = RunContext({"op_types_to_quantize": ["Tanh"], "calibration": {"method": "minmax"}}, feeds)
    PassManager("annotate-types,calibrate{hold_out=16}").run(model, ctx)
    PassManager([SearchPrecision(target=25, output_values=64)]).run(model, ctx)
    decision = model.decisions["precision_search"]
    assert decision["held_out"] and decision["feeds"] == 8 and decision["met"]
    assert decision["confirmed"]["feeds"] == 16 and decision["confirmed"]["met"]
    assert decision["confirmed"]["counted"] >= 25 and "checked_at" not in decision   # held out: no allowance


def test_a_missed_target_names_the_tensors_next_in_the_ranking():
    from qpasses.passes.search_precision.checks import Checks

    checks = Checks.__new__(Checks)   # the ranking alone: the local errors, largest first
    checks.local_db = {"a": -3.04, "b": -5.0, "c": -7.5, "d": -9.0, "e": -10.0, "f": -11.0, "g": -12.0}
    checks.ranking = sorted(checks.local_db, key=lambda n: -checks.local_db[n])
    assert checks.blocking(["a", "c"]) == {"b": -5.0, "d": -9.0, "e": -10.0, "f": -11.0, "g": -12.0}
    assert checks.blocking(["a"], count=2) == {"b": -5.0, "c": -7.5}
    assert checks.blocking(list(checks.local_db)) == {}


def test_a_confirmation_that_cannot_run_is_said_not_raised(monkeypatch):
    from qpasses.evaluation.evaluate import Reference

    runs_of = Reference.runs_of

    def refusing(self, *args, **kwargs):
        if len(self.feeds) > 32:
            raise RuntimeError("onnxruntime refused feed 40")
        return runs_of(self, *args, **kwargs)

    monkeypatch.setattr(Reference, "runs_of", refusing)
    model = from_proto(parse(CLIPPED))
    ctx = RunContext({"op_types_to_quantize": ["MatMul"], "calibration": {"method": "percentile", "percentile": 99.0}},
                     _late_spike_feeds(32, 24))
    PassManager("annotate-types,calibrate").run(model, ctx)
    PassManager([SearchPrecision(target=20)]).run(model, ctx)
    decision = model.decisions["precision_search"]
    assert decision["confirmed"] == {"feeds": 56, "added": 0, "skipped": "onnxruntime refused feed 40", "met": None}
    assert decision["met"] and decision["promoted"] == []


def test_the_aim_is_chased_only_where_the_model_reads_measurably_below_it():
    """The chain reads 27.8 dB on 8 check feeds (26.7 counted, one standard error down; 29.4 one
    up), 28.4 on all 40 the confirmation scores. Aiming at 29 nothing is promoted, with or without
    the confirmation: its score plus the margin reaches the aim (ddddocr_det's aim kept two early
    Convs float for +0.005 F1, within the eval set's standard error, at 1.26x onnxruntime's
    latency). Aiming at 30 it is measurably below, and the search promotes."""
    for aim, confirm in ((29, 0), (29, 32), (30, 0), (30, 32)):
        model = from_proto(_chain())
        ctx = RunContext({}, _spiky_feeds(40))
        PassManager("annotate-types,calibrate").run(model, ctx)
        PassManager([SearchPrecision(samples=8, aim=aim, confirm_samples=confirm)]).run(model, ctx)
        decision = model.decisions["precision_search"]
        assert decision["quantized_counted"] < decision["quantized"] < 29, decision
        assert ("confirmed" in decision) == bool(confirm)
        if aim == 29:
            assert decision["promoted"] == [] and decision["aim_met"], decision
            assert decision["aimed"].startswith("nothing: not measurably below the aim")
        else:
            assert decision["promoted"] and decision["aimed"] in ("local-error ranking", "graph order"), decision


def test_measured_costs_time_the_models_patterns_once_and_cache_them(tmp_path, monkeypatch):
    """cost=measured times each op pattern the model holds (here: made-up timings, cached under
    XDG_CACHE_HOME) instead of reading the table shipped; a second run reads the cache."""
    from qpasses.analysis import op_costs

    timed = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(op_costs, "measure", lambda name: timed.append(name) or 20.0)
    for _ in range(2):
        model = from_proto(_chain())
        ctx = RunContext({}, _spiky_feeds(40))
        PassManager(PRELUDE).run(model, ctx)
        PassManager([SearchPrecision(cost="measured")]).run(model, ctx)
        decision = model.decisions["precision_search"]
        assert decision["cost"] == "measured" and 0.8 <= decision["int8_share"] <= 1
    assert timed == ["matmul|0|0|1"]   # the chain's five 32x32 MatMuls (rows unknown): one pattern, timed once
    assert json.loads(op_costs.cache_path().read_text())["ps_per_mac"] == {"matmul|0|0|1": 20.0}
