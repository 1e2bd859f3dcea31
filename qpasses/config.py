"""Quantization configuration: snake_case keys, onnxruntime spellings accepted, every key checked."""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError
from .qtypes import qtype

CALIBRATION_METHODS = ("minmax", "percentile", "entropy", "mse", "pow2")


@dataclass
class CalibrationConfig:
    method: str = "percentile"   # measured best on the benchmark corpus (tools/README.md)
    percentile: float = 99.98      # asymmetric: 0.01 % cut on each side
    num_bins: int = 2048
    moving_average: bool = False
    averaging_constant: float = 0.01
    symmetric: bool = False  # percentile: clip |x| symmetrically
    clip_graph_outputs: bool = False  # clipping methods also clip graph outputs (default: full range)

    def __post_init__(self):
        self.method = _CALIB_ALIASES.get(str(self.method).lower(), str(self.method).lower())
        if self.method not in CALIBRATION_METHODS:
            raise ConfigError(f"calibration.method: unknown method '{self.method}' "
                              f"(expected one of {', '.join(CALIBRATION_METHODS)})")
        if not 0 < float(self.percentile) <= 100:
            raise ConfigError(f"calibration.percentile: {self.percentile} is not in (0, 100]")
        if int(self.num_bins) < 16:
            raise ConfigError(f"calibration.num_bins: {self.num_bins} is too small (at least 16)")


def method_given(calibration: CalibrationConfig) -> bool:
    """Whether the user chose the calibration method (written in a config, or not the default)."""
    written = getattr(calibration, "_given", None)
    return "method" in written if written is not None else calibration.method != CalibrationConfig.method


_CALIB_ALIASES = {"max": "minmax", "min_max": "minmax", "kl": "entropy", "distribution": "mse",
                  "nonoverflow": "pow2", "power_of_two": "pow2", "calibrationmethod.minmax": "minmax",
                  "calibrationmethod.entropy": "entropy", "calibrationmethod.percentile": "percentile"}


@dataclass
class QuantConfig:
    activation_type: str = "uint8"
    weight_type: str = "int8"
    per_channel: bool = True
    activation_symmetric: bool = False
    weight_symmetric: bool | None = None          # None: per-channel symmetric, per-tensor asymmetric
    activation_restricted_asymmetric: bool = False
    reduce_range: bool = False
    minimum_real_range: float | None = None
    scale_type: str = "float32"                   # or float16
    op_types_to_quantize: list[str] | None = None  # None: every supported op
    nodes_to_quantize: list[str] | None = None
    nodes_to_exclude: list[str] = field(default_factory=list)
    quantize_bias: bool = True
    fix_bias_scales: bool = True
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    tensor_overrides: dict = field(default_factory=dict)  # onnxruntime TensorQuantOverrides schema
    mixed_precision: dict = field(default_factory=dict)   # tensor -> type or {quant_type, symmetric}
    target: str | None = None                     # preset in qpasses/targets/<target>.json
    keep_removable_activations: bool = False      # keep Relu/Clip instead of merging them
    op_types_to_exclude_output_quantization: list[str] = field(default_factory=list)
    per_channel_axes: dict = field(default_factory=dict)  # op type -> weight channel axis
    force_quantize_no_input_check: bool = False   # quantize data-movement ops outside quantized regions

    def __post_init__(self):
        _check_types(self)
        self.activation_type = _qtype_name("activation_type", self.activation_type)
        self.weight_type = _qtype_name("weight_type", self.weight_type)
        self.nodes_to_exclude = list(self.nodes_to_exclude or [])
        self.op_types_to_quantize = list(self.op_types_to_quantize) if self.op_types_to_quantize else None
        self.nodes_to_quantize = list(self.nodes_to_quantize) if self.nodes_to_quantize else None
        if self.weight_symmetric is None:
            self.weight_symmetric = qtype(self.weight_type).signed
        if self.scale_type not in ("float32", "float16"):
            raise ConfigError(f"scale_type: '{self.scale_type}' is not float32 or float16")
        if isinstance(self.calibration, dict):
            written = frozenset(self.calibration)
            self.calibration = _build(CalibrationConfig, self.calibration, "calibration.")
            self.calibration._given = written
        if not isinstance(self.tensor_overrides, dict):
            raise ConfigError("tensor_overrides: expected a mapping of tensor name -> list of overrides")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def given(self) -> frozenset:
        """Keys the user wrote (load_config records them); else every key that differs from its default."""
        recorded = getattr(self, "_given", None)
        if recorded is not None:
            return recorded
        out = set()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "weight_symmetric":
                default = qtype(self.weight_type).signed
            elif f.default is not dataclasses.MISSING:
                default = f.default
            else:
                default = f.default_factory()
            if value != default:
                out.add(f.name)
        return frozenset(out)


