"""protect-pair-sums: the layers whose int8 pair sums could saturate int16 (x86-64 without VNNI) get
int8 grids on which no pair of codes can (default), or their codes stored as uint8 on the same grid
(``fix=uint8``: the model computes the same); nothing else changes."""
import numpy as np
import pytest

from qpasses.analysis.saturation import qdq_layers, risks
from qpasses.api import quantize
from qpasses.core.pipeline import QUANTIZE_PIPELINE
from qpasses.cli.explain import explain_lines
from qpasses.evaluation.evaluate import session
from qpasses.ir.model import from_proto
from qpasses.testing import bn_conv_data, bn_conv_layer, parse, run


def _values(array) -> str:
    return ", ".join(f"{v:.5f}" for v in np.ravel(array))


def two_convs():
    """``risky``: trained-like 3x3 weights (a same-sign pair reaches |a + b| > 128 in most channels);
    ``safe``: a 1x1 Conv over 2 channels whose two weights have opposite signs in every output
    channel, so its one pair per channel can never leave int16."""
    rng = np.random.default_rng(0)
    w = rng.laplace(0, 0.2, (2, 4, 3, 3))
    v = np.stack([np.abs(rng.normal(0, 0.5, 3)), -np.abs(rng.normal(0, 0.5, 3))], 1).reshape(3, 2, 1, 1)
    return parse("""
g (float[1, 4, 6, 6] x) => (float[1, 3, 6, 6] y) <float[2, 4, 3, 3] w = {%s}, float[3, 2, 1, 1] v = {%s}>
{ a = Conv<pads=[1,1,1,1]>(x, w)  y = Conv(a, v) }""" % (_values(w), _values(v)))


def _feeds(n=8):
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(0, 1, (1, 4, 6, 6)).astype(np.float32)} for _ in range(n)]


def _outputs(model, feeds):
    return [run(model, f, judged=True)[0] for f in feeds]


def _weight_types(model) -> dict[str, str]:
    return {name: tq.qtype for name, tq in model.quant.items() if tq.role == "weight"}


UINT8 = QUANTIZE_PIPELINE.replace("protect-pair-sums", "protect-pair-sums{fix=uint8}")


def _snr(model, reference, feeds) -> float:
    want = np.concatenate([run(reference, f)[0].ravel() for f in feeds]).astype(np.float64)
    got = np.concatenate([run(model, f, judged=True)[0].ravel() for f in feeds])
    return 10 * np.log10((want ** 2).sum() / ((got - want) ** 2).sum())


def test_the_layer_of_issue_35_gets_a_grid_no_pair_can_saturate_on():
    feeds = [{"x": x} for x in bn_conv_data(8, 1)]
    protected = quantize(from_proto(bn_conv_layer()), feeds)
    plain = quantize(from_proto(bn_conv_layer()), feeds, config={"cpu": "x86-64-vnni"})
    assert _weight_types(protected) == _weight_types(plain) == {"w": "int8"}
    assert risks(qdq_layers(plain)) and not risks(qdq_layers(protected))
    row = protected.decisions["pair_sums"]["layers"]["w"]
    wider = np.asarray(protected.quant["w"].scale) / np.asarray(plain.quant["w"].scale)
    assert row["fix"] == "grid" and (wider >= 1).all() and 1 < wider.max() == pytest.approx(row["widened"], abs=1e-3)
    assert (wider[[c for c in range(64) if c not in row["channels"]]] == 1).all()   # only the channels at risk
    assert protected.quant["w"].zero_point == plain.quant["w"].zero_point == [0] * 64
    assert "1 on int8 grids no pair can saturate, judged on 8 calibration samples" in explain_lines(protected)[0]
    evals = [{"x": x} for x in bn_conv_data(8, 7)]   # 33.2 dB unprotected (27.2 in AVX2 kernels); the grid 32.8
    reference = from_proto(bn_conv_layer())
    assert _snr(plain, reference, evals) - 1 < _snr(protected, reference, evals) < _snr(plain, reference, evals)


