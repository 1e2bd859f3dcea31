"""quantize-weights with MX schemes: the stored elements and power-of-two scales bit by bit, the
block layout, onnxruntime's output against numpy on the decoded weights, exponent choice, GPTQ and
AWQ, refused configs (exit 2)."""
import json

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses.cli import main
from qpasses.config.quant_config import load_config
from qpasses.errors import ConfigError
from qpasses.weightonly.mx import ELEMENTS, block_error, choose_exponents, exponent_bounds, ocp_exponents, quantize_mx

from tests.passes.test_quantize_weights import mlp, outputs, quantized, snr

SCHEMES = ["mxint8", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"]
STORED = {"mxint8": TensorProto.INT8, "mxfp8_e4m3": TensorProto.FLOAT8E4M3FN,
          "mxfp8_e5m2": TensorProto.FLOAT8E5M2, "mxfp4": TensorProto.FLOAT8E4M3FN}
E2M1 = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


def decoded(out):
    """{weight: (codes as float [K, N] or [N, K], scale, axis)} read back from the DequantizeLinears."""
    inits = {i.name: i for i in out.graph.initializer}
    found = {}
    for n in out.graph.node:
        if n.op_type == "DequantizeLinear":
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            assert attrs["block_size"] == 32 and len(n.input) == 2   # no zero point
            x, s = inits[n.input[0]], inits[n.input[1]]
            found[n.output[0]] = (x.data_type, numpy_helper.to_array(x).astype(np.float32),
                                  numpy_helper.to_array(s), attrs["axis"])
    return found


def dequantized(codes, scale, axis):
    return codes * np.repeat(scale, 32, axis=axis)[:codes.shape[0]] if axis == 0 else \
        codes * np.repeat(scale, 32, axis=axis)[:, :codes.shape[1]]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_elements_scales_and_layout_bit_by_bit(scheme):
    proto, feeds = mlp(k=80, n=48, gemm_trans=True)   # K = 80 and 48 (last blocks of 16); the Gemm's W^T [N, K]
    model, out, _ = quantized(proto, scheme=scheme)
    assert out.opset_import[0].version == 21
    assert model.decisions["weight_only"]["w1"] == f"quantize-weights: rtn {scheme} block 32 along K -> qdq"
    dqs = decoded(out)
    assert len(dqs) == 2
    for (name, k, axis_k), (data_type, codes, scale, axis) in zip((("w1", 80, 0), ("w2", 48, 1)), dqs.values()):
        assert data_type == STORED[scheme] and scale.dtype == np.float32 and axis == axis_k, name
        assert codes.shape[axis] == k and scale.shape[axis] == -(-k // 32) and scale.shape[1 - axis] == codes.shape[1 - axis]
        mantissa, exps = np.frexp(scale)
        assert np.all(mantissa == 0.5), "scales are exact powers of two"
        e8m0 = exps - 1 + ELEMENTS[scheme].implicit
        assert e8m0.min() >= -127 and e8m0.max() <= 127
        assert np.all(np.isfinite(codes))
        if scheme == "mxint8":
            assert np.abs(codes).max() <= 127 and np.all(codes == np.rint(codes))
        if scheme == "mxfp4":
            assert set(np.abs(codes).ravel().tolist()) <= E2M1
    # the numbers the model computes: onnxruntime (no fusion) against numpy on the decoded weights
    w1 = dequantized(*dqs["w1_dequantized"][1:])
    w2t = dequantized(*dqs["w2_dequantized"][1:])
    b2 = numpy_helper.to_array(next(i for i in out.graph.initializer if i.name == "b2"))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(out.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    ref = outputs(proto, feeds)
    for f in feeds:
        want = np.maximum(f["x"] @ w1, 0) @ w2t.T + b2
        np.testing.assert_allclose(plain.run(None, f)[0], want, rtol=1e-5, atol=1e-5)
    # default optimisation loads and runs (int8 DequantizeLinear + MatMul becomes MatMulNBits there)
    assert snr(ref, outputs(out, feeds)) > {"mxint8": 35, "mxfp8_e4m3": 30, "mxfp8_e5m2": 25, "mxfp4": 18}[scheme]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_mx_matches_the_spec_exponent_and_the_search_is_never_worse(scheme):
    el = ELEMENTS[scheme]
    w = (np.random.default_rng(3).standard_normal((96, 40)) * np.geomspace(1e-3, 10, 40)).astype(np.float32)
    w[:32, 0] = 0.0   # an all-zero block
    spec = quantize_mx(w, scheme, neighbours=(0,))
    blocks = w.reshape(3, 32, 40)
    amax = np.abs(blocks).max(axis=1)
    top = amax / spec.scales()
    live = amax > 0
    assert np.all(top[live] >= 2.0 ** el.emax) and np.all(top[live] < 2.0 ** (el.emax + 1))
    assert spec.exponents[0, 0] == exponent_bounds(el, np.float32)[0] and np.all(spec.codes[:, :, 0][0] == 0)
    # the stored elements are the spec's rounding of w / scale (ties to even, saturating)
    np.testing.assert_array_equal(spec.codes.astype(np.float32), el.round(blocks / spec.scales()[:, None, :]))
    best = quantize_mx(w, scheme)
    assert np.all(np.abs(best.exponents - spec.exponents) <= 1)
    e_spec = block_error(blocks, spec.exponents, el)
    e_best = block_error(blocks, best.exponents, el)
    assert np.all(e_best <= e_spec) and np.sum(e_best) <= np.sum(e_spec)
    np.testing.assert_array_equal(choose_exponents(blocks, el, exponent_bounds(el, np.float32), neighbours=(0,)),
                                  ocp_exponents(amax, el, exponent_bounds(el, np.float32)))
    np.testing.assert_allclose(best.dequantize(), (best.codes.astype(np.float32) * best.scales()[:, None]).reshape(96, 40))


def test_float16_model_keeps_float16_power_of_two_scales():
    proto, feeds = mlp(k=64, n=32)
    for init in proto.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for v in list(proto.graph.input) + list(proto.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    _, out, _ = quantized(proto, scheme="mxfp8_e4m3")
    for _, _, scale, _ in decoded(out).values():
        assert scale.dtype == np.float16 and np.all(np.frexp(scale.astype(np.float32))[0] == 0.5)
    f16 = [{"x": f["x"].astype(np.float16)} for f in feeds]
    assert snr(outputs(proto, f16), outputs(out, f16)) > 25


@pytest.mark.parametrize("scheme", ["mxint8", "mxfp4"])
def test_gptq_and_awq_with_mx(scheme):
    proto, feeds = mlp(k=128, n=96, outliers=True)
    ref = outputs(proto, feeds)
    scores = {}
    for alg, extra in (("rtn", {}), ("gptq", {}), ("gptq_act_order", {"act_order": True}), ("awq", {})):
        model, out, _ = quantized(proto, feeds, scheme=scheme, algorithm=alg.split("_")[0], **extra)
        for data_type, codes, scale, _ in decoded(out).values():
            assert data_type == STORED[scheme] and np.all(np.frexp(scale)[0] == 0.5)
            if scheme == "mxfp4":
                assert set(np.abs(codes).ravel().tolist()) <= E2M1
        scores[alg] = snr(ref, outputs(out, feeds))
    assert scores["gptq"] > scores["rtn"] + 1.0, scores
    assert scores["gptq_act_order"] > scores["rtn"] + 0.5, scores
    assert scores["awq"] > scores["rtn"], scores


@pytest.mark.parametrize("wo, fragment", [
    ({"scheme": "mxfp4", "format": "matmulnbits"}, "weight_only.format: MatMulNBits holds integer codes"),
    ({"scheme": "mxint8", "block_size": 64}, "weight_only.block_size: scheme mxint8 fixes blocks of 32"),
    ({"scheme": "mxfp8_e4m3", "symmetric": False}, "weight_only.symmetric: scheme mxfp8_e4m3 is symmetric"),
    ({"scheme": "mxint8", "bits": 4}, "weight_only.bits: scheme mxint8 has 8-bit elements"),
    ({"scheme": "mxfp4", "algorithm": "hqq"}, "weight_only.algorithm: hqq optimises a zero point"),
    ({"scheme": "nvfp4"}, "weight_only.scheme: 'nvfp4' is not one of"),
])
def test_refused_configs_exit_2_with_one_line(wo, fragment, tmp_path, capsys):
    proto, _ = mlp()
    onnx.save(proto, tmp_path / "m.onnx")
    (tmp_path / "c.json").write_text(json.dumps({"mode": "weight_only", "weight_only": wo}))
    code = main(["run", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q.onnx"), "--config", str(tmp_path / "c.json")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and fragment in lines[0], lines
    assert not (tmp_path / "q.onnx").exists()
    with pytest.raises(ConfigError, match=fragment.split(":")[0]):
        load_config({"mode": "weight_only", "weight_only": wo})


def test_mx_scheme_sets_the_element_bits():
    assert load_config({"mode": "weight_only", "weight_only": {"scheme": "MXINT8"}}).weight_only.bits == 8
    assert load_config({"mode": "weight_only", "weight_only": {"scheme": "mxfp4", "bits": 4}}).weight_only.bits == 4
    e2m1 = np.array(sorted(E2M1), np.float32)   # mxfp4's float8 storage holds every E2M1 value exactly
    np.testing.assert_array_equal(e2m1.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), e2m1)
    np.testing.assert_array_equal(e2m1.astype(ml_dtypes.float4_e2m1fn).astype(np.float32), e2m1)
