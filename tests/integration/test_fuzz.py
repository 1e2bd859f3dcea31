"""Fuzzing the default pipeline: random valid models and configs either quantize to a model that
passes onnx.checker, runs in onnxruntime with a finite SNR, or fail with a one-line QpassesError.

Long runs: ``python tools/fuzz.py N``. Crashes found by fuzzing stay below as regression cases
(the minimal model hypothesis found, in ONNX text, with the config that triggered it).
"""
import pytest
from hypothesis import HealthCheck, given, settings

from tests.kits.fuzzgen.cases import FuzzCase, cases
from tests.kits.fuzzgen.outcome import run_case, snr_floor
from qpasses.testing import parse, random_feed


@settings(max_examples=200, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_default_pipeline_on_random_models(case):
    outcome = run_case(case)
    assert outcome.status != "crash", f"{outcome.kind}: {outcome.detail}"


# (bug, model text, config): each crashed the default pipeline before its fix
REGRESSIONS = [
    ("qparams.quantize returned a numpy scalar for a 0-d constant: gs.Constant refused it",
     """
     fuzz (float[1,1,1,1] x1) => (float[1,1,1,1] y) <float k = {0.06286511}> {
        y = Mul (k, x1)
     }""", {}),
    ("an equal Split (no 'split' input) kept at opset 21 without num_outputs: onnxruntime refused it",
     """
     fuzz (float[1,1,2,2] x) => (float[1,1,1,2] a, float[1,1,1,2] b) {
        a, b = Split <axis = 2> (x)
     }""", {"activation_type": "uint16"}),
    ("fold-batchnorm renamed a Conv weight to w_bn: a tensor_overrides entry for 'w' was refused",
     """
     fuzz (float[1,2,3,3] x) => (float[1,2,3,3] y)
        <float[2,2,1,1] w = {0.5, -1, 0.25, 2}, float[2] s = {1.5, 0.5}, float[2] b = {0.1, -0.2},
         float[2] m = {0, 0.3}, float[2] v = {1, 2}> {
        c = Conv (x, w)
        y = BatchNormalization (c, s, b, m, v)
     }""", {"per_channel": True, "tensor_overrides": {"w": [{"quant_type": "int4"}]}}),
    ("a convert on a tensor two shares away from its root (Slice -> Reshape -> MaxPool) found no range",
     """
     fuzz (float[1,8] x) => (float[1,1,1,1] y, float[1,1] z)
        <float[1] s = {1}, float[1] b = {0}, float[1] mu = {0}, float[1] v = {1}, int64[4] shp = {1,1,1,1},
         int64[1] c0 = {6}, int64[1] c1 = {7}, int64[1] ax = {1}, float[1] k = {0.3}> {
        sl = Slice (x, c0, c1, ax)
        r = Reshape (sl, shp)
        m = MaxPool <kernel_shape = [1, 1]> (r)
        y = BatchNormalization (m, s, b, mu, v)
        z = Add (sl, k)
     }""", {"mixed_precision": {"sl": {"quant_type": "uint16", "symmetric": True}}}),
    ("opset 11 -> 21 kept Resize's empty 'scales' (also a graph input) next to 'sizes': onnxruntime refused it",
     """<ir_version: 10, opset_import: ["" : 11]>
     fuzz (float[1,1,2,6] x, float[0] e) => (float[1,1,1,12] y) <float[0] e = {}, int64[4] sz = {1,1,1,12}> {
        y = Resize <mode = "nearest"> (x, e, e, sz)
     }""", {"activation_type": "int16", "force_quantize_no_input_check": True}),
    ("a convert on a Gather of a constant table had no range (the table is not calibrated)",
     """
     fuzz (int64[1,2] ids) => (float[1,2,3] y) <float[4,3] table = {1,2,3,4,5,6,7,8,9,10,11,12}, float[1] k = {0.5}> {
        g = Gather <axis = 0> (table, ids)
        y = Mul (k, g)
     }""", {"mixed_precision": {"y": "uint16"}}),
    ("a convert on a tensor with a fixed scale/zero point override had no range (fixed tensors are not calibrated)",
     """
     fuzz (float[1,4] x) => (float[1,4] y) <float[1] k = {0.5}, float[1] j = {2}> {
        r = Add (x, k)
        y = Mul (r, j)
     }""", {"tensor_overrides": {"r": [{"scale": 0.01, "zero_point": 3}]}, "mixed_precision": {"y": "uint16"}}),
    ("an int8 DQ before an excluded Reshape at opset 21: onnxruntime could not load the model (its QDQ propagation)",
     """<ir_version: 10, opset_import: ["" : 21]>
     fuzz (float[1,2] x) => (float[?,?] y) <float[2,1] w = {0.5, -0.25}, int64[2] shp = {1,-1}> {
        [Gemm_0] g = Gemm (x, w)
        [Relu_2] r = Relu (g)
        [Reshape_1] y = Reshape (r, shp)
     }""", {"nodes_to_exclude": ["Reshape_1"], "activation_type": "int8"}),
    ("an int8 convert before a Reshape whose Conv reads it float: its dead Q/DQ went, so onnxruntime could not load it",
     """
     fuzz (float[1,1] x1) => (float[?,?] relu_2, float[?,?,?,?] conv_10) <int64[4] shape6 = {1,1,1,1},
                                                                           float[1,1,1,1] w9 = {0.12573022}> {
        [Relu_3] relu_2 = Relu (x1)
        [Relu_5] relu_4 = Relu (x1)
        [Reshape_8] resh_7 = Reshape (relu_4, shape6)
        [Conv_11] conv_10 = Conv <kernel_shape = [1, 1]> (resh_7, w9)
     }""", {"op_types_to_quantize": ["Gemm"], "activation_type": "uint16", "mixed_precision": {"relu_4": "int8"},
            "weight_type": "uint4"}),
]


@pytest.mark.parametrize("bug,text,config", REGRESSIONS, ids=[r[0].split(":")[0] for r in REGRESSIONS])
def test_regression(bug, text, config):
    model = parse(text.strip(), opset=13)  # texts without a header are opset 13
    case = FuzzCase(model, [random_feed(model, seed) for seed in range(4)], config)
    outcome = run_case(case)
    assert outcome.status == "ok", f"{bug}: {outcome.kind}: {outcome.detail}"


def _tiny_case(config):
    model = parse("fuzz (float[1,4] x) => (float[1,4] y) <float[1] k = {0.5}> { y = Add (x, k) }")
    return FuzzCase(model, [random_feed(model, seed) for seed in range(4)], config)


def test_run_case_tells_errors_from_crashes(monkeypatch):
    assert run_case(_tiny_case({})).status == "ok"
    error = run_case(_tiny_case({"mixed_precision": {"nope": "uint16"}}))
    assert error.status == "error" and error.kind.startswith("ConfigError")
    from qpasses.passes.insert_qdq import InsertQDQ

    def broken(self, model, ctx):
        raise ValueError("boom")

    monkeypatch.setattr(InsertQDQ, "run", broken)
    crash = run_case(_tiny_case({}))
    assert crash.status == "crash" and crash.kind.startswith("pipeline: ValueError at"), crash


def test_snr_floor_only_for_unclipped_8_bit_and_wider():
    assert snr_floor(_tiny_case({"calibration": {"method": "minmax"}})) == 0.0
    assert snr_floor(_tiny_case({"activation_type": "uint16", "calibration": {"method": "pow2"}})) == 0.0
    assert snr_floor(_tiny_case({})) is None                       # default: percentile clips
    assert snr_floor(_tiny_case({"weight_type": "int4", "calibration": {"method": "minmax"}})) is None
    scaled = _tiny_case({"calibration": {"method": "minmax"}})
    scaled.traits = ["scaled-feeds"]
    assert snr_floor(scaled) is None


# -- 4-bit types: refused up front or loadable, never an internal error (issue 14) --------------------------
_FOUR_BIT = dict(derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _no_crash(case):
    outcome = run_case(case)
    assert outcome.status != "crash", f"{outcome.kind}: {outcome.detail}"


@settings(max_examples=60, **_FOUR_BIT)
@given(cases(max_ops=10, four_bit=True))
def test_random_4_bit_configs_quantize_to_loadable_models_or_are_refused(case):
    """Every config has 4 bits somewhere (activations, weights, both, an override): the default
    pipeline gives a model onnxruntime loads at its default optimization level, or a one-line
    QpassesError; run_case counts a model it cannot load as a crash."""
    _no_crash(case)


@pytest.mark.slow
@settings(max_examples=1500, **_FOUR_BIT)
@given(cases(four_bit=True))
def test_random_4_bit_configs_long_run(case):
    _no_crash(case)


def _run_cli_case(case, folder) -> None:
    """`qpasses run` on a case written to ``folder``: exit 0 with a model onnxruntime loads, or exit 2
    with one line and nothing written; never exit 1."""
    import contextlib
    import io
    import json

    import numpy as np
    import onnx

    from qpasses.cli import main
    from qpasses.evaluation.evaluate import session

    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(case.model, folder / "model.onnx")
    np.savez(folder / "calib.npz", **{k: np.stack([f[k] for f in case.feeds]) for k in case.feeds[0]})
    (folder / "cfg.json").write_text(json.dumps(case.config))
    out = folder / "q.onnx"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", str(folder / "model.onnx"), "-o", str(out), "--calib", str(folder / "calib.npz"),
                     "--config", str(folder / "cfg.json"), "--quiet"] + (["--passes", case.passes] if case.passes else []))
    lines = err.getvalue().strip().splitlines()
    assert code in (0, 2), f"exit {code}: {lines}"
    if code == 2:
        assert len(lines) == 1 and not out.exists(), lines
        assert not list(folder.glob(".qpasses-*"))
    else:
        session(out)   # onnxruntime loads it at its default optimization level


@settings(max_examples=25, **_FOUR_BIT)
@given(case=cases(max_ops=8, four_bit=True))
def test_the_cli_on_random_4_bit_cases_never_exits_1(case, tmp_path_factory):
    _run_cli_case(case, tmp_path_factory.mktemp("fuzz"))


@pytest.mark.slow
@settings(max_examples=500, **_FOUR_BIT)
@given(case=cases(four_bit=True))
def test_the_cli_on_random_4_bit_cases_long_run(case, tmp_path_factory):
    _run_cli_case(case, tmp_path_factory.mktemp("fuzz"))