def test_the_layer_of_issue_35_computes_the_same_with_uint8_weights():
    feeds = [{"x": x} for x in bn_conv_data(8, 1)]
    protected = quantize(from_proto(bn_conv_layer()), feeds, passes=UINT8)
    plain = quantize(from_proto(bn_conv_layer()), feeds, config={"cpu": "x86-64-vnni"})
    assert _weight_types(protected) == {"w": "uint8"} and _weight_types(plain) == {"w": "int8"}
    assert protected.quant["w"].zero_point == [128] * 64 and protected.quant["w"].scale == plain.quant["w"].scale
    for a, b in zip(_outputs(protected, feeds), _outputs(plain, feeds)):
        np.testing.assert_array_equal(a, b)
    assert risks(qdq_layers(plain)) and not qdq_layers(protected)   # no uint8 x int8 layer left
    record = protected.decisions["pair_sums"]
    assert record["protected"] and record["layers"]["w"]["fix"] == "uint8" and 10 < len(record["layers"]["w"]["channels"]) < 64
    line = explain_lines(protected)[0]
    assert line.startswith("int16 pair sums (cpu x86-64): 1 layer at risk, 1 with weights stored as uint8, judged on 8 "
                           "calibration samples: Conv 'conv'")
    assert record["layers"]["w"]["largest"] > 1 and record["layers"]["w"]["noise_db"] > 0   # its data does saturate
    assert "left as they are" in explain_lines(plain)[0]
    assert any("protect-pair-sums: stored as uint8" in why for why in protected.quant["w"].why)


def test_only_the_layers_at_risk_change():
    model = quantize(from_proto(two_convs()), _feeds())
    plain = quantize(from_proto(two_convs()), _feeds(), config={"cpu": "arm"})
    assert _weight_types(model) == {"w": "int8", "v": "int8"}
    assert model.quant["v"].scale == plain.quant["v"].scale and model.quant["w"].scale != plain.quant["w"].scale
    assert list(model.decisions["pair_sums"]["layers"]) == ["w"]
    assert _weight_types(quantize(from_proto(two_convs()), _feeds(), passes=UINT8)) == {"w": "uint8", "v": "int8"}
    optimized = session(model.to_proto()).get_providers()   # loads at the default optimization level
    assert optimized == ["CPUExecutionProvider"]


@pytest.mark.parametrize("passes", [None, UINT8])
def test_int8_activations_take_the_grid(passes):
    """onnxruntime fuses no int8 x uint8 layer: int8 activations take the pair-safe grid, even when
    uint8 is asked (it cannot be had)."""
    model = quantize(from_proto(bn_conv_layer()), [{"x": x} for x in bn_conv_data(4, 1)],
                     config={"activation_type": "int8"}, passes=passes)
    assert _weight_types(model) == {"w": "int8"} and not risks(qdq_layers(model))
    assert model.decisions["pair_sums"]["layers"]["w"]["fix"] == "grid"


def test_a_layer_neither_fix_can_take_is_named():
    from qpasses.testing import run_passes

    model = from_proto(parse(PAIR))
    config = {"activation_type": "int8", "tensor_overrides": {"w": [{"scale": 0.004, "zero_point": 0}]}}
    run_passes("annotate-types,calibrate,compute-qparams,protect-pair-sums", model, config, _pair_feeds(together=True))
    assert model.decisions["pair_sums"]["layers"]["w"]["fix"] == (
        "none: its scale was given; int8 activations (onnxruntime fuses no int8 x uint8 layer)")


@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
def test_matmul_and_gemm_weights_at_risk_are_widened(op):
    rng = np.random.default_rng(2)
    w = rng.laplace(0, 0.3, (16, 8))
    body = "y = MatMul(x, w)" if op == "MatMul" else "y = Gemm<transB=1>(x, w)"
    shape = (16, 8) if op == "MatMul" else (8, 16)
    model_proto = parse("""
g (float[2, 16] x) => (float[2, 8] y) <float[%d, %d] w = {%s}>
{ %s }""" % (*shape, _values(w if op == "MatMul" else w.T), body))
    feeds = [{"x": rng.normal(0, 1, (2, 16)).astype(np.float32)} for _ in range(8)]
    protected = quantize(from_proto(model_proto), feeds, passes=UINT8)
    plain = quantize(from_proto(model_proto), feeds, config={"cpu": "arm"})
    assert _weight_types(protected) == {"w": "uint8"} and _weight_types(plain) == {"w": "int8"}
    for a, b in zip(_outputs(protected, feeds), _outputs(plain, feeds)):
        np.testing.assert_array_equal(a, b)
    grid = quantize(from_proto(model_proto), feeds)
    assert _weight_types(grid) == {"w": "int8"} and risks(qdq_layers(plain)) and not risks(qdq_layers(grid))
    kernels = session(protected.to_proto())   # onnxruntime's integer kernels on this CPU
    for f, want in zip(feeds, _outputs(protected, feeds)):
        np.testing.assert_allclose(kernels.run(None, f)[0], want, atol=1e-3 * np.abs(want).max() + 1e-6)


