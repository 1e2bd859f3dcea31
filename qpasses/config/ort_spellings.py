"""onnxruntime's spellings of the configuration (quantize_static arguments, extra_options) mapped onto
qpasses' keys, and the wording of a key that is not a mapping."""
from __future__ import annotations


_MAPPING_EXAMPLES = {"calibration": " such as {method: minmax}", "extra_options": " of onnxruntime option -> value",
                     "mixed_precision": " of tensor name -> type"}


def not_a_mapping(key: str, value) -> str:
    return f"{key}: expected a mapping{_MAPPING_EXAMPLES.get(key, '')}, got {value!r}"


# onnxruntime names (quantize_static arguments and extra_options) -> our keys
ORT_NAMES = {
    "ActivationSymmetric": "activation_symmetric",
    "WeightSymmetric": "weight_symmetric",
    "ActivationRestrictedAsymmetric": "activation_restricted_asymmetric",
    "MinimumRealRange": "minimum_real_range",
    "TensorQuantOverrides": "tensor_overrides",
    "QuantizeBias": "quantize_bias",
    "ForceQuantizeNoInputCheck": "force_quantize_no_input_check",
    "QDQKeepRemovableActivations": "keep_removable_activations",
    "OpTypesToExcludeOutputQuantization": "op_types_to_exclude_output_quantization",
    "AddQDQPairToWeight": None,
    "DedicatedQDQPair": None,
    "CalibStridedMinMax": None,          # memory/speed only: calibration is streamed anyway
    "CalibMaxIntermediateOutputs": None,
    "QDQOpTypePerChannelSupportToAxis": "per_channel_axes",
    "UseQDQContribOps": None,
    "EnableSubgraph": None,
    "SmoothQuant": "smooth_quant",
    "calibrate_method": "calibration.method",
    "CalibMovingAverage": "calibration.moving_average",
    "CalibMovingAverageConstant": "calibration.averaging_constant",
    "CalibTensorRangeSymmetric": "calibration.symmetric",
    "CalibPercentile": "calibration.percentile",
    "CalibNumBins": "calibration.num_bins",
}
_INVERTED = {"QDQDisableWeightAdjustForInt32Bias": "fix_bias_scales"}
# onnxruntime options that change the result when set (truthy) and that qpasses does not implement
_UNSUPPORTED = ("BlockSize",)
_IGNORED = ("SmoothQuantAlpha", "SmoothQuantFolding", "MatMulConstBOnly")  # no effect without the above / on QDQ


def normalise(raw: dict, problems: list) -> dict:
    """Map onnxruntime spellings onto our keys; flatten ``extra_options``."""
    out: dict = {}
    extra = raw.get("extra_options")
    if not isinstance(extra, (dict, type(None))):
        problems.append(not_a_mapping("extra_options", extra))
        extra = None
    for key, value in list(raw.items()) + list((extra or {}).items()):
        if key == "extra_options":
            continue
        if not isinstance(key, str):
            out[key] = value  # reported by _build
            continue
        if key in _IGNORED or (key in _UNSUPPORTED and not value):
            continue
        if key in _UNSUPPORTED:
            problems.append(f"onnxruntime option '{key}' is not supported by qpasses")
            continue
        if key == "quant_format":   # onnxruntime's QuantFormat.QDQ / QOperator
            key, value = "format", str(getattr(value, "name", value)).lower()
        if key in _INVERTED:
            key, value = _INVERTED[key], not value
        elif key in ORT_NAMES:
            key = ORT_NAMES[key]
            if key is None:
                continue
        if key.startswith("calibration."):
            out.setdefault("calibration", {})[key.split(".", 1)[1]] = value
        elif key == "calibration":
            if isinstance(value, dict):
                out.setdefault("calibration", {}).update(value)
            else:
                problems.append(not_a_mapping("calibration", value))
        else:
            out[key] = value
    return out
