"""quantize-weights: RTN equal to onnxruntime's, both output forms in onnxruntime, Gemm, padding,
exclude, idempotence, GPTQ/AWQ/HQQ against RTN, errors."""
import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from qpasses.api import run_pipeline
from qpasses.config.quant_config import load_config
from qpasses.core.context import RunContext
from qpasses.core.pipeline import WEIGHT_ONLY_PIPELINE, default_pipeline
from qpasses.errors import CalibrationDataError, ConfigError
from qpasses.ir.model import from_proto
from qpasses.passes.quantize_weights import QuantizeWeights
from qpasses.weightonly.matmulnbits import nbits_inputs, pack_codes, unpack_codes
from qpasses.weightonly.rtn import quantize_rtn

RNG = np.random.default_rng(0)


def mlp(k=128, n=64, m=16, gemm_trans=False, outliers=False, layernorm=False):
    """x -> [LayerNorm] -> MatMul(w1) -> Relu -> Gemm(w2, b2) -> y; calibration feeds."""
    rng = np.random.default_rng(1)
    w1 = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((k, n) if gemm_trans else (n, k)) * 0.05).astype(np.float32)
    b2 = rng.standard_normal(k).astype(np.float32)
    nodes, inits, src = [], [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
                            numpy_helper.from_array(b2, "b2")], "x"
    if layernorm:
        gain = np.ones(k, np.float32)
        gain[:3] = 25.0
        inits += [numpy_helper.from_array(gain, "gain"), numpy_helper.from_array(np.zeros(k, np.float32), "beta")]
        nodes.append(helper.make_node("LayerNormalization", ["x", "gain", "beta"], ["ln"], name="ln", axis=-1))
        src = "ln"
    nodes += [helper.make_node("MatMul", [src, "w1"], ["h"], name="mm1"),
              helper.make_node("Relu", ["h"], ["r"], name="relu"),
              helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="gemm", transB=int(gemm_trans))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [m, k])],
                          [helper.make_tensor_value_info("y", 1, [m, k])], inits)
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    scale = np.ones(k, np.float32)
    if outliers:
        scale[:4] = 30.0
    feeds = [{"x": (rng.standard_normal((m, k)) * scale).astype(np.float32)} for _ in range(8)]
    return proto, feeds


def outputs(proto, feeds):
    s = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return [s.run(None, f)[0] for f in feeds]


def snr(ref, out):
    num = sum(float(np.sum(r.astype(np.float64) ** 2)) for r in ref)
    den = sum(float(np.sum((r.astype(np.float64) - o) ** 2)) for r, o in zip(ref, out))
    return 10 * np.log10(num / den)


def quantized(proto, feeds=None, **wo):
    model, records = run_pipeline(proto, config={"mode": "weight_only", "weight_only": wo}, calibration_data=feeds)
    out = model.to_proto()
    onnx.checker.check_model(out, full_check=True)
    return model, out, records


def ort_nbits(proto, bits, symmetric, block_size=32):
    pytest.importorskip("onnx_ir")
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    logging.disable(logging.INFO)
    q = MatMulNBitsQuantizer(onnx.ModelProto.FromString(proto.SerializeToString()),
                             algo_config=DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric,
                                                                      bits=bits))
    q.process()
    return q.model.model


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_plain_rtn_is_onnxruntimes_matmulnbits_bit_for_bit(bits, symmetric):
    proto, _ = mlp(k=96, n=40)
    theirs = ort_nbits(proto, bits, symmetric)
    node = next(n for n in theirs.graph.node if n.op_type == "MatMulNBits" and n.input[0] == "x")
    inits = {i.name: numpy_helper.to_array(i) for i in theirs.graph.initializer}
    w1 = numpy_helper.to_array(proto.graph.initializer[0])
    mine = nbits_inputs(quantize_rtn(w1, bits, 32, symmetric, refine=0))
    np.testing.assert_array_equal(inits[node.input[1]], mine["B"])
    np.testing.assert_array_equal(inits[node.input[2]].reshape(-1), mine["scales"])
    if symmetric:
        assert len(node.input) == 3 and mine["zero_points"] is None
    else:
        np.testing.assert_array_equal(inits[node.input[3]].reshape(-1), mine["zero_points"])


