"""select-by-snr: which axes are open, what is chosen and why, and when it stands aside."""
import numpy as np
import pytest

from qpasses.api import run_pipeline
from qpasses.config.quant_config import CalibrationConfig, load_config
from qpasses.core.context import RunContext
from qpasses.core.verify import check_onnx
from qpasses.passes.select_by_snr import NAME
from qpasses.testing import model_from_text

BEFORE = "fold-constants,cleanup,annotate-types,calibrate"
AFTER = "compute-qparams,fix-bias-scales,insert-qdq,insert-converts"
SIZE = 4096
# Mul and Sigmoid stay float by default; these tests are about the variants select-by-snr scores
# on them, so every config here selects every op with a rule (a no-op for the MatMul graphs)
ALL = {"op_types_to_quantize": "all"}

# x is a graph input (calibrated range); y = 2x is a graph output (full range either way)
SCALE = """
g (float[1, 4096] x) => (float[1, 4096] y) <float two = {2.0}> {
    y = Mul(x, two)
}
"""

# a saturating op: outliers of x barely change y, so clipping x's range only buys resolution
SIGMOID = """
g (float[1, 4096] x) => (float[1, 4096] y) {
    y = Sigmoid(x)
}
"""

MATMUL = """
g (float[1, 64] x) => (float[1, 32] y) <float[64, 32] w = {{{w}}}> {{
    y = MatMul(x, w)
}}
"""


def outlier_feeds(n=16):
    """N(0, 1) values; sample 0 has one value of 100 that carries a quarter of the signal.
    Percentile 99.98 clips it to ~4, mse less; the min/max grid keeps it."""
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, SIZE)).astype(np.float32)} for _ in range(n)]
    feeds[0]["x"][0, 0] = 100.0
    return feeds


def matmul_model(weights):
    return model_from_text(MATMUL.format(w=", ".join(f"{v:.6f}" for v in weights.ravel())))


def normal_feeds(n=16, size=64):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((1, size)).astype(np.float32)} for _ in range(n)]


def select(model, data, config=None, options=""):
    """Calibrate, then run select-by-snr in the same run; (its PassRecord, the run's findings)
    (model.calibrated_ranges: the ranges before)."""
    ctx = RunContext({**ALL, **(config or {})}, data)
    run_pipeline(model, BEFORE, ctx=ctx)
    model.calibrated_ranges = dict(model.ranges)
    records = run_pipeline(model, f"{NAME}{{{options}}}" if options else NAME, ctx=ctx)[1]
    return records[0], ctx.findings.as_dict()


def quantized_snr(model, data, config=None):
    from qpasses.evaluation.evaluate import compare

    reference = model.to_proto(metadata=False)
    run_pipeline(model, AFTER, config={**ALL, **(config or {})})
    check_onnx(model.to_proto())
    return compare(reference, model.to_proto(metadata=False), data)["snr_db"]


DEFAULT = CalibrationConfig.method   # the default method clips outliers (mse)


def test_default_method_min_max_wins_when_the_default_clips_the_signal():
    model, data = model_from_text(SCALE), outlier_feeds()
    record, findings = select(model, data)
    report = findings[NAME]
    scores = {v["variant"]: v["snr_db"] for v in report["variants"]}
    assert set(scores) == {f"ranges {DEFAULT}", "ranges minmax"}
    assert scores["ranges minmax"] > scores[f"ranges {DEFAULT}"] + 1   # mse clips less than percentile 99.98 (+6 dB)
    assert report["chosen"] == "ranges minmax" and record.modified
    assert model.ranges["x"] == model.observed["x"]
    assert model.decisions["calibration"] == {"method": "minmax", "given": False, "chosen_by": NAME, "over": DEFAULT}
    assert quantized_snr(model, data) > 18
    assert f"calibration (minmax, chosen by select-by-snr over {DEFAULT})" in model.quant["x"].why[-1]


