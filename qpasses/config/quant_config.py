"""Quantization configuration: snake_case keys, onnxruntime spellings accepted, every key checked."""
from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..quant.qtypes import QTYPES, qtype
from .checks import Problems as _Problems, boolean as _boolean, build as _build, number as _number
from .ort_spellings import normalise, not_a_mapping

CALIBRATION_METHODS = ("minmax", "percentile", "entropy", "mse", "pow2")


@dataclass
class CalibrationConfig:
    method: str = "mse"   # measured best on the task metrics (tools/README.md, "Spread over calibration draws")
    percentile: float = 99.98      # asymmetric: 0.01 % cut on each side
    num_bins: int = 2048
    moving_average: bool = False
    averaging_constant: float = 0.01
    symmetric: bool = False  # percentile: clip |x| symmetrically
    clip_graph_outputs: bool = False  # clipping methods also clip graph outputs (default: full range)

    def __post_init__(self):
        problems = _Problems()
        self.method = _CALIB_ALIASES.get(str(self.method).lower(), str(self.method).lower())
        if self.method not in CALIBRATION_METHODS:
            problems.append(f"calibration.method: unknown method '{self.method}' "
                            f"(expected one of {', '.join(CALIBRATION_METHODS)})")
        self.percentile = _number(problems, "calibration.percentile", self.percentile,
                                  lambda v: 0 < v <= 100, "a number in (0, 100]")
        self.averaging_constant = _number(problems, "calibration.averaging_constant", self.averaging_constant,
                                          lambda v: 0 <= v <= 1, "a number in [0, 1]")
        if isinstance(self.num_bins, numbers.Integral) and not isinstance(self.num_bins, bool) \
                and self.num_bins >= 16:
            self.num_bins = int(self.num_bins)
        else:
            problems.append(f"calibration.num_bins: expected an integer of at least 16, got {self.num_bins!r}")
        for key in ("moving_average", "symmetric", "clip_graph_outputs"):
            _boolean(problems, self, key, "calibration.")
        problems.raise_if_any()


ACCURACY_METRICS = ("snr", "cosine", "top1")
ACCURACY_FALLBACKS = ("float", "uint16", "int16")


@dataclass
class AccuracyConfig:
    """What search-precision aims for: the worst output component's ``metric`` >= ``target``."""

    metric: str = "snr"
    target: float | None = None    # None: search-precision's own default (12 dB)
    fallback: str = "float"         # what promoted tensors become
    aim: float | None = None       # beyond the target, within keep_8bit (None: 25 dB when no target is given)
    keep_8bit: float = 0.8         # share of the weighted ops' int8 latency gain kept 8-bit while aiming

    def __post_init__(self):
        problems = _Problems()
        if self.metric not in ACCURACY_METRICS:
            problems.append(f"accuracy.metric: {self.metric!r} is not one of {', '.join(ACCURACY_METRICS)}")
        if self.fallback not in ACCURACY_FALLBACKS:
            problems.append(f"accuracy.fallback: {self.fallback!r} is not one of {', '.join(ACCURACY_FALLBACKS)}")
        if self.target is not None:
            self.target = _number(problems, "accuracy.target", self.target, lambda v: True, "a number")
        if self.aim is not None:
            self.aim = _number(problems, "accuracy.aim", self.aim, lambda v: True, "a number")
        self.keep_8bit = _number(problems, "accuracy.keep_8bit", self.keep_8bit, lambda v: 0 <= v <= 1,
                                 "a share between 0 and 1")
        problems.raise_if_any()


def method_given(calibration: CalibrationConfig) -> bool:
    """Whether the user chose the calibration method (written in a config, or not the default)."""
    written = getattr(calibration, "_given", None)
    return "method" in written if written is not None else calibration.method != CalibrationConfig.method


_CALIB_ALIASES = {"max": "minmax", "min_max": "minmax", "kl": "entropy", "distribution": "mse",
                  "nonoverflow": "pow2", "power_of_two": "pow2", "calibrationmethod.minmax": "minmax",
                  "calibrationmethod.entropy": "entropy", "calibrationmethod.percentile": "percentile"}


