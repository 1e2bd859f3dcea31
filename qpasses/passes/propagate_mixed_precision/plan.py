"""Mixed-precision planning: which tensors change type and where converts go (pure: no graph edits).

A request (tensor -> type) opens a *region*: the tensor's producer and all its readers compute in the
requested type, so every float activation input and output of those nodes gets it. A tensor crossing a
region boundary keeps its producer's type and gets a ``convert`` read by the named receiving nodes.
These are the semantics of onnxruntime's MixedPrecisionTensorQuantOverridesFixer, and with
``extend_through_shape_ops=False`` and no op constraints the plan equals that fixer's output:

- a tensor produced in a region and read outside it converts back to the default type for exactly the
  outside readers; one read only inside a region but produced outside converts for the inside readers;
- graph outputs keep the type they are produced in; requested graph inputs keep the requested type;
  initializers are never planned (weights keep the weight type);
- a node pulled into two different types, or a tensor read in two different types, is a ConfigError.
  A tensor produced in one region and read by another gets a single convert to the readers' type (as
  in onnxruntime); its readers outside both regions then read the producer's type, noted in the plan.

Two extensions: (a) ops whose output shares its input's quantization (qpasses.quant.oprules' ``shares``:
Reshape, Transpose, MaxPool, ...) are tied to the producer of their data input, so no convert ever sits
between such an op and its input: regions grow through them (so do other ``shares`` links of the
table, like a Relu merged into its producer's range); (b) a per-target op-constraint table
(``targets/<target>.constraints.json``) ties more tensors together: ``{"Concat": {"same_type":
"all"}}`` ties a node to the producers of all its activation inputs, ``"inputs"`` ties those producers
to each other, ``[0, 2]`` ties the node to the producers of those input slots.

The plan is onnxruntime's TensorQuantOverrides schema with qpasses type names and sorted lists:
``{"op2_out": [{"quant_type": "uint8", "convert": {"quant_type": "uint16", "recv_nodes": ["op4"]}}]}``.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Iterable, Mapping

from ...config.targets import TARGETS_DIR
from ...errors import ConfigError
from ...ir.dataflow import Dataflow
from ...quant import oprules
from ...quant.qtypes import qtype

RULES = ("all", "inputs")


def sharing_ops() -> frozenset[str]:
    """Op types whose outputs share their data input's quantization (qpasses.quant.oprules' ``shares``)."""
    return frozenset(op for op, rule in oprules.RULES.items() if rule.shares)


@dataclass(frozen=True)
class TypeInfo:
    """A quantized type with an optional symmetry (None: whatever the default is)."""

    qtype: str
    symmetric: bool | None = None

    def matches(self, other: "TypeInfo") -> bool:
        """Same type; an unspecified symmetry matches either (onnxruntime's rule)."""
        return self.qtype == other.qtype and (
            self.symmetric is None or other.symmetric is None or self.symmetric == other.symmetric)

    def as_override(self) -> dict:
        d: dict = {"quant_type": self.qtype}
        if self.symmetric is not None:
            d["symmetric"] = self.symmetric
        return d

    @classmethod
    def from_override(cls, d: Mapping) -> "TypeInfo":
        return cls(d["quant_type"], d.get("symmetric"))

    def __str__(self) -> str:
        if self.symmetric is None:
            return self.qtype
        return f"{self.qtype} ({'symmetric' if self.symmetric else 'asymmetric'})"


def parse_requests(raw: Mapping) -> dict[str, TypeInfo]:
    """Config ``mixed_precision`` ({tensor: type | {quant_type, symmetric}}) -> {tensor: TypeInfo}."""
    if not isinstance(raw, Mapping):
        raise ConfigError("mixed_precision: expected a mapping of tensor name -> type")
    out = {}
    for name, value in raw.items():
        where = f"mixed_precision['{name}']"
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"quant_type", "symmetric"})
            if unknown:
                raise ConfigError(f"{where}: unknown key '{unknown[0]}' (expected quant_type, symmetric)")
            if "quant_type" not in value:
                raise ConfigError(f"{where}: missing 'quant_type'")
            sym = value.get("symmetric")
            if sym is not None and not isinstance(sym, bool):
                raise ConfigError(f"{where}: 'symmetric' must be true or false")
            out[str(name)] = TypeInfo(_qtype(value["quant_type"], where), sym)
        else:
            out[str(name)] = TypeInfo(_qtype(value, where))
    return out