def test_min_max_chosen_keeps_the_held_out_feeds_held_out():
    """search-precision scores on the feeds calibrate held out: choosing min/max must not forget them."""
    model, data = model_from_text(SCALE), outlier_feeds()
    ctx = RunContext(ALL, data)
    run_pipeline(model, BEFORE.replace("calibrate", "calibrate{hold_out=4}") + "," + NAME, ctx=ctx)
    assert ctx.findings.as_dict()[NAME]["chosen"] == "ranges minmax"
    assert model.decisions["calibration"] == {"method": "minmax", "given": False, "held_out_from": 12,
                                              "chosen_by": NAME, "over": DEFAULT}


def test_the_default_method_kept_when_it_scores_best():
    """Sigmoid saturates: clipping the outlier costs little and buys the grid back (without the
    handicap, which the next test covers)."""
    model, data = model_from_text(SIGMOID), outlier_feeds()
    record, findings = select(model, data, options="fitted_penalty_db=0")
    assert findings[NAME]["chosen"] == f"ranges {DEFAULT}" and not record.modified
    assert model.ranges["x"] != model.observed["x"]


@pytest.mark.parametrize("penalty, chosen", [("0", DEFAULT), ("1", "minmax")])
def test_calibrated_ranges_need_to_lead_by_their_penalty(penalty, chosen):
    """With an outlier of 100 the calibrated ranges lead min/max by 0.7 dB on the feeds they were
    fitted to: under the default 1 dB handicap min/max is kept, and the report says why."""
    model, data = model_from_text(SIGMOID), outlier_feeds()
    record, findings = select(model, data, options=f"fitted_penalty_db={penalty}")
    report = findings[NAME]
    scores = {v["variant"]: (v["snr_db"], v["penalty_db"]) for v in report["variants"]}
    assert 0 < scores[f"ranges {DEFAULT}"][0] - scores["ranges minmax"][0] < 1
    assert scores[f"ranges {DEFAULT}"][1] == float(penalty) and scores["ranges minmax"][1] == 0
    assert report["chosen"] == f"ranges {chosen}" and record.modified == (chosen == "minmax")


@pytest.mark.parametrize("metric, chosen", [("snr", DEFAULT), ("cosine", "minmax")])
def test_a_choice_after_the_search_keeps_its_snr_target(metric, chosen):
    """After search-precision (its saved decision): min/max leads under the handicap but reads below
    the search's SNR target while the calibrated ranges meet it, so they stay."""
    model, data = model_from_text(SIGMOID), outlier_feeds()
    ctx = RunContext(ALL, data)
    run_pipeline(model, BEFORE, ctx=ctx)
    model.decisions["precision_search"] = {"metric": metric, "target": 27.0}
    run_pipeline(model, NAME, ctx=ctx)
    report = ctx.findings.as_dict()[NAME]
    scores = {v["variant"]: v["snr_db"] for v in report["variants"]}
    assert scores["ranges minmax"] < 27.0 <= scores[f"ranges {DEFAULT}"] < scores["ranges minmax"] + 1
    assert report["chosen"] == f"ranges {chosen}"


@pytest.mark.parametrize("config", [{"calibration": {"method": "percentile"}},
                                    {"calibration": {"method": "minmax"}}])
def test_a_method_the_user_chose_is_kept(config):
    model, data = model_from_text(SCALE), outlier_feeds()
    record, findings = select(model, data, config)
    assert NAME not in findings and not record.modified and record.stats == {"variants": 0}
    assert model.ranges == model.calibrated_ranges


def test_method_given_is_recorded_from_the_config_text():
    assert load_config({"calibration": {"method": "percentile"}}).calibration._given == {"method"}
    assert "method" not in load_config({"calibration": {"percentile": 99.9}}).calibration._given


PER_TENSOR = {"per_channel": False, "calibration": {"method": "minmax"}}


