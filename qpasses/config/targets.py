"""Target presets: config defaults and table rules for one backend, read from ``targets/<name>.json``.

A preset file holds:

- ``defaults``: QuantConfig values used when the user did not write that key (user keys win);
- ``fixed_output_qparams``: ``{op: {qtype: {scale, zero_point}}}``: the op's output, when of that
  type, gets these fixed qparams (QNN's 16-bit Sigmoid and Tanh);
- ``weight_type_with_16bit_activations``: ops whose constant per-tensor weight is put back to the
  (8-bit) config weight type when an activation input is 16-bit (QNN MatMul, LayerNormalization);
- ``per_tensor_weight_ops``: ops whose weights stay per-tensor even with ``per_channel`` (QNN MatMul).

Rules never touch tensors the user overrode for the same property. :func:`apply_target_rules` reads
the table's current types, so it can run again after a pass changes types; it is idempotent.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import onnx_graphsurgeon as gs

from ..analysis.scopes import all_nodes
from ..errors import ConfigError
from ..quant.qtypes import qtype

TARGETS_DIR = Path(__file__).parent / "targets"
_KEYS = ("description", "defaults", "fixed_output_qparams", "weight_type_with_16bit_activations",
         "per_tensor_weight_ops")


@dataclass(frozen=True)
class Target:
    name: str
    description: str = ""
    defaults: dict = dataclasses.field(default_factory=dict)
    fixed_output_qparams: dict = dataclasses.field(default_factory=dict)  # op -> qtype -> (scale, zp)
    weight_type_with_16bit_activations: tuple[str, ...] = ()
    per_tensor_weight_ops: tuple[str, ...] = ()


def known_targets() -> list[str]:
    """Preset names: ``targets/<name>.json`` (files with more dots, like constraint tables, are not presets)."""
    return sorted(p.stem for p in TARGETS_DIR.glob("*.json") if "." not in p.stem)


@functools.lru_cache(maxsize=None)
def load_target(name: str) -> Target:
    """The preset called ``name``; ConfigError listing the known presets when there is none."""
    if name not in known_targets():
        raise ConfigError(f"target: unknown target '{name}' (known: {', '.join(known_targets()) or 'none'})")
    path = TARGETS_DIR / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}")
    fixed = {op: {qtype(t).name: (float(v["scale"]), int(v["zero_point"])) for t, v in by_type.items()}
             for op, by_type in data.get("fixed_output_qparams", {}).items()}
    return Target(name, data.get("description", ""), dict(data.get("defaults", {})), fixed,
                  tuple(data.get("weight_type_with_16bit_activations", ())),
                  tuple(data.get("per_tensor_weight_ops", ())))


def apply_target_defaults(config):
    """``config`` with the preset's defaults for every key the user did not give (a new object if changed)."""
    if config is None or not config.target:
        return config
    target = load_target(config.target)
    given = config.given
    names = {f.name for f in dataclasses.fields(config)}
    changes = {}
    for key, value in target.defaults.items():
        if key not in names:
            raise ConfigError(f"target '{target.name}': default for unknown config key '{key}'")
        if key in given:
            continue
        if key in ("activation_type", "weight_type"):
            value = qtype(value).name
        if getattr(config, key) != value:
            changes[key] = value
    if not changes:
        return config
    values = {name: getattr(config, name) for name in names}
    values.update(changes)
    if "weight_symmetric" not in given:
        values["weight_symmetric"] = None     # derive it again from the (new) weight type
    new = type(config)(**values)
    new._given = given
    return new


def chosen(config) -> frozenset:
    """Config keys set on purpose: written by the user or given by the target preset's defaults."""
    return config.given | frozenset(load_target(config.target).defaults if config.target else ())


# -- table rules -------------------------------------------------------------------------------
def user_keys(config, tensor: str) -> set[str]:
    entries = (config.tensor_overrides or {}).get(tensor) or [{}]
    return set(entries[0]) if isinstance(entries[0], dict) else set()