def _qtype(value, where: str) -> str:
    try:
        return qtype(value).name
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


# -- op constraints --------------------------------------------------------------------------------
def load_constraints(target: str | None) -> dict[str, list] | None:
    """The op-constraint table of ``target`` (a built-in name or a ``.json`` path), or None if none."""
    if not target:
        return None
    path = Path(target)
    if not (path.suffix == ".json" and path.is_file()):
        path = TARGETS_DIR / f"{target}.constraints.json"
        if not path.is_file():
            return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return parse_constraints(data, str(path))


def parse_constraints(data, where: str = "constraints") -> dict[str, list]:
    """Validate ``{op_type: {"same_type": "all" | "inputs" | [slots]}}`` (keys starting "_": comments)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of op type -> rules")
    table: dict[str, list] = {}
    for op, rules in data.items():
        if op.startswith("_"):
            continue
        if not isinstance(rules, dict) or set(rules) != {"same_type"}:
            raise ConfigError(f"{where}: op '{op}' needs exactly one key 'same_type'")
        rule = rules["same_type"]
        if isinstance(rule, list) and rule and all(isinstance(s, int) and s >= 0 for s in rule):
            table[op] = [tuple(rule)]
        elif rule in RULES:
            table[op] = [rule]
        else:
            raise ConfigError(f"{where}: op '{op}': same_type must be 'all', 'inputs' "
                              f"or a list of input slots")
    return table


# -- the plan --------------------------------------------------------------------------------------
@dataclass
class MixedPrecisionPlan:
    """Overrides in onnxruntime's TensorQuantOverrides schema plus the reasons behind each entry."""

    overrides: dict[str, list[dict]] = field(default_factory=dict)
    why: dict[str, list[str]] = field(default_factory=dict)
    regions: dict[str, list[str]] = field(default_factory=dict)  # requested tensor -> node names
    notes: list[str] = field(default_factory=list)

    @property
    def converts(self) -> int:
        return sum("convert" in v[0] for v in self.overrides.values())

    def to_dict(self) -> dict:
        return {"overrides": self.overrides, "why": self.why, "regions": self.regions, "notes": self.notes}


class _Index:
    """What the planner needs from the dataflow view: sites, activation inputs/outputs, readers."""

    def __init__(self, flow: Dataflow, float_tensors: Collection[str]):
        self.flow, self.g = flow, flow.graph
        self.floats = float_tensors
        self.outputs: dict[int, list[str]] = {}
        for tensor, node in flow.producer.items():
            if self.kind(node) == "op":
                self.outputs.setdefault(node, []).append(tensor)

    def kind(self, node: int) -> str:
        return self.g.nodes[node]["kind"]

    def name(self, node: int) -> str:
        return self.g.nodes[node]["name"]

    def activation(self, tensor: str) -> bool:
        node = self.flow.producer.get(tensor)
        return tensor in self.floats and node is not None and self.kind(node) != "initializer"

    def site(self, tensor: str) -> int | None:
        """The op node or graph input producing an activation tensor."""
        return self.flow.producer[tensor] if self.activation(tensor) else None

    def inputs(self, node: int) -> list[tuple[int, str]]:
        """(slot, tensor) of the activation inputs of an op node, by slot."""
        if self.kind(node) != "op":
            return []
        pairs = [(s, key) for _, _, key, slots in self.g.in_edges(node, keys=True, data="slots")
                 for s in slots if self.activation(key)]
        return sorted(pairs)

    def acts_out(self, node: int) -> list[str]:
        if self.kind(node) == "input":
            return [self.name(node)]
        return [t for t in self.outputs.get(node, ()) if t in self.floats]

    def readers(self, tensor: str) -> list[int]:
        return [n for n in self.flow.consumers.get(tensor, ()) if self.kind(n) == "op"]


