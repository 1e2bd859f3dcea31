"""Config loading: our keys, onnxruntime spellings (arguments and extra_options), checks, given keys."""
import json

import pytest
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

from qpasses.config import QuantConfig, load_config
from qpasses.errors import ConfigError


def test_defaults():
    cfg = load_config(None)
    assert (cfg.activation_type, cfg.weight_type, cfg.weight_symmetric, cfg.per_channel) == \
        ("uint8", "int8", True, True)
    assert (cfg.calibration.method, cfg.calibration.percentile) == ("percentile", 99.98)
    assert cfg.nodes_to_exclude == [] and cfg.op_types_to_quantize is None and cfg.given == frozenset()


@pytest.mark.parametrize("spelling, name", [
    ("QUInt16", "uint16"), ("quint16", "uint16"), ("QuantType.QUInt16", "uint16"), (QuantType.QUInt16, "uint16"),
    ("QInt8", "int8"), ("int16", "int16"), ("u8", "uint8"), (QuantType.QInt4, "int4"), ("UINT4", "uint4"),
])
def test_quant_type_spellings(spelling, name):
    assert load_config({"activation_type": spelling}).activation_type == name
    assert load_config({"weight_type": spelling}).weight_type == name


def test_onnxruntime_config_loads():
    cfg = load_config({
        "activation_type": QuantType.QUInt16, "weight_type": "QUInt8", "per_channel": True,
        "reduce_range": True, "calibrate_method": CalibrationMethod.Percentile, "quant_format": QuantFormat.QDQ,
        "nodes_to_exclude": None, "op_types_to_quantize": [],
        "extra_options": {
            "ActivationSymmetric": True, "WeightSymmetric": False, "ActivationRestrictedAsymmetric": True,
            "MinimumRealRange": 0.0001, "QuantizeBias": False, "QDQDisableWeightAdjustForInt32Bias": True,
            "QDQKeepRemovableActivations": True, "ForceQuantizeNoInputCheck": True,
            "OpTypesToExcludeOutputQuantization": ["Conv"], "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1},
            "CalibPercentile": 99.9, "CalibTensorRangeSymmetric": True, "CalibMovingAverage": True,
            "CalibMovingAverageConstant": 0.05, "CalibNumBins": 1024, "DedicatedQDQPair": False,
            "AddQDQPairToWeight": False, "UseQDQContribOps": True, "CalibStridedMinMax": 4,
            "TensorQuantOverrides": {"x": [{"quant_type": QuantType.QUInt8}]}, "SmoothQuant": False,
            "SmoothQuantAlpha": 0.5, "BlockSize": 0, "MatMulConstBOnly": True,
        }})
    assert (cfg.activation_type, cfg.weight_type, cfg.per_channel, cfg.reduce_range) == ("uint16", "uint8", True, True)
    assert (cfg.activation_symmetric, cfg.weight_symmetric, cfg.activation_restricted_asymmetric) == (True, False, True)
    assert (cfg.minimum_real_range, cfg.quantize_bias, cfg.fix_bias_scales) == (0.0001, False, False)
    assert (cfg.keep_removable_activations, cfg.force_quantize_no_input_check) == (True, True)
    assert cfg.op_types_to_exclude_output_quantization == ["Conv"] and cfg.per_channel_axes == {"MatMul": 1}
    assert cfg.nodes_to_exclude == [] and cfg.op_types_to_quantize is None
    cal = cfg.calibration
    assert (cal.method, cal.percentile, cal.symmetric, cal.moving_average, cal.averaging_constant, cal.num_bins) == \
        ("percentile", 99.9, True, True, 0.05, 1024)
    assert "x" in cfg.tensor_overrides
    assert {"activation_symmetric", "tensor_overrides", "calibration", "per_channel"} <= cfg.given
    assert "scale_type" not in cfg.given


@pytest.mark.parametrize("method, name", [
    ("MinMax", "minmax"), ("Entropy", "entropy"), ("Percentile", "percentile"), ("Distribution", "mse"),
    (CalibrationMethod.Entropy, "entropy"), ("kl", "entropy"), ("max", "minmax"),
])
def test_calibration_method_spellings(method, name):
    assert load_config({"calibrate_method": method}).calibration.method == name


@pytest.mark.parametrize("raw, fragment", [
    ({"activation_typ": "uint8"}, "unknown key 'activation_typ' (did you mean 'activation_type'?)"),
    ({"calibration": {"methd": "minmax"}}, "unknown key 'calibration.methd' (did you mean 'calibration.method'?)"),
    ({"activation_type": "uint3"}, "activation_type: unknown quantized type 'uint3'"),
    ({"weight_type": "float"}, "weight_type: unknown quantized type"),
    ({"per_channel": "yes"}, "per_channel: expected true or false, got 'yes'"),
    ({"weight_symmetric": 1}, "weight_symmetric: expected true, false or null"),
    ({"nodes_to_exclude": "conv"}, "nodes_to_exclude: expected a list of names"),
    ({"op_types_to_quantize": ["Conv", 3]}, "op_types_to_quantize: expected a list of names"),
    ({"per_channel_axes": {"Conv": "0"}}, "per_channel_axes: expected a mapping"),
    ({"scale_type": "float64"}, "scale_type: 'float64' is not float32 or float16"),
    ({"tensor_overrides": []}, "tensor_overrides: expected a mapping"),
    ({"calibrate_method": "median"}, "calibration.method: unknown method 'median'"),
    ({"extra_options": {"SmoothQuant": True}}, "onnxruntime option 'SmoothQuant' is not supported"),
    ({"extra_options": {"BlockSize": 32}}, "onnxruntime option 'BlockSize' is not supported"),
    ({"quant_format": "QOperator"}, "quant_format QOperator is not supported"),
    ({"target": 3}, "target: expected a preset name"),
    ([1, 2], "expected a mapping at the top level"),
])
def test_config_errors_are_one_line(raw, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_files(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"activation_type": "QUInt16", "extra_options": {"WeightSymmetric": False}}))
    cfg = load_config(path)
    assert (cfg.activation_type, cfg.weight_symmetric) == ("uint16", False)
    yml = tmp_path / "cfg.yaml"
    yml.write_text("activation_type: QInt8\nper_channel: yes\ncalibration:\n  method: entropy\n")
    cfg = load_config(str(yml))
    assert (cfg.activation_type, cfg.per_channel, cfg.calibration.method) == ("int8", True, "entropy")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.json")


def test_weight_symmetric_follows_the_weight_type_unless_given():
    assert load_config({"weight_type": "uint8"}).weight_symmetric is False
    assert load_config({"weight_type": "int16"}).weight_symmetric is True
    assert load_config({"weight_type": "uint8", "weight_symmetric": True}).weight_symmetric is True


def test_given_keys():
    assert load_config({"activation_type": "uint8"}).given == frozenset({"activation_type"})
    # hand-built configs: a key counts as given when it differs from its default
    assert QuantConfig(activation_type="uint16", weight_type="uint8").given == {"activation_type", "weight_type"}
    assert QuantConfig(weight_type="uint8", weight_symmetric=True).given == {"weight_type", "weight_symmetric"}


def test_load_config_passes_a_config_through():
    cfg = QuantConfig(per_channel=True)
    assert load_config(cfg) is cfg