@pytest.mark.parametrize("bits", [4, 8])
def test_rtn_matmulnbits_at_least_onnxruntimes_rtn_in_onnxruntime(bits):
    proto, feeds = mlp(outliers=True)
    ref = outputs(proto, feeds)
    _, ours, _ = quantized(proto, bits=bits, format="matmulnbits", exclude=["gemm"])   # as onnxruntime: MatMul only
    assert [n.op_type for n in ours.graph.node] == ["MatMulNBits", "Relu", "Gemm"]
    theirs = ort_nbits(proto, bits, True)
    assert [n.op_type for n in theirs.graph.node] == ["MatMulNBits", "Relu", "Gemm"]
    assert snr(ref, outputs(ours, feeds)) >= snr(ref, outputs(theirs, feeds)) - 1e-6
    assert snr(ref, outputs(ours, feeds)) > (15 if bits == 4 else 40)


@pytest.mark.parametrize("symmetric", [True, False])
def test_qdq_and_matmulnbits_compute_the_same(symmetric):
    proto, feeds = mlp(k=80, gemm_trans=True)   # K = 80: the last block of 32 is padded
    model, qdq, _ = quantized(proto, format="qdq", symmetric=symmetric)
    assert [n.op_type for n in qdq.graph.node].count("DequantizeLinear") == 2
    assert qdq.opset_import[0].version >= 21
    dq = next(n for n in qdq.graph.node if n.op_type == "DequantizeLinear")
    assert {a.name: helper.get_attribute_value(a) for a in dq.attribute}["block_size"] == 32
    _, nbits, _ = quantized(proto, format="matmulnbits", symmetric=symmetric)
    a, b = outputs(qdq, feeds), outputs(nbits, feeds)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
    assert snr(outputs(proto, feeds), a) > 15
    assert "quantize-weights: rtn" in model.decisions["weight_only"]["w2"]


def test_exclude_idempotence_and_reload():
    proto, feeds = mlp()
    model, out, _ = quantized(proto, exclude=["gemm"])
    assert model.decisions["float"]["w2"]["reason"].startswith("excluded by weight_only.exclude")
    ctx = RunContext({"mode": "weight_only", "weight_only": {"exclude": ["w*2"]}})
    again = QuantizeWeights().run(from_proto(out), ctx)
    assert again.modified is False and again.stats == {"quantized": 0, "left_float": 1}
    assert sum(n.op_type == "Gemm" and n.input[1] == "w2" for n in out.graph.node) == 1


def test_nothing_to_do_on_activation_matmul():
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info("a", 1, [2, 32]), helper.make_tensor_value_info("b", 1, [32, 4])],
                          [helper.make_tensor_value_info("y", 1, [2, 4])])
    m = from_proto(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10))
    result = QuantizeWeights().run(m, RunContext({"mode": "weight_only"}))
    assert result.modified is False and result.stats["quantized"] == 0


@pytest.mark.parametrize("fmt", ["qdq", "matmulnbits"])
def test_gptq_and_awq_beat_rtn_with_outlier_channels(fmt):
    proto, feeds = mlp(k=128, n=96, outliers=True)
    ref = outputs(proto, feeds)
    scores = {alg: snr(ref, outputs(quantized(proto, feeds, algorithm=alg, format=fmt)[1], feeds))
              for alg in ("rtn", "gptq", "awq", "hqq")}
    scores["gptq_act_order"] = snr(ref, outputs(quantized(proto, feeds, algorithm="gptq", format=fmt,
                                                         act_order=True)[1], feeds))
    assert scores["gptq"] > scores["rtn"] + 1.0, scores
    assert scores["gptq_act_order"] > scores["rtn"] + 1.0, scores
    assert scores["awq"] > scores["rtn"] + 0.5, scores
    assert scores["hqq"] > scores["rtn"] - 1.5, scores


def test_awq_folds_into_a_layernorm_only_its_weights_read():
    proto, feeds = mlp(layernorm=True, outliers=False)
    _, out, _ = quantized(proto, feeds, algorithm="awq", format="matmulnbits")
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("Mul") <= 1 and ops[:2] == ["LayerNormalization", "MatMulNBits"]
    gain = next(numpy_helper.to_array(i) for i in out.graph.initializer if i.name == "gain")
    assert not np.allclose(gain[:3], 25.0)   # the input scales went into the gain
    assert snr(outputs(proto, feeds), outputs(out, feeds)) > 15