def test_symmetric_per_tensor_weights_chosen_with_a_latency_penalty_on_asymmetric():
    w = np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)  # centred: grids tie
    model, data = matmul_model(w), normal_feeds()
    record, findings = select(model, data, PER_TENSOR, "asymmetric_penalty_db=1")
    report = findings[NAME]
    assert [v["variant"] for v in report["variants"]] == ["weights asymmetric", "weights symmetric"]
    assert report["variants"][0]["penalty_db"] == 1.0
    assert abs(report["variants"][0]["snr_db"] - report["variants"][1]["snr_db"]) < 1.0
    assert report["chosen"] == "weights symmetric" and record.modified
    assert model.quant["w"].symmetric
    assert any(NAME in line for line in model.quant["w"].why)
    assert quantized_snr(model, data, PER_TENSOR) > 30


def test_the_more_accurate_weight_grid_wins_by_default():
    rng = np.random.default_rng(2)
    config = {**PER_TENSOR, "activation_type": "uint16"}   # the weight grid dominates the error
    positive = (rng.random((64, 32)) + 0.5).astype(np.float32)   # a symmetric grid wastes half
    model, data = matmul_model(positive), normal_feeds()
    record, findings = select(model, data, config)
    scores = {v["variant"]: v["snr_db"] for v in findings[NAME]["variants"]}
    assert scores["weights asymmetric"] > scores["weights symmetric"] + 3
    assert findings[NAME]["chosen"] == "weights asymmetric" and not record.modified
    assert not model.quant["w"].symmetric
    signs = np.where(np.arange(64 * 32).reshape(64, 32) % 7 == 0, -1.0, 1.0).astype(np.float32)
    model = matmul_model(signs)   # +-1: on the symmetric grid exactly, not on the asymmetric one
    record, findings = select(model, data, config)
    scores = {v["variant"]: v["snr_db"] for v in findings[NAME]["variants"]}
    assert scores["weights symmetric"] > scores["weights asymmetric"] + 20
    assert findings[NAME]["chosen"] == "weights symmetric" and record.modified and model.quant["w"].symmetric


@pytest.mark.parametrize("extra", [{"weight_symmetric": False}, {"weight_symmetric": True},
                                   {"tensor_overrides": {"w": [{"symmetric": False}]}},
                                   {"per_channel": True}])
def test_weight_axis_closed_when_the_user_decided(extra):
    w = np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)
    model = matmul_model(w)
    _, findings = select(model, normal_feeds(), {**PER_TENSOR, **extra})
    assert NAME not in findings


def test_stands_aside_without_rereadable_data_or_for_big_models():
    def findings_of(model, passes, data):
        ctx = RunContext(ALL, data)
        record = run_pipeline(model, passes, ctx=ctx)[1][-1]
        return ctx.findings.as_dict(), record

    model = model_from_text(SCALE)
    feeds = outlier_feeds()
    findings, _ = findings_of(model, f"{BEFORE},{NAME}", iter(feeds))   # one-shot: spent by calibrate,
    assert findings[NAME]["chosen"] == "ranges minmax"                  # but calibrate kept 16 feeds
    model = model_from_text(SCALE)
    run_pipeline(model, BEFORE, config=ALL, calibration_data=feeds)
    # another run: calibrate's kept feeds are not there, as when calibrate could not keep them
    findings, _ = findings_of(model, NAME, iter([]))
    assert findings[NAME] == {"skipped": "the calibration data cannot be read again"}
    findings, record = findings_of(model, f"{NAME}{{max_weight_mb=0}}", feeds)
    assert "max_weight_mb=0" in findings[NAME]["skipped"] and not record.modified
    findings, _ = findings_of(model, f"{NAME}{{max_nodes=0}}", feeds)
    assert findings[NAME] == {"skipped": "1 nodes is over max_nodes=0"}


def test_a_variant_that_fails_is_reported_not_fatal():
    model, data = model_from_text(SCALE), outlier_feeds()
    _, findings = select(model, data, options="then=insert-qdq")   # insert-qdq needs qparams: every variant fails
    report = findings[NAME]
    assert report["skipped"] == "no variant could be quantized and run"
    assert [f["variant"] for f in report["failed"]] == [f"ranges {DEFAULT}", "ranges minmax"]
    assert "qparams-computed" in report["failed"][0]["error"]
    assert model.ranges == model.calibrated_ranges != model.observed