def _qtype_name(key: str, value) -> str:
    try:
        return qtype(value).name
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from None


_BOOL_KEYS = ("per_channel", "activation_symmetric", "activation_restricted_asymmetric", "reduce_range",
              "quantize_bias", "fix_bias_scales", "keep_removable_activations",
              "force_quantize_no_input_check")
_LIST_KEYS = ("op_types_to_quantize", "nodes_to_quantize", "nodes_to_exclude",
              "op_types_to_exclude_output_quantization")


def _check_types(cfg: "QuantConfig") -> None:
    """One-line errors for values of the wrong kind (a string where a list belongs, ...)."""
    for key in _BOOL_KEYS:
        value = getattr(cfg, key)
        if type(value).__name__ not in ("bool", "bool_"):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        setattr(cfg, key, bool(value))
    if cfg.weight_symmetric is not None and not isinstance(cfg.weight_symmetric, bool):
        raise ConfigError(f"weight_symmetric: expected true, false or null, got {cfg.weight_symmetric!r}")
    for key in _LIST_KEYS:
        value = getattr(cfg, key)
        if value is not None and (isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set))
                                  or not all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{key}: expected a list of names, got {value!r}")
    if not isinstance(cfg.per_channel_axes, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in cfg.per_channel_axes.values()):
        raise ConfigError(f"per_channel_axes: expected a mapping of op type -> axis, got {cfg.per_channel_axes!r}")
    if cfg.target is not None and not isinstance(cfg.target, str):
        raise ConfigError(f"target: expected a preset name, got {cfg.target!r}")


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
    "calibrate_method": "calibration.method",
    "quant_format": None,
    "CalibMovingAverage": "calibration.moving_average",
    "CalibMovingAverageConstant": "calibration.averaging_constant",
    "CalibTensorRangeSymmetric": "calibration.symmetric",
    "CalibPercentile": "calibration.percentile",
    "CalibNumBins": "calibration.num_bins",
}
_INVERTED = {"QDQDisableWeightAdjustForInt32Bias": "fix_bias_scales"}
# onnxruntime options that change the result when set (truthy) and that qpasses does not implement
_UNSUPPORTED = ("SmoothQuant", "BlockSize")
_IGNORED = ("SmoothQuantAlpha", "SmoothQuantFolding", "MatMulConstBOnly")  # no effect without the above / on QDQ


def load_config(source=None) -> QuantConfig:
    """A QuantConfig from a dict, a JSON/YAML file path, or None (the defaults)."""
    if source is None:
        return QuantConfig()
    if isinstance(source, QuantConfig):
        return source
    if isinstance(source, (str, Path)):
        source = _read_file(Path(source))
    if not isinstance(source, dict):
        raise ConfigError("config: expected a mapping at the top level")
    data = _normalise(source)
    config = _build(QuantConfig, data, "")
    config._given = frozenset(data)
    if config.target is not None:
        from .targets import apply_target_defaults

        config = apply_target_defaults(config)
    return config


def _read_file(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: {'is a folder, expected a JSON or YAML file' if path.is_dir() else 'config file not found'}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {exc.start}); expected JSON or YAML") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return data if data is not None else {}


def _normalise(raw: dict) -> dict:
    """Map onnxruntime spellings onto our keys; flatten ``extra_options``."""
    out: dict = {}
    items = list(raw.items()) + list((raw.get("extra_options") or {}).items())
    for key, value in items:
        if key == "extra_options":
            continue
        if key in _IGNORED or (key in _UNSUPPORTED and not value):
            continue
        if key in _UNSUPPORTED:
            raise ConfigError(f"config: onnxruntime option '{key}' is not supported by qpasses")
        if key == "quant_format" and "qoperator" in str(getattr(value, "name", value)).lower():
            raise ConfigError("config: quant_format QOperator is not supported (qpasses writes QDQ models)")
        if key in _INVERTED:
            key, value = _INVERTED[key], not value
        elif key in ORT_NAMES:
            key = ORT_NAMES[key]
            if key is None:
                continue
        if key.startswith("calibration."):
            out.setdefault("calibration", {})[key.split(".", 1)[1]] = value
        elif key == "calibration" and isinstance(value, dict):
            out.setdefault("calibration", {}).update(value)
        else:
            out[key] = value
    return out


def _build(cls, data: dict, prefix: str):
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"config: unknown key '{prefix}{key}'{hint}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"config: {exc}") from None
