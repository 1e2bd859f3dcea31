"""Tensor quantization overrides in onnxruntime's ``TensorQuantOverrides`` schema, and config checks.

The schema (``{tensor: [dict, ...]}``): one dict for per-tensor quantization; for per-channel
weights either one dict per channel or a single dict, with ``axis`` in the first dict. Keys:
``quant_type``, ``scale`` + ``zero_point`` (fixed qparams; excludes ``symmetric``,
``reduce_range``, ``rmin``, ``rmax``), ``symmetric``, ``reduce_range`` (weights only), ``rmin``,
``rmax``, ``axis`` and ``convert`` (``{quant_type, recv_nodes, symmetric, scale, zero_point}``: the
readers in ``recv_nodes``, default all, read the tensor re-quantized to another type; a convert
uses the tensor's own range, so ``convert.rmin``/``convert.rmax`` are refused).

Unlike onnxruntime, which stops at the first problem, :func:`validate` checks every entry and the
node lists of the config and raises ONE :class:`ConfigError` listing every problem.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from ..analysis.requests import requests
from ..analysis.scopes import all_nodes
from ..errors import ConfigError
from ..quant.oprules import BIAS, RULES, WEIGHT, quantizable_op_types
from ..quant.qtypes import qtype

OVERRIDE_KEYS = ("quant_type", "scale", "zero_point", "symmetric", "reduce_range", "rmin", "rmax",
                 "axis", "convert")
CONVERT_KEYS = ("quant_type", "recv_nodes", "scale", "zero_point", "symmetric")
NOT_WITH_SCALE = ("symmetric", "reduce_range", "rmin", "rmax")


@dataclass
class ConvertOverride:
    quant_type: str
    recv_nodes: list[str] | None = None   # sorted; None = every reader
    symmetric: bool | None = None
    scale: float | None = None
    zero_point: int | None = None


@dataclass
class TensorOverride:
    """One tensor's overrides, checked and normalised (qtype names, sorted node lists)."""

    tensor: str
    keys: tuple[str, ...] = ()            # keys the user gave (any channel), sorted
    quant_type: str | None = None
    symmetric: bool | None = None
    reduce_range: bool | None = None
    rmin: float | None = None
    rmax: float | None = None
    axis: int | None = None               # per-channel axis (normalised); None = per-tensor
    scale: list[float] | None = None      # fixed: one value per channel (one when per-tensor)
    zero_point: list[int] | None = None
    convert: ConvertOverride | None = None

    @property
    def fixed(self) -> bool:
        return self.scale is not None


# -- model facts the checks need ----------------------------------------------------------------
@dataclass
class _View:
    tensors: dict
    readers: dict[str, list[str]] = field(default_factory=dict)
    node_names: list[str] = field(default_factory=list)
    op_types: set[str] = field(default_factory=set)
    weight_like: set[str] = field(default_factory=set)   # constants read in weight/bias slots

    @classmethod
    def of(cls, model) -> "_View":
        view = cls(model.tensors())
        for node in all_nodes(model):
            view.node_names.append(node.name)
            view.op_types.add(node.op)
            rule = RULES.get(node.op)
            for i, t in enumerate(node.inputs):
                if not t.name:
                    continue
                readers = view.readers.setdefault(t.name, [])
                if not readers or readers[-1] != node.name:
                    readers.append(node.name)
                if rule is not None and rule.slot(i).kind in (WEIGHT, BIAS) and isinstance(t, gs.Constant):
                    view.weight_like.add(t.name)
        return view

    def is_constant(self, name: str) -> bool:
        return isinstance(self.tensors.get(name), gs.Constant)


