"""Config loading: our keys, onnxruntime spellings (arguments and extra_options), checks, given keys."""
import json
import re

import pytest
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

from qpasses.config.quant_config import QuantConfig, load_config
from qpasses.errors import ConfigError


def test_defaults():
    cfg = load_config(None)
    assert (cfg.activation_type, cfg.weight_type, cfg.weight_symmetric, cfg.per_channel) == \
        ("uint8", "int8", True, True)
    assert (cfg.calibration.method, cfg.calibration.percentile) == ("mse", 99.98)
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
    assert cfg.smooth_quant is False   # onnxruntime's SmoothQuant, off: smooth-quant does nothing
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
    ({"extra_options": {"SmoothQuant": "yes"}}, "smooth_quant: expected true or false"),
    ({"extra_options": {"BlockSize": 32}}, "onnxruntime option 'BlockSize' is not supported"),
    ({"quant_format": "QLinear"}, "format: 'qlinear' is not one of qdq, qoperator"),
    ({"format": "onnx"}, "format: 'onnx' is not one of qdq, qoperator"),
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


def test_every_problem_is_listed_on_one_line():
    with pytest.raises(ConfigError) as info:
        load_config({"bogus": 1, "activation_type": "int3", "per_chanel": True,
                     "calibration": {"percentile": "abc", "num_bins": "many"}})
    text = str(info.value)
    assert text.startswith("config: unknown key 'bogus'; unknown key 'per_chanel' (did you mean 'per_channel'?); ")
    for fragment in ("activation_type: unknown quantized type 'int3'", "calibration.percentile: expected a number",
                     "calibration.num_bins: expected an integer"):
        assert fragment in text
    assert "\n" not in text


def test_hand_built_config_lists_every_problem():
    with pytest.raises(ConfigError, match=r"^per_channel: expected true or false, got 3; weight_type: unknown"):
        QuantConfig(per_channel=3, weight_type="float")


@pytest.mark.parametrize("raw, fragment", [
    ({"calibration": {"percentile": "abc"}}, "calibration.percentile: expected a number in (0, 100], got 'abc'"),
    ({"calibration": {"percentile": 0}}, "calibration.percentile: expected a number in (0, 100], got 0"),
    ({"calibration": {"num_bins": "many"}}, "calibration.num_bins: expected an integer of at least 16, got 'many'"),
    ({"calibration": {"num_bins": 8}}, "calibration.num_bins: expected an integer of at least 16, got 8"),
    ({"calibration": {"averaging_constant": "x"}}, "calibration.averaging_constant: expected a number in [0, 1]"),
    ({"calibration": {"moving_average": "yes"}}, "calibration.moving_average: expected true or false"),
    ({"minimum_real_range": "abc"}, "minimum_real_range: expected a number >= 0 or null, got 'abc'"),
    ({"minimum_real_range": float("nan")}, "minimum_real_range: expected a number >= 0 or null, got nan"),
    ({"minimum_real_range": -0.5}, "minimum_real_range: expected a number >= 0 or null, got -0.5"),
    ({"calibration": "minmax"}, "calibration: expected a mapping such as {method: minmax}, got 'minmax'"),
    ({"calibrate_method": "entropy", "calibration": "minmax"}, "calibration: expected a mapping"),
    ({1: 2}, "unknown key 1 (keys are names)"),
    ({"extra_options": "abc"}, "extra_options: expected a mapping of onnxruntime option -> value, got 'abc'"),
    ({"extra_options": ["ActivationSymmetric"]}, "extra_options: expected a mapping"),
    ({"mixed_precision": "uint16"}, "mixed_precision: expected a mapping of tensor name -> type"),
    ({"ActivationSymetric": True}, "unknown key 'ActivationSymetric' (did you mean 'ActivationSymmetric'?)"),
])
def test_bad_values_are_config_errors(raw, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_valid_numbers_are_kept():
    cfg = load_config({"minimum_real_range": 0, "calibration": {"percentile": 100, "num_bins": 16,
                                                                "averaging_constant": 1}})
    assert cfg.minimum_real_range == 0.0 and cfg.calibration.percentile == 100.0
    assert (cfg.calibration.num_bins, cfg.calibration.averaging_constant) == (16, 1.0)


@pytest.mark.parametrize("text, fragment", [
    ("1: 2\n", "unknown key 1"),
    ("calibration: minmax\n", "calibration: expected a mapping"),
    ("bogus: 1\nactivation_type: int3\nper_chanel: true\n", "unknown key 'bogus'; unknown key 'per_chanel'"),
    ("calibration: {percentile: abc}\n", "calibration.percentile: expected a number"),
    ("minimum_real_range: .nan\n", "minimum_real_range: expected a number"),
    ("extra_options: [1, 2]\n", "extra_options: expected a mapping"),
])
def test_yaml_file_problems_exit_2_from_the_cli(tmp_path, capsys, text, fragment):
    from qpasses.cli import main
    from qpasses.cli.examples import write_example

    model, _, _ = write_example(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match="^" + re.escape(f"{cfg}: ")):
        load_config(cfg)
    code = main(["run", str(model), "-o", str(tmp_path / "out.onnx"), "--config", str(cfg)])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.onnx").exists()