# the CPUs a model is quantized for (``cpu``): whether onnxruntime's uint8 x int8 kernels there sum
# product pairs in int16, saturating (qpasses.analysis.saturation; protect-pair-sums protects them)
CPUS = {"x86-64": "any x86-64 CPU (AVX2 or AVX-512 without VNNI: pair sums saturate in int16)",
        "x86-64-vnni": "x86-64 with VNNI (AVX512-VNNI or AVX-VNNI: sums in int32)",
        "arm": "ARM64 (sums in int32)"}
PAIR_SATURATING_CPUS = frozenset({"x86-64"})
MODES = ("static", "weight_only", "dynamic")    # pipeline.MODE_PIPELINES: the default pipeline of each mode
FORMATS = ("qdq", "qoperator")
EFFORTS = ("default", "high")   # pipeline.default_pipeline: high reconstructs the weights (reconstruct-weights)
# how a weight the input model computes (a Constant node's value, or ops on initializers: fold-constants
# records them) is quantized: as a weight, or as onnxruntime's quantize_static does, as an activation
COMPUTED_WEIGHTS = ("weight", "activation")


@dataclass
class QuantConfig:
    mode: str = "static"                          # weight_only | dynamic: pipeline.default_pipeline
    format: str = "qdq"                           # qoperator: lower-qoperator rewrites node units
    effort: str = "default"                       # one of EFFORTS
    activation_type: str = "uint8"
    weight_type: str = "int8"
    per_channel: bool = True
    activation_symmetric: bool = False
    weight_symmetric: bool | None = None          # None: per-channel symmetric, per-tensor asymmetric
    activation_restricted_asymmetric: bool = False
    reduce_range: bool = False
    minimum_real_range: float | None = None
    scale_type: str = "float32"                   # or float16
    op_types_to_quantize: list[str] | str | None = None  # None: oprules.DEFAULT_OP_TYPES; "all": every rule
    nodes_to_quantize: list[str] | None = None
    nodes_to_exclude: list[str] = field(default_factory=list)
    quantize_bias: bool = True
    fix_bias_scales: bool = True
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    accuracy: AccuracyConfig = field(default_factory=AccuracyConfig)
    tensor_overrides: dict = field(default_factory=dict)  # onnxruntime TensorQuantOverrides schema
    mixed_precision: dict = field(default_factory=dict)   # tensor -> type or {quant_type, symmetric}
    target: str | None = None                     # preset in qpasses/config/targets/<target>.json
    cpu: str = "x86-64"                           # one of CPUS: which int8 kernels the model must not saturate
    keep_removable_activations: bool = False      # keep Relu/Clip instead of merging them
    computed_weights: str = "weight"              # one of COMPUTED_WEIGHTS
    op_types_to_exclude_output_quantization: list[str] = field(default_factory=list)
    per_channel_axes: dict = field(default_factory=dict)  # op type -> weight channel axis
    force_quantize_no_input_check: bool = False   # quantize data-movement ops outside quantized regions
    smooth_quant: bool = True                     # false: smooth-quant does nothing (onnxruntime's SmoothQuant default)
    executor: str = "local"                       # local | ray | ray:ADDRESS (qpasses.executors)
    weight_only: object = field(default_factory=lambda: _weight_only({}))  # weightonly.config.WeightOnlyConfig

    def __post_init__(self):
        problems = _Problems()
        _check_types(self, problems)
        self.activation_type = _qtype_name(problems, "activation_type", self.activation_type)
        self.weight_type = _qtype_name(problems, "weight_type", self.weight_type)
        if self.weight_symmetric is None and self.weight_type in QTYPES:
            self.weight_symmetric = qtype(self.weight_type).signed
        self.mode = str(self.mode).lower().replace("-", "_")
        for key, allowed in (("mode", MODES), ("format", FORMATS), ("effort", EFFORTS), ("cpu", tuple(CPUS)),
                             ("computed_weights", COMPUTED_WEIGHTS)):
            if getattr(self, key) not in allowed:
                problems.append(f"{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if self.scale_type not in ("float32", "float16"):
            problems.append(f"scale_type: {self.scale_type!r} is not float32 or float16")
        if self.minimum_real_range is not None:
            self.minimum_real_range = _number(problems, "minimum_real_range", self.minimum_real_range,
                                              lambda v: v >= 0, "a number >= 0 or null")
        if isinstance(self.calibration, dict):
            written = frozenset(self.calibration)
            self.calibration = _build(CalibrationConfig, self.calibration, "calibration.", problems)
            if self.calibration is not None:
                self.calibration._given = written
        elif not isinstance(self.calibration, CalibrationConfig):
            problems.append(not_a_mapping("calibration", self.calibration))
        if isinstance(self.accuracy, dict):
            self.accuracy = _build(AccuracyConfig, self.accuracy, "accuracy.", problems)
        elif not isinstance(self.accuracy, AccuracyConfig):
            problems.append(not_a_mapping("accuracy", self.accuracy))
        if isinstance(self.weight_only, dict):
            try:
                self.weight_only = _weight_only(self.weight_only)
            except ConfigError as exc:
                problems.take(exc)
        elif type(self.weight_only).__name__ != "WeightOnlyConfig":
            problems.append(not_a_mapping("weight_only", self.weight_only))
        if not isinstance(self.tensor_overrides, dict):
            problems.append("tensor_overrides: expected a mapping of tensor name -> list of overrides")
        if not isinstance(self.mixed_precision, dict):
            problems.append(not_a_mapping("mixed_precision", self.mixed_precision))
        try:   # issue 18: where calibration shards and scored variants run
            from ..executors import parse

            parse(self.executor)
        except ConfigError as exc:
            problems.append(str(exc))
        problems.raise_if_any()

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


def _weight_only(data: dict):
    from ..weightonly.config import build

    return build(data)


def _qtype_name(problems: list, key: str, value):
    try:
        return qtype(value).name
    except ConfigError as exc:
        problems.append(f"{key}: {exc}")
        return value


_BOOL_KEYS = ("per_channel", "activation_symmetric", "activation_restricted_asymmetric", "reduce_range",
              "quantize_bias", "fix_bias_scales", "keep_removable_activations",
              "force_quantize_no_input_check", "smooth_quant")
_LIST_KEYS = ("op_types_to_quantize", "nodes_to_quantize", "nodes_to_exclude",
              "op_types_to_exclude_output_quantization")


def _check_types(cfg: "QuantConfig", problems: list) -> None:
    """Values of the wrong kind (a string where a list belongs, ...); lists are normalised."""
    for key in _BOOL_KEYS:
        _boolean(problems, cfg, key)
    if cfg.weight_symmetric is not None and not isinstance(cfg.weight_symmetric, bool):
        problems.append(f"weight_symmetric: expected true, false or null, got {cfg.weight_symmetric!r}")
    for key in _LIST_KEYS:
        value = getattr(cfg, key)
        if key == "op_types_to_quantize" and value == "all":   # every op with a rule (NPU targets)
            continue
        if value is not None and (isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set))
                                  or not all(isinstance(v, str) for v in value)):
            problems.append(f"{key}: expected a list of names, got {value!r}")
        elif key == "nodes_to_exclude":
            cfg.nodes_to_exclude = list(value or [])
        elif key in ("op_types_to_quantize", "nodes_to_quantize"):
            setattr(cfg, key, list(value) if value else None)  # empty: every supported op / node
    if not isinstance(cfg.per_channel_axes, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in cfg.per_channel_axes.values()):
        problems.append(f"per_channel_axes: expected a mapping of op type -> axis, got {cfg.per_channel_axes!r}")
    if cfg.target is not None and not isinstance(cfg.target, str):
        problems.append(f"target: expected a preset name, got {cfg.target!r}")


def load_config(source=None) -> QuantConfig:
    """A QuantConfig from a dict, a JSON/YAML file path, or None (the defaults).

    Every entry is checked; all problems are reported together in one ConfigError line.
    """
    if source is None:
        return QuantConfig()
    if isinstance(source, QuantConfig):
        return source
    where = "config"
    if isinstance(source, (str, Path)):
        where, source = str(source), _read_file(Path(source))
    if not isinstance(source, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    problems = _Problems()
    data = normalise(source, problems)
    config = _build(QuantConfig, data, "", problems)
    problems.raise_if_any(where)
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