def _hint(name: str, candidates) -> str:
    close = difflib.get_close_matches(str(name), list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _number(value) -> float | None:
    if isinstance(value, (bool, np.bool_, str)):
        return None
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    return float(arr.reshape(())) if arr.size == 1 and np.isfinite(arr).all() else None


def _integer(value) -> int | None:
    number = _number(value)
    return int(number) if number is not None and float(number).is_integer() else None


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


class _Checker:
    """Collects problems while normalising one tensor's override dicts."""

    def __init__(self, config, view: _View):
        self.config = config
        self.view = view
        self.problems: list[str] = []

    def bad(self, tensor: str, message: str) -> None:
        self.problems.append(f"tensor_overrides['{tensor}']: {message}")

    def default_qtype(self, tensor: str) -> str:
        if self.view.is_constant(tensor) and tensor in self.view.weight_like:
            return self.config.weight_type
        return self.config.activation_type

    def keys(self, tensor: str, d: dict, allowed, where: str = "") -> None:
        for key in d:
            if key not in allowed:
                if where == "convert" and key == "reduce_range":
                    self.bad(tensor, "'reduce_range' is not allowed in 'convert' (weights only)")
                elif where == "convert" and key in ("rmin", "rmax"):
                    self.bad(tensor, f"'convert.{key}' is not supported (a convert uses the tensor's range)")
                else:
                    self.bad(tensor, f"unknown key '{where + '.' if where else ''}{key}'"
                                     f"{_hint(key, allowed)}")

    def qtype(self, tensor: str, value, where: str = "quant_type") -> str | None:
        try:
            name = qtype(value).name
        except ConfigError:
            self.bad(tensor, f"{where} '{value}' is not a quantized type")
            return None
        if name == "int32":
            self.bad(tensor, f"{where} 'int32' is reserved for biases")
            return None
        return name

    def scale_zp(self, tensor: str, d: dict, qt: str | None, where: str = ""):
        """(scale, zero_point) of one dict, after the pairing/contradiction/range checks."""
        has_s, has_z = "scale" in d, "zero_point" in d
        if has_s != has_z:
            given, missing = ("scale", "zero_point") if has_s else ("zero_point", "scale")
            self.bad(tensor, f"{where}'{given}' given without '{missing}'")
            return None, None
        if not has_s:
            return None, None
        clash = [k for k in NOT_WITH_SCALE if k in d]
        if clash:
            self.bad(tensor, f"{where}{', '.join(repr(k) for k in clash)} contradict(s) the fixed "
                             "'scale'/'zero_point'")
        scale, zp = _number(d["scale"]), _integer(d["zero_point"])
        if scale is None or scale <= 0:
            self.bad(tensor, f"{where}scale {d['scale']!r} is not a positive finite number")
            scale = None
        if zp is None:
            self.bad(tensor, f"{where}zero_point {d['zero_point']!r} is not an integer")
        elif qt is not None:
            info = qtype(qt)
            if not info.qmin <= zp <= info.qmax:
                self.bad(tensor, f"{where}zero_point {zp} is outside the {qt} range "
                                 f"[{info.qmin}, {info.qmax}]")
                zp = None
        return scale, zp

    def flags(self, tensor: str, d: dict, keys=("symmetric", "reduce_range"), where: str = "") -> dict:
        out = {}
        for key in keys:
            if key in d:
                if _is_bool(d[key]):
                    out[key] = bool(d[key])
                else:
                    self.bad(tensor, f"{where}{key} {d[key]!r} is not true/false")
        return out

    def range(self, tensor: str, d: dict, where: str = "") -> dict:
        out = {}
        for key in ("rmin", "rmax"):
            if key in d:
                value = _number(d[key])
                if value is None:
                    self.bad(tensor, f"{where}{key} {d[key]!r} is not a finite number")
                else:
                    out[key] = value
        if "rmin" in out and "rmax" in out and out["rmin"] > out["rmax"]:
            self.bad(tensor, f"{where}rmin {out['rmin']} is greater than rmax {out['rmax']}")
        return out

    # -- one tensor -------------------------------------------------------------------------
    def check(self, tensor: str, entries) -> TensorOverride | None:
        view = self.view
        if tensor not in view.tensors:
            self.bad(tensor, "no such tensor in the model" + _hint(tensor, view.tensors))
            return None
        if not isinstance(entries, (list, tuple)):
            self.bad(tensor, "expected a list of override dicts")
            return None
        if not entries:
            return None
        if not all(isinstance(d, dict) for d in entries):
            self.bad(tensor, "every override must be a dict")
            return None
        first = entries[0]
        per_channel = len(entries) > 1 or "axis" in first
        keys = tuple(sorted({k for d in entries for k in d}))
        for d in entries:
            self.keys(tensor, d, OVERRIDE_KEYS)
        qt = self.qtype(tensor, first["quant_type"]) if "quant_type" in first else None
        out = TensorOverride(tensor, keys, quant_type=qt, **self.flags(tensor, first),
                             **self.range(tensor, first))
        if "reduce_range" in first and not view.is_constant(tensor):
            self.bad(tensor, "'reduce_range' is only supported for weights (constants), not activations")
        zp_type = qt or self.default_qtype(tensor)
        if per_channel:
            self.per_channel(tensor, entries, out, zp_type)
        else:
            scale, zp = self.scale_zp(tensor, first, zp_type)
            if scale is not None and zp is not None:
                out.scale, out.zero_point = [scale], [zp]
            if "convert" in first:
                out.convert = self.convert(tensor, first["convert"], zp_type)
        return out

    def per_channel(self, tensor: str, entries, out: TensorOverride, zp_type: str) -> None:
        first = entries[0]
        if not self.view.is_constant(tensor):
            self.bad(tensor, "per-channel overrides need a weight (constant), this is an activation")
            return
        if any("convert" in d for d in entries):
            self.bad(tensor, "'convert' is not allowed on weights (constants)")
        shape = self.view.tensors[tensor].shape
        axis = first.get("axis")
        if axis is None:
            self.bad(tensor, f"{len(entries)} per-channel overrides but no 'axis' in the first one")
            return
        if _integer(axis) is None or isinstance(axis, bool) or not -len(shape) <= int(axis) < len(shape):
            self.bad(tensor, f"axis {axis!r} is out of range for a weight of rank {len(shape)}")
            return
        out.axis = int(axis) % len(shape)
        channels = shape[out.axis]
        if len(entries) > 1 and len(entries) != channels:
            self.bad(tensor, f"{len(entries)} per-channel overrides but axis {out.axis} has {channels} channels")
            return
        for index, d in enumerate(entries[1:], start=1):
            for key in ("quant_type", "symmetric", "reduce_range"):
                if key in d and d[key] != first.get(key):
                    self.bad(tensor, f"channel {index}: '{key}' differs from channel 0")
            if "axis" in d and _integer(d["axis"]) is not None and int(d["axis"]) % len(shape) != out.axis:
                self.bad(tensor, f"channel {index}: 'axis' differs from channel 0")
        scales, zps = [], []
        for index, d in enumerate(entries):
            if ("scale" in first) != ("scale" in d) or ("zero_point" in first) != ("zero_point" in d):
                self.bad(tensor, f"channel {index}: give 'scale'/'zero_point' for every channel or none")
                return
            scale, zp = self.scale_zp(tensor, d, zp_type, where=f"channel {index}: " if index else "")
            scales.append(scale)
            zps.append(zp)
            for key in ("rmin", "rmax"):
                if (key in d) != (key in first) or (key in d and _number(d[key]) != _number(first[key])):
                    self.bad(tensor, f"channel {index}: per-channel '{key}' must be the same for every "
                                     "channel (qpasses keeps one range per tensor)")
        if "scale" in first and None not in scales and None not in zps:
            if len(entries) == 1:          # one dict for every channel
                scales, zps = scales * channels, zps * channels
            out.scale, out.zero_point = scales, zps

    def convert(self, tensor: str, d, original: str) -> ConvertOverride | None:
        if self.view.is_constant(tensor):
            self.bad(tensor, "'convert' is not allowed on weights (constants)")
            return None
        if not isinstance(d, dict):
            self.bad(tensor, "'convert' must be a dict")
            return None
        self.keys(tensor, d, CONVERT_KEYS, where="convert")
        if "quant_type" not in d:
            self.bad(tensor, "'convert' needs a 'quant_type'")
            return None
        qt = self.qtype(tensor, d["quant_type"], where="convert.quant_type")
        if qt is None:
            return None
        if qt == original:
            self.bad(tensor, f"convert.quant_type {qt} is the same as the tensor's type")
        scale, zp = self.scale_zp(tensor, d, qt, where="convert: ")
        out = ConvertOverride(qt, scale=scale, zero_point=zp,
                              **self.flags(tensor, d, ("symmetric",), "convert."))
        if "recv_nodes" in d:
            nodes = d["recv_nodes"]
            if isinstance(nodes, str) or not isinstance(nodes, (list, tuple, set, frozenset)):
                self.bad(tensor, "convert.recv_nodes must be a list of node names")
                return out
            if not nodes:   # ambiguous: none, or (as the table reads an empty list) every reader
                self.bad(tensor, "convert.recv_nodes is empty: name the readers, or leave it out for every reader")
                return out
            readers = self.view.readers.get(tensor, [])
            for node in sorted(map(str, nodes)):
                if node not in readers:
                    self.bad(tensor, f"convert.recv_nodes: '{node}' does not read this tensor"
                                     f"{_hint(node, readers)} (readers: {', '.join(readers) or 'none'})")
            out.recv_nodes = sorted(set(map(str, nodes)))
        return out


def override_problems(raw: dict, model, config, view: _View | None = None
                      ) -> tuple[dict[str, TensorOverride], list[str]]:
    """Parse every override; returns (parsed overrides by tensor, problems)."""
    checker = _Checker(config, view or _View.of(model))
    parsed: dict[str, TensorOverride] = {}
    if not isinstance(raw, dict):
        return {}, ["tensor_overrides: expected a mapping of tensor name -> list of override dicts"]
    for tensor in sorted(raw, key=str):
        out = checker.check(str(tensor), raw[tensor])
        if out is not None:
            parsed[str(tensor)] = out
    return parsed, checker.problems


def node_list_problems(model, config, view: _View | None = None) -> list[str]:
    """Unknown node names in nodes_to_quantize/nodes_to_exclude and unknown op types."""
    view = view or _View.of(model)
    names = set(view.node_names)
    problems = []
    for key in ("nodes_to_quantize", "nodes_to_exclude"):
        for name in getattr(config, key) or ():
            if name not in names:
                problems.append(f"{key}: no node named '{name}'{_hint(name, view.node_names)}")
    known = set(quantizable_op_types()) | view.op_types
    for op in (config.op_types_to_quantize if config.op_types_to_quantize != "all" else None) or ():
        if op not in known:
            problems.append(f"op_types_to_quantize: '{op}' is neither a quantizable op type nor an op "
                            f"of the model{_hint(op, sorted(known))}")
    return problems


def raise_problems(problems: list[str]) -> None:
    if problems:
        text = "; ".join(" ".join(p.split()) for p in problems)
        raise ConfigError(f"invalid quantization config ({len(problems)} problem"
                          f"{'s' if len(problems) > 1 else ''}): {text}")


def parse_overrides(model, config) -> dict[str, TensorOverride]:
    """``config.tensor_overrides`` checked against the model; raises ONE ConfigError listing all problems."""
    parsed, problems = override_problems(config.tensor_overrides, model, config)
    raise_problems(problems)
    return parsed


def validate(model, config) -> dict[str, TensorOverride]:
    """Check the overrides, the node lists and every explicit request of ``config`` against ``model``
    (qpasses.analysis.requests: what cannot be honoured); one ConfigError for all."""
    view = _View.of(model)
    parsed, problems = override_problems(config.tensor_overrides, model, config, view)
    raise_problems(problems + node_list_problems(model, config, view) + requests(model, config).problems)
    return parsed