@pytest.mark.parametrize("config,fix", [({"weight_type": "int8"}, "grid"),
                                        ({"tensor_overrides": {"w": [{"quant_type": "int8"}]}},
                                         "none: asymmetric int8 codes; int8 weights were asked for")])
def test_a_weight_type_asked_for_is_kept_and_named(config, fix):
    """A back end may need int8 weights: a type the config names is what the graph holds (uint8
    asked for cannot be had: the grid is taken, when its codes are symmetric)."""
    model = quantize(from_proto(bn_conv_layer()), [{"x": x} for x in bn_conv_data(4, 1)], config=config, passes=UINT8)
    assert _weight_types(model) == {"w": "int8"} and bool(risks(qdq_layers(model))) == (fix != "grid")
    assert model.decisions["pair_sums"]["layers"]["w"]["fix"] == fix


PAIR = """
g (float[1, 2, 4, 4] x) => (float[1, 1, 4, 4] y) <float[1, 2, 1, 1] w = {0.5, 0.25}>
{ y = Conv(x, w) }"""   # int8 codes 127 and 64: one pair, 127 + 64 > 128, at risk


def _pair_feeds(together: bool, n=8):
    """Non-negative inputs (zero point 0): the two channels rise together (the pair sums reach
    255 * 191, 149 % of int16), or channel 0 spans half the range and falls as channel 1 rises
    (about 127 * 127 + 64 * 0 at most: half of int16)."""
    rng = np.random.default_rng(3)
    feeds = []
    for _ in range(n):
        t = rng.random((1, 1, 4, 4)).astype(np.float32)
        t[0, 0, 0, 0] = 1.0
        feeds.append({"x": np.concatenate([t, t] if together else [0.5 * t, 1 - t], 1)})
    return feeds


def _protect(feeds, option=""):
    from qpasses.testing import run_passes

    model = from_proto(parse(PAIR))
    run_passes("annotate-types,calibrate,compute-qparams,protect-pair-sums" + option, model, data=feeds)
    return model


def test_a_layer_whose_data_stays_clear_of_int16_keeps_int8_and_says_why():
    model = _protect(_pair_feeds(together=False))
    row = model.decisions["pair_sums"]["layers"]["w"]
    assert _weight_types(model) == {"w": "int8"} and row["fix"] == "int8" and row["noise_db"] is None
    assert 0.4 < row["largest"] < 0.6
    assert row["why"] == f"largest pair sum on 8 calibration samples {row['largest']:.0%} of the int16 bound"
    assert model.quant["w"].why[-1] == f"protect-pair-sums: {row['why']}: left int8"
    assert "1 layer at risk, 1 left int8 (no measurable saturation), judged on 8 calibration samples: Conv" \
        in explain_lines(model)[0]


def test_a_layer_whose_data_saturates_is_protected_and_says_by_how_much():
    model = _protect(_pair_feeds(together=True))
    row = model.decisions["pair_sums"]["layers"]["w"]
    assert _weight_types(model) == {"w": "int8"} and row["fix"] == "grid"
    assert row["largest"] == 1.49 and row["noise_db"] > 10
    assert row["why"].startswith("largest pair sum on 8 calibration samples 149% of the int16 bound; saturating at 90% "
                                 "of it, the error power would be +")
    assert row["why"] in model.quant["w"].why[-1]


@pytest.mark.parametrize("option,why", [("{data=false}", "data=false: every layer at risk is protected"),
                                        ("{noise_db=100}", None)])
def test_data_false_protects_every_layer_at_risk_and_a_higher_bar_fewer(option, why):
    model = _protect(_pair_feeds(together=True), option)
    row = model.decisions["pair_sums"]["layers"]["w"]
    assert row["fix"] == ("grid" if why else "int8")
    assert why is None or (row["why"] == why and "largest" not in row)


def test_without_calibration_data_every_layer_at_risk_is_protected():
    from qpasses.testing import run_passes

    model = from_proto(parse(PAIR))
    run_passes("annotate-types,calibrate,compute-qparams", model, data=_pair_feeds(together=False))
    run_passes("protect-pair-sums{fix=uint8}", model)
    assert _weight_types(model) == {"w": "uint8"}
    assert model.decisions["pair_sums"]["layers"]["w"]["why"] == "no calibration data in this run"


def test_the_decision_is_the_same_bytes_run_after_run():
    feeds = _pair_feeds(together=False)
    first, second = (quantize(from_proto(two_convs()), _feeds()).to_proto().SerializeToString() for _ in range(2))
    assert first == second
    a, b = (_protect(feeds).decisions["pair_sums"] for _ in range(2))
    assert a == b