def _tie_groups(ix: _Index, rules: Mapping[str, list], sharing: Collection[str],
                ties: Iterable[tuple[str, str]]) -> dict[int, list[int]]:
    """Sites tied by op rules, as connected components: site -> every site of its group (sorted;
    the members of a group share one list)."""
    import networkx as nx   # only when mixed precision is asked for: its import is 0.1 s

    tied = nx.Graph()

    def tie(a: int | None, b: int | None) -> None:
        if a is not None and b is not None:
            tied.add_edge(a, b)

    for name, node in ix.flow.node_id.items():
        node_rules = list(rules.get(ix.flow.op(node), ()))
        if name in sharing:
            node_rules.append((0,))
        for rule in node_rules:
            inputs = ix.inputs(node)
            if rule == "inputs":
                sites = [ix.site(t) for _, t in inputs]
                for a, b in zip(sites, sites[1:]):
                    tie(a, b)
            else:
                for slot, tensor in inputs:
                    if rule == "all" or slot in rule:
                        tie(node, ix.site(tensor))
    for a, b in ties:
        if a in ix.flow.producer and b in ix.flow.producer:
            tie(ix.site(a), ix.site(b))
    groups: dict[int, list[int]] = {}
    for component in nx.connected_components(tied):
        members = sorted(component)
        groups.update(dict.fromkeys(members, members))
    return groups


@dataclass
class _Member:
    index: int          # request order
    info: TypeInfo
    request: str        # the requested tensor
    reason: str         # "the producer of 'x'", ...


def plan_mixed_precision(flow: Dataflow, requests: Mapping[str, TypeInfo], float_tensors: Collection[str],
                         default_qtype: str = "uint8", default_symmetric: bool = False, *,
                         extend_through_shape_ops: bool = True, sharing_nodes: Collection[str] | None = None,
                         ties: Iterable[tuple[str, str]] = (),
                         constraints: Mapping[str, list] | None = None) -> MixedPrecisionPlan:
    """Plan the regions, types and converts for ``requests`` on the dataflow view ``flow``.

    ``float_tensors``: names of the float/float16 tensors (only those are typed). ``sharing_nodes``:
    names of the nodes whose outputs share their input 0's quantization (default: every node of a
    :func:`sharing_ops` type); ``ties``: pairs of tensors that must be produced in one type (the
    table's ``shares`` links); both are used only when ``extend_through_shape_ops``. ``constraints``:
    an op-constraint table (:func:`parse_constraints`). Raises ConfigError for unknown, non-float or
    initializer tensors and for conflicting requests.
    """
    ix = _Index(flow, float_tensors)
    default = TypeInfo(default_qtype, default_symmetric)
    _check_requests(ix, requests, default)
    sharing: Collection[str] = ()
    if extend_through_shape_ops:
        ops = sharing_ops()
        sharing = set(sharing_nodes) if sharing_nodes is not None else {
            name for name, node in flow.node_id.items() if flow.op(node) in ops}
    else:
        ties = ()
    groups = _tie_groups(ix, constraints or {}, sharing, ties)

    members: dict[int, list[_Member]] = {}
    plan = MixedPrecisionPlan(overrides={t: [info.as_override()] for t, info in requests.items()})
    for index, (tensor, info) in enumerate(requests.items()):
        if info.matches(default):
            plan.notes.append(f"'{tensor}' requests the default type {info}: nothing to do")
            continue
        base = [(flow.producer[tensor], f"the producer of '{tensor}'")]
        base += [(n, f"a consumer of '{tensor}'") for n in ix.readers(tensor)]
        region: dict[int, str] = {}
        expanded: set[int] = set()   # groups already added (by id: members share one list)
        for node, reason in base:
            region.setdefault(node, reason)
            group = groups.get(node, ())
            if group and id(group) not in expanded:
                expanded.add(id(group))
                for tied in group:
                    region.setdefault(tied, f"tied to {ix.name(node)} by its op rules")
        for node in sorted(region):
            _join(ix, members, node, _Member(index, info, tensor, region[node]))
        plan.regions[tensor] = sorted(ix.name(n) for n in region)

    tensors: dict[str, None] = {}
    for node in sorted(members):
        tensors.update(dict.fromkeys(ix.acts_out(node)))
        tensors.update(dict.fromkeys(t for _, t in ix.inputs(node)))
    for tensor in tensors:
        _plan_tensor(ix, plan, members, tensor, requests, default_qtype)
    for tensor, info in requests.items():
        plan.why.setdefault(tensor, []).insert(0, f"{info} requested for '{tensor}'")
    plan.overrides = dict(sorted(plan.overrides.items()))
    plan.why = dict(sorted(plan.why.items()))
    return plan