def test_data_algorithms_need_calibration_data():
    proto, _ = mlp()
    with pytest.raises(CalibrationDataError, match="gptq needs calibration data"):
        quantized(proto, algorithm="gptq")


def test_mode_chooses_the_pipeline_and_config_is_checked():
    assert default_pipeline(False, "weight_only") == default_pipeline(True, "weight_only") == WEIGHT_ONLY_PIPELINE
    proto, _ = mlp()
    _, _, records = quantized(proto)
    assert [r.name for r in records][-3:] == ["quantize-weights", "quantize-gathers", "cleanup"]
    cfg = load_config({"mode": "weight-only", "weight_only": {"algorithm": "DEFAULT", "quant_format": "QOperator",
                                                              "is_symmetric": False, "percdamp": 0.05}})
    assert (cfg.mode, cfg.weight_only.algorithm, cfg.weight_only.format) == ("weight_only", "rtn", "matmulnbits")
    assert cfg.weight_only.symmetric is False and cfg.weight_only.damping == 0.05
    with pytest.raises(ConfigError) as err:
        load_config({"mode": "dynamo", "weight_only": {"bits": 3, "block_size": 48, "format": "gguf", "exclude": "x"}})
    for part in ("mode: 'dynamo'", "weight_only.bits", "weight_only.block_size", "weight_only.format", "weight_only.exclude"):
        assert part in str(err.value)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trip(bits):
    codes = RNG.integers(0, 2 ** bits, size=(5, 3, 33)).astype(np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, 3, -(-33 * bits // 8))
    np.testing.assert_array_equal(unpack_codes(packed, bits, 33), codes)


@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_refit_never_raises_a_blocks_error(symmetric):
    from qpasses.weightonly.blocks import columns_of
    from qpasses.weightonly.rtn import search_clip, squared_error

    w = (RNG.standard_normal((96, 24)) * np.where(RNG.random((96, 1)) < 0.1, 8, 1)).astype(np.float32)
    blocks = columns_of(w, 32)
    errors = []
    for refine in (0, 1, 2):
        q = quantize_rtn(w, 4, 32, symmetric, refine=refine)
        assert q.columns and q.codes.max() <= 15
        errors.append(((q.dequantize() - w) ** 2).reshape(3, 32, 24).sum(axis=1))
    assert np.all(errors[1] <= errors[0] * (1 + 1e-5) + 1e-12) and np.all(errors[2] <= errors[1] * (1 + 1e-5) + 1e-12)
    assert errors[1].sum() < 0.99 * errors[0].sum()
    s, z = search_clip(blocks, 4, symmetric, axis=1)
    assert np.all(squared_error(blocks, s, z, 4, axis=1) <= errors[1] * (1 + 1e-5) + 1e-12)


def test_gptq_inverse_cholesky_is_the_upper_factor_of_the_damped_inverse():
    from qpasses.weightonly.gptq import inverse_cholesky

    a = RNG.standard_normal((300, 500))
    h = a @ a.T / 500
    u = inverse_cholesky(h, 0.01)
    damped = h + 0.01 * np.mean(np.diag(h)) * np.eye(300)
    np.testing.assert_allclose(u.T @ u, np.linalg.inv(damped), rtol=1e-8, atol=1e-10)
    assert np.allclose(u, np.triu(u)) and np.all(np.diag(u) > 0)
    np.testing.assert_allclose(u, np.linalg.cholesky(np.linalg.inv(damped)).T, rtol=1e-6, atol=1e-10)


def test_the_source_proto_is_left_as_it_was():
    """gs's export appended com.microsoft to the imported ModelProto's own opset list: a second run on
    the same proto object wrote other bytes (a QDQ model importing com.microsoft)."""
    proto, _ = mlp()
    before = proto.SerializeToString()
    for fmt in ("matmulnbits", "qdq"):
        ctx = RunContext(load_config({"mode": "weight_only", "weight_only": {"format": fmt}}))
        out = run_pipeline(proto, WEIGHT_ONLY_PIPELINE, ctx=ctx)[0].to_proto()
        assert proto.SerializeToString() == before
    assert [o.domain for o in out.opset_import] == [""]
