"""protect-pair-sums: the weights of layers whose int8 pair sums could saturate int16 (x86-64 without
VNNI) are stored as uint8 on the same grid; nothing else changes, and the model computes the same."""
import numpy as np
import pytest

from qpasses.analysis.saturation import qdq_layers, risks
from qpasses.api import quantize
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


def test_the_layer_of_issue_35_computes_the_same_with_uint8_weights():
    feeds = [{"x": x} for x in bn_conv_data(8, 1)]
    protected = quantize(from_proto(bn_conv_layer()), feeds)
    plain = quantize(from_proto(bn_conv_layer()), feeds, config={"cpu": "x86-64-vnni"})
    assert _weight_types(protected) == {"w": "uint8"} and _weight_types(plain) == {"w": "int8"}
    assert protected.quant["w"].zero_point == [128] * 64 and protected.quant["w"].scale == plain.quant["w"].scale
    for a, b in zip(_outputs(protected, feeds), _outputs(plain, feeds)):
        np.testing.assert_array_equal(a, b)
    assert risks(qdq_layers(plain)) and not qdq_layers(protected)   # no uint8 x int8 layer left
    record = protected.decisions["pair_sums"]
    assert record["protected"] and record["layers"]["w"]["fix"] == "uint8" and 10 < len(record["layers"]["w"]["channels"]) < 64
    line = explain_lines(protected)[0]
    assert line.startswith("int16 pair sums (cpu x86-64): 1 layer at risk, 1 with weights stored as uint8: Conv 'conv'")
    assert "left as they are" in explain_lines(plain)[0]
    assert any("protect-pair-sums: stored as uint8" in why for why in protected.quant["w"].why)


def test_only_the_layers_at_risk_change():
    model = quantize(from_proto(two_convs()), _feeds())
    assert _weight_types(model) == {"w": "uint8", "v": "int8"}
    assert list(model.decisions["pair_sums"]["layers"]) == ["w"]
    optimized = session(model.to_proto()).get_providers()   # loads at the default optimization level
    assert optimized == ["CPUExecutionProvider"]


def test_int8_activations_are_named_not_changed():
    """onnxruntime fuses no int8 x uint8 layer: those stay int8 and the decision says why."""
    model = quantize(from_proto(bn_conv_layer()), [{"x": x} for x in bn_conv_data(4, 1)],
                     config={"activation_type": "int8"})
    assert _weight_types(model) == {"w": "int8"}
    assert model.decisions["pair_sums"]["layers"]["w"]["fix"].startswith("none: int8 activations")


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
    protected = quantize(from_proto(model_proto), feeds)
    plain = quantize(from_proto(model_proto), feeds, config={"cpu": "arm"})
    assert _weight_types(protected) == {"w": "uint8"} and _weight_types(plain) == {"w": "int8"}
    for a, b in zip(_outputs(protected, feeds), _outputs(plain, feeds)):
        np.testing.assert_array_equal(a, b)
    kernels = session(protected.to_proto())   # onnxruntime's integer kernels on this CPU
    for f, want in zip(feeds, _outputs(protected, feeds)):
        np.testing.assert_allclose(kernels.run(None, f)[0], want, atol=1e-3 * np.abs(want).max() + 1e-6)


@pytest.mark.parametrize("config", [{"weight_type": "int8"}, {"tensor_overrides": {"w": [{"quant_type": "int8"}]}}])
def test_a_weight_type_asked_for_is_kept_and_named(config):
    """A back end may need int8 weights: a type the config names is what the graph holds."""
    model = quantize(from_proto(bn_conv_layer()), [{"x": x} for x in bn_conv_data(4, 1)], config=config)
    assert _weight_types(model) == {"w": "int8"}
    assert model.decisions["pair_sums"]["layers"]["w"]["fix"] == "none: int8 weights were asked for"