def _check_requests(ix: _Index, requests: Mapping[str, TypeInfo], default: TypeInfo) -> None:
    for tensor, info in requests.items():
        where = f"mixed_precision: tensor '{tensor}'"
        if tensor not in ix.flow.producer:
            close = difflib.get_close_matches(tensor, list(ix.flow.producer), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"mixed_precision: unknown tensor '{tensor}'{hint}")
        if ix.kind(ix.flow.producer[tensor]) == "initializer":
            raise ConfigError(f"{where} is an initializer (weights keep the weight type; "
                              f"use tensor_overrides)")
        if tensor not in ix.floats:
            raise ConfigError(f"{where} is not a float tensor")
        if info.qtype == default.qtype and not info.matches(default):
            raise ConfigError(f"{where} requests the default type {default.qtype} with another symmetry "
                              f"(a convert must change the type; use tensor_overrides)")


def _join(ix: _Index, members: dict[int, list[_Member]], node: int, new: _Member) -> None:
    for old in members.get(node, ()):
        if not old.info.matches(new.info):
            acts = ix.acts_out(node) + [t for _, t in ix.inputs(node)]
            what = f"tensor '{acts[0]}'" if acts else f"node '{ix.name(node)}'"
            raise ConfigError(f"mixed_precision: {what} is pulled into {old.info} (region of "
                              f"'{old.request}') and {new.info} (region of '{new.request}')")
    members.setdefault(node, []).append(new)


def _plan_tensor(ix: _Index, plan: MixedPrecisionPlan, members: dict[int, list[_Member]], tensor: str,
                 requests: Mapping[str, TypeInfo], default_qtype: str) -> None:
    """Producer-side type and convert of one activation tensor touched by a region."""
    site = ix.flow.producer[tensor]
    made = members[site][-1] if site in members else None   # the last region wins (as in onnxruntime)
    readers = ix.readers(tensor)
    inside = [n for n in readers if n in members]
    outside = sorted(ix.name(n) for n in readers if n not in members)
    read = min((m for n in inside for m in members[n]), key=lambda m: m.index, default=None)
    for n in inside:
        for m in members[n]:
            if not m.info.matches(read.info):
                raise ConfigError(f"mixed_precision: tensor '{tensor}' is read as {read.info} (region of "
                                  f"'{read.request}') and as {m.info} (region of '{m.request}')")
    why = plan.why.setdefault(tensor, [])
    if made is not None and tensor not in requests:
        where = "output" if ix.kind(site) == "op" else "graph input"
        why.append(f"pulled into the {made.info} region of '{made.request}' ({where} of "
                   f"{ix.name(site)}, {made.reason})")
    recv = sorted(ix.name(n) for n in inside)
    if made is not None and read is None:
        _set_type(plan, tensor, made.info)
        if outside:
            _set_convert(plan, tensor, made.info, TypeInfo(default_qtype), outside)
    elif made is None:
        produced = TypeInfo.from_override(plan.overrides[tensor][0]) if tensor in plan.overrides \
            else TypeInfo(default_qtype)
        if not produced.matches(read.info):
            _set_type(plan, tensor, produced)
            _set_convert(plan, tensor, produced, read.info, recv)
    elif made.info.matches(read.info):
        _set_type(plan, tensor, made.info)
        if outside:
            _set_convert(plan, tensor, made.info, TypeInfo(default_qtype), outside)
    else:
        _set_type(plan, tensor, made.info)
        _set_convert(plan, tensor, made.info, read.info, recv)
        if outside:
            plan.notes.append(f"'{tensor}' is produced as {made.info} and converted to {read.info} for "
                              f"{', '.join(recv)}; {', '.join(outside)} read it as {made.info}")
    if not why:
        del plan.why[tensor]


def _set_type(plan: MixedPrecisionPlan, tensor: str, info: TypeInfo) -> None:
    if tensor not in plan.overrides:
        plan.overrides[tensor] = [info.as_override()]
    elif not TypeInfo.from_override(plan.overrides[tensor][0]).matches(info):
        raise ConfigError(f"mixed_precision: tensor '{tensor}' is requested as "
                          f"{plan.overrides[tensor][0]['quant_type']} but produced in a {info} region")


def _set_convert(plan: MixedPrecisionPlan, tensor: str, produced: TypeInfo, to: TypeInfo,
                 recv: list[str]) -> None:
    if to.qtype == produced.qtype:
        raise ConfigError(f"mixed_precision: tensor '{tensor}' would need a convert from {produced} to {to} "
                          f"(a convert must change the type)")
    plan.overrides[tensor][0]["convert"] = {**to.as_override(), "recv_nodes": recv}
    plan.why.setdefault(tensor, []).append(f"convert to {to} for {', '.join(recv)}")