def apply_target_rules(model, config) -> int:
    """Apply the target's table rules to ``model.quant``; returns the number of entries changed."""
    if config is None or not config.target:
        return 0
    target = load_target(config.target)
    rules = _Rules(target, config, model.quant)
    changed: set[str] = set()
    for node in all_nodes(model):
        if config.per_channel and node.op in target.per_tensor_weight_ops:
            changed |= rules.per_tensor_weights(node)
        if node.op in target.weight_type_with_16bit_activations:
            changed |= rules.weight_type_with_16bit_activation(node)
        if node.op in target.fixed_output_qparams and node.outputs:
            changed |= rules.fixed_output(node)
    return len(changed)


class _Rules:
    def __init__(self, target: Target, config, table):
        self.target, self.config, self.table = target, config, table
        self.prefix = f"target {target.name}: "

    def _to_weight_type(self, name: str, reason: str) -> bool:
        tq = self.table[name]
        want = (self.config.weight_type, bool(self.config.weight_symmetric), None, False)
        if (tq.qtype, tq.symmetric, tq.axis, tq.restricted) == want:
            return False
        old = tq.qtype
        tq.qtype, tq.symmetric, tq.axis, tq.restricted = want
        line = f"{self.prefix}{reason}: weight_type={tq.qtype}, weight_symmetric={tq.symmetric}"
        if old != tq.qtype:
            tq.why.insert(0, line + f" (was {old})")
        else:
            tq.why.append(line)
        return True

    def per_tensor_weights(self, node: gs.Node) -> set[str]:
        """Constant inputs of ``node`` without user overrides become per-tensor weights."""
        out = set()
        for t in node.inputs:
            if isinstance(t, gs.Constant) and t.name in self.table and not user_keys(self.config, t.name):
                if self._to_weight_type(t.name, f"{node.op} '{node.name}' takes per-tensor weights only"):
                    out.add(t.name)
        return out

    def weight_type_with_16bit_activation(self, node: gs.Node) -> set[str]:
        """A 16-bit activation input with a per-tensor constant input: the constant gets the 8-bit weight type."""
        if qtype(self.config.weight_type).bits != 8:
            return set()
        act16 = weight = None
        for t in node.inputs[:2]:
            tq = self.table.get(t.name) if t.name else None
            if tq is None:
                continue
            if tq.axis is not None:
                return set()
            if isinstance(t, gs.Constant):
                weight = t.name
            elif qtype(tq.qtype_read_by(node.name)).bits == 16:
                act16 = t.name
        if act16 is None or weight is None or user_keys(self.config, weight) & {"quant_type", "symmetric"}:
            return set()
        changed = self._to_weight_type(weight, f"{node.op} '{node.name}' reads 16-bit '{act16}'")
        return {weight} if changed else set()

    def fixed_output(self, node: gs.Node) -> set[str]:
        """The op's output gets the preset's fixed qparams for its type (dropped if the type changes)."""
        name = node.outputs[0].name
        tq = self.table.get(name)
        if tq is None or tq.shares is not None or "scale" in user_keys(self.config, name):
            return set()
        want = self.target.fixed_output_qparams[node.op].get(tq.qtype)
        if want is not None:
            scale, zero_point = want
            if tq.fixed and tq.scale == [scale] and tq.zero_point == [zero_point]:
                return set()
            tq.scale, tq.zero_point, tq.fixed = [scale], [zero_point], True
            tq.why.append(f"{self.prefix}{node.op} output at {tq.qtype} fixed to scale={scale!r}, "
                          f"zero_point={zero_point}")
            return {name}
        if not tq.fixed:
            return set()
        tq.scale = tq.zero_point = None
        tq.fixed = False
        tq.why.append(f"{self.prefix}fixed qparams dropped: {node.op} output is now {tq.qtype}")
        return {name}
