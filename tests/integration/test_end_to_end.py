"""The default pipeline end to end on the bundled example, against onnxruntime.quantization."""
import numpy as np
import onnx
import pytest

import qpasses
from qpasses.cli.examples import example_data, example_model
from qpasses.core.verify import check_onnx, check_ort
from qpasses.evaluation.evaluate import compare


def _feeds(n, seed):
    data = example_data(n, seed=seed)["input"]
    return [{"input": x} for x in data]


@pytest.fixture(scope="module")
def float_model():
    return example_model()


def _quantize(model, config=None):
    q = qpasses.quantize(model, _feeds(16, 1), config=config)
    proto = q.to_proto()
    check_onnx(proto)
    check_ort(proto)
    return q, proto


def _snr(float_model, proto):
    return compare(float_model, proto, _feeds(8, 2))["snr_db"]


def _ort_snr(float_model, tmp_path, per_channel=False):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(_feeds(16, 1))

        def get_next(self):
            return next(self.it, None)

    src, dst = tmp_path / "f.onnx", tmp_path / "ort.onnx"
    onnx.save(float_model, src)
    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return _snr(float_model, onnx.load(dst))


@pytest.mark.parametrize("per_channel", [False, True])
def test_at_least_as_accurate_as_onnxruntime(float_model, tmp_path, per_channel):
    # quantize_static quantizes every op it has a rule for (the Add too): so does this run
    # on CPUs with VNNI (onnxruntime's model computes there what it simulates); the default (cpu x86-64)
    # trades up to 1 dB of it for pair sums that cannot saturate on CPUs without VNNI (protect-pair-sums)
    config = {"per_channel": per_channel, "calibration": {"method": "minmax"}, "op_types_to_quantize": "all"}
    _, proto = _quantize(float_model, config | {"cpu": "x86-64-vnni"})
    _, default = _quantize(float_model, config)
    ours, theirs = _snr(float_model, proto), _ort_snr(float_model, tmp_path, per_channel)
    assert ours >= theirs - 0.1 and _snr(float_model, default) >= theirs - 1.0, (ours, theirs)
    ops = [n.op_type for n in default.graph.node]
    assert "BatchNormalization" not in ops and ops.count("QuantizeLinear") > 0


def test_mixed_precision_is_at_least_as_accurate_as_8_bit(float_model):
    _, base = _quantize(float_model)
    q, mixed = _quantize(float_model, {"mixed_precision": {"pool": "uint16"}})
    assert q.quant["pool"].qtype == "uint16"
    assert _snr(float_model, mixed) >= _snr(float_model, base) - 0.05
    # the Gemm reads 'flat' converted back to uint8: its bias scale must use the converted scale
    flat, bias = q.quant["flat"], q.quant["fc_b"]
    assert flat.convert is not None and "fc" in flat.convert.recv_nodes
    w = q.quant["fc_w"]
    np.testing.assert_allclose(bias.scale, np.float32(flat.convert.scale[0]) * np.asarray(w.scale, np.float32),
                               rtol=1e-6)


def test_table_survives_in_the_saved_model(float_model, tmp_path):
    q, _ = _quantize(float_model)
    path = qpasses.save(q, tmp_path / "q.onnx")
    again = qpasses.load(path)
    assert again.quant == q.quant
    assert {"calibrated", "qdq-inserted"} <= again.facts