def test_variants_are_scored_with_q_dq_as_written():
    """The score of the chosen variant is its output SNR in onnxruntime without graph optimizations
    (the simulation, the same on every CPU), not in the fused integer kernels of this CPU: here they
    differ (onnxruntime 1.32's fused uint16 x int8 MatMul loses most of what the grids tell apart)."""
    from qpasses.evaluation.evaluate import session, snr_db

    config = {**PER_TENSOR, "activation_type": "uint16"}
    positive = (np.random.default_rng(2).random((64, 32)) + 0.5).astype(np.float32)
    model, data = matmul_model(positive), normal_feeds()
    reference = model.to_proto(metadata=False)
    _, findings = select(model, data, config, "early_stop=0")
    report = findings[NAME]
    run_pipeline(model, AFTER, config={**ALL, **config})
    float_sess, simulated = session(reference), session(model.to_proto(metadata=False), optimize=False)
    want = np.concatenate([float_sess.run(None, f)[0].ravel() for f in data])
    got = np.concatenate([simulated.run(None, f)[0].ravel() for f in data])
    chosen = next(v for v in report["variants"] if v["variant"] == report["chosen"])
    assert chosen["samples"] == len(data) and chosen["snr_db"] == pytest.approx(snr_db(want, got), abs=0.01)


def test_float_outputs_kept_by_calibrate_score_like_a_second_float_run():
    def select_with(model, kept, options=""):
        """select-by-snr's findings in a run whose cache holds ``kept`` (or not)."""
        ctx = RunContext(ALL, data)
        if kept is not None:
            ctx.cache["kept_samples"] = kept
        run_pipeline(model, f"{NAME}{{{options}}}" if options else NAME, ctx=ctx)
        return ctx.findings.as_dict()[NAME]

    model, data = model_from_text(SIGMOID), outlier_feeds(40)
    ctx = RunContext(ALL, data)
    run_pipeline(model, BEFORE, ctx=ctx)
    kept = ctx.cache["kept_samples"]
    assert len(kept.feeds) == 32 and kept.names == ["y"] and kept.outputs[0][0].shape == (1, SIZE)
    scores = []
    for keep in (True, False):
        scores.append(select_with(model.copy(), kept if keep else None)["variants"])
    for a, b in zip(*scores):
        assert a["variant"] == b["variant"] and abs(a["snr_db"] - b["snr_db"]) < 0.01
    kept.feeds, kept.outputs, kept.full = kept.feeds[:2], kept.outputs[:2], True   # out of room at 2
    assert select_with(model, kept)["samples"] == 32    # too few kept: the float model runs again
    for kept_outputs in (True, False):             # big outputs: 8 feeds are enough, both ways
        model, ctx = model_from_text(SIGMOID), RunContext(ALL, data)
        run_pipeline(model, BEFORE, ctx=ctx)
        kept = ctx.cache["kept_samples"] if kept_outputs else None
        assert select_with(model, kept, "output_values=10000")["samples"] == 8


def test_a_clearly_worse_variant_stops_scoring_early():
    """Positive weights: symmetric (scored second) is far worse than asymmetric: after 8 feeds each
    the race is decided, and only the loser is marked dropped."""
    config = {**PER_TENSOR, "activation_type": "uint16"}
    positive = (np.random.default_rng(2).random((64, 32)) + 0.5).astype(np.float32)
    samples = {}
    for stop in ("", "early_stop=0"):
        model = matmul_model(positive)
        _, findings = select(model, normal_feeds(), config, stop)
        report = findings[NAME]
        assert report["chosen"] == "weights asymmetric" and report["samples"] == 16
        samples[stop] = [(v["samples"], v.get("dropped", False)) for v in report["variants"]]
    assert samples == {"": [(8, False), (8, True)], "early_stop=0": [(16, False), (16, False)]}
