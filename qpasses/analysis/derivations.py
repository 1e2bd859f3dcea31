"""Qparams one entry derives from others (``Resolver``: shares, biases, converts, whole chains),
and the rules they use: an entry's compute options, the scale a node reads a tensor with (its
convert's), a bias's reader and axis."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..config.quant_config import QuantConfig
from ..errors import ModelError
from ..ir.annotations import TensorQuant
from ..ir.model import QModel
from ..quant.qparams import bias_qparams, compute_qparams, is_finite_range
from ..quant.qtypes import qtype
from .ranges import activation_range, fmt, weight_range


def qparams_options(tq: TensorQuant, config: QuantConfig, *, symmetric: bool | None = None) -> dict:
    """Keyword options of qparams.compute_qparams for a table entry under a config."""
    return {
        "symmetric": tq.symmetric if symmetric is None else symmetric,
        "reduce_range": tq.reduce_range,
        "restricted": tq.restricted,
        "minimum_real_range": config.minimum_real_range,
        "power_of_two": config.calibration.method == "pow2",
        "scale_type": config.scale_type,
    }


def describe_options(qt: str, opts: dict) -> str:
    """Short text for a ``why`` line: 'int8 symmetric, pow2'."""
    mode = "symmetric" if opts["symmetric"] else "restricted" if opts["restricted"] else "asymmetric"
    extra = [name for name, on in (("reduce-range", opts["reduce_range"]), ("pow2", opts["power_of_two"]),
                                   ("float16 scale", opts["scale_type"] == "float16")) if on]
    if opts["minimum_real_range"]:
        extra.append(f"minimum range {opts['minimum_real_range']:g}")
    return ", ".join([f"{qt} {mode}"] + extra)


def bias_reader(model: QModel, bias: str) -> str | None:
    """The node that reads a bias constant (annotate-types gives every bias a single reader)."""
    tensor = model.tensors().get(bias)
    return tensor.outputs[0].name if tensor is not None and tensor.outputs else None


def scale_read_by(entry: TensorQuant, node: str | None) -> list[float] | None:
    """The scale ``node`` actually reads a tensor with: its convert's when ``node`` receives the convert."""
    conv = entry.convert
    if conv is not None and conv.scale and node is not None and (not conv.recv_nodes or node in conv.recv_nodes):
        return conv.scale
    return entry.scale


def bias_axis(model: QModel, name: str, channels: int) -> int | None:
    """Axis of a per-channel bias with ``channels`` values: (N) -> 0, (1, N) -> 1."""
    if channels <= 1:
        return None
    tensor = model.tensors().get(name)
    shape = list(getattr(tensor, "shape", None) or [channels])
    for axis in range(len(shape) - 1, -1, -1):
        if shape[axis] == channels:
            return axis
    raise ModelError(f"bias '{name}': shape {shape} has no axis of size {channels} (the weight's channels)")


def qparams_key(tq: TensorQuant):
    """What insert-qdq writes for an entry: type, scale, zero point, axis, and its convert's."""
    conv = tq.convert
    return (tq.qtype, tq.scale, tq.zero_point, tq.axis,
            None if conv is None else (conv.qtype, conv.scale, conv.zero_point))


def dependents(table, names) -> set[str]:
    """Entries whose qparams derive from ``names`` through any chain of ``shares`` and bias
    ``derived_from`` links (fixed entries derive nothing; ``names`` themselves are left out)."""
    users: dict[str, list[str]] = {}
    for name, tq in table.items():
        if tq.fixed:
            continue
        deps = [tq.shares] if tq.shares is not None else list(tq.derived_from or ()) if tq.role == "bias" else []
        for dep in deps:
            users.setdefault(dep, []).append(name)
    found, todo = set(), list(names)
    while todo:
        for user in users.get(todo.pop(), ()):
            if user not in found:
                found.add(user)
                todo.append(user)
    return found - set(names)


class Resolver:
    """Qparams of derived entries, following whole chains: an entry that ``shares`` takes its
    target's (through any number of links), a bias takes scale(input) * scale(weight) (the scale
    its node reads), a ``convert`` gets qparams from its own range. compute-qparams and
    fix-bias-scales both derive through it.

    ``root(name, tq)`` gives every other entry: (new entry, reason or None, kind), or a string saying
    why it stays float. Entries in ``done`` are final; names in ``raised`` are called so in reasons.
    Results: ``done`` (name -> new entry), ``reasons``, ``dropped`` (name -> why), ``kind``.
    """

    def __init__(self, model: QModel, config: QuantConfig, root, *, label: str, raised=frozenset(),
                 done: dict | None = None, explain_unchanged_converts: bool = True):
        self.model, self.table, self.config, self.root, self.label = model, model.quant, config, root, label
        self.raised = frozenset(raised)
        self.explain_unchanged_converts = explain_unchanged_converts
        self.done: dict[str, TensorQuant] = dict(done or {})
        self.reasons: dict[str, str] = {}
        self.dropped: dict[str, str] = {}
        self.kind: dict[str, str] = {}
        self._busy: set[str] = set()

    def resolve(self, name: str) -> None:
        """Derive ``name``, following a chain of ``shares`` iteratively (cycles are internal errors)."""
        chain: list[str] = []
        current = name
        while current not in self.done and current not in self.dropped:
            if current in chain:
                raise RuntimeError(f"'shares' cycle in the table: {' -> '.join(chain + [current])}")
            tq = self.table.get(current)
            if tq is None:
                raise RuntimeError(f"tensor '{chain[-1]}' shares qparams with '{current}', which has no table entry")
            chain.append(current)
            if tq.fixed or tq.shares is None:
                self._compute(current, tq)
                break
            current = tq.shares
        for sharer in reversed(chain):
            if sharer not in self.done and sharer not in self.dropped:
                self._share(sharer, self.table[sharer])

    def _scale_of(self, name: str) -> str:
        return f"{'raised ' if name in self.raised else ''}scale('{name}')"

    def _compute(self, name: str, tq: TensorQuant) -> None:
        if name in self._busy:
            raise RuntimeError(f"bias '{name}' is derived from itself")
        self._busy.add(name)
        try:
            if tq.role == "bias" and not tq.fixed:
                self._bias(name, tq)
                return
            found = self.root(name, tq)
            if isinstance(found, str):
                self.dropped[name] = found
                return
            new, reason, self.kind[name] = found
            self._finish(name, new, reason)
        finally:
            self._busy.discard(name)

    def _share(self, name: str, tq: TensorQuant) -> None:
        target = tq.shares
        if target in self.dropped:
            self.dropped[name] = f"shares qparams with '{target}', which is not quantized"
            return
        src = self.done[target]
        new = replace(tq, qtype=src.qtype, scale=list(src.scale or []) or None,
                      zero_point=list(src.zero_point or []) or None, axis=src.axis, why=list(tq.why))
        self.kind[name] = "shared"
        raised = "raised " if target in self.raised else ""
        self._finish(name, new, f"{self.label}: qparams shared with {raised}'{target}'")

    def _bias(self, name: str, tq: TensorQuant) -> None:
        if not tq.derived_from or len(tq.derived_from) != 2:
            raise RuntimeError(f"bias '{name}' needs derived_from = [input, weight], got {tq.derived_from}")
        for dep in tq.derived_from:
            if dep not in self.table:
                raise RuntimeError(f"bias '{name}' is derived from '{dep}', which has no table entry")
            self.resolve(dep)
            if dep in self.dropped:
                self.dropped[name] = f"derived from '{dep}', which is not quantized"
                return
        inp, weight = (self.done[d] for d in tq.derived_from)
        in_scale = scale_read_by(inp, bias_reader(self.model, name))
        if not in_scale or not weight.scale:
            raise RuntimeError(f"bias '{name}': '{tq.derived_from[0]}' or '{tq.derived_from[1]}' has no scale")
        if len(in_scale) > 1 and len(weight.scale) > 1 and len(in_scale) != len(weight.scale):
            raise ModelError(f"bias '{name}': input and weight scales have {len(in_scale)} and "
                             f"{len(weight.scale)} channels")
        scale, zp = bias_qparams(in_scale, weight.scale, self.config.scale_type)
        axis = None
        if scale.size > 1:
            axis = tq.axis if tq.axis is not None else bias_axis(self.model, name, scale.size)
        new = replace(tq.with_qparams(scale, zp), axis=axis)
        self.kind[name] = "bias"
        a, w = tq.derived_from
        self._finish(name, new, f"{self.label}: scale = {self._scale_of(a)} * {self._scale_of(w)}")

    def _finish(self, name: str, new: TensorQuant, reason: str | None) -> None:
        if new.convert is not None:
            old = self.table[name].convert if name in self.table else None
            text = self._convert(name, new)
            if self.explain_unchanged_converts or _convert_key(old) != _convert_key(new.convert):
                reason = f"{reason}; {text}" if reason else text
        self.done[name] = new
        if reason:
            self.reasons[name] = reason

    def _convert(self, name: str, tq: TensorQuant) -> str:
        """Set the qparams of ``tq.convert`` from the tensor's range; returns the reason text."""
        conv = tq.convert
        found = activation_range(self.model, name, tq, conv.qtype, self.config)
        current, seen = tq, {name}
        while found is None and current.shares in self.table and current.shares not in seen:
            # a sharing tensor only moves values and calibration records no range for it: use the
            # range of the tensor it shares with, up the chain (Reshape -> MaxPool -> ..., or the
            # values of a Gather table)
            root, current = current.shares, self.table[current.shares]
            seen.add(root)
            found = ((weight_range(self.model, root, current) if current.role == "weight" else None)
                     or activation_range(self.model, root, current, conv.qtype, self.config))
        if found is None and tq.fixed and tq.scale:    # fixed qparams: the values are within their grid
            qt, scale = qtype(tq.qtype), np.asarray(tq.scale, np.float64)
            zp = np.asarray(tq.zero_point if tq.zero_point is not None else 0, np.float64)
            found = ((qt.qmin - zp) * scale, (qt.qmax - zp) * scale,
                     "the range its fixed scale/zero point covers")
        if found is not None and np.ndim(found[0]):   # a per-channel root: one range for the convert
            found = (float(np.min(found[0])), float(np.max(found[1])), found[2])
        if found is None or not is_finite_range(found[0], found[1]):
            raise ModelError(f"tensor '{name}': no finite range for its convert to {conv.qtype}")
        opts = qparams_options(tq, self.config, symmetric=conv.symmetric)
        scale, zp = compute_qparams(found[0], found[1], conv.qtype, **opts)
        tq.convert = replace(conv, scale=[float(s) for s in np.ravel(scale)],
                             zero_point=[int(z) for z in np.ravel(zp)])
        return (f"{self.label}: convert to {describe_options(conv.qtype, opts)} from range "
                f"[{fmt(found[0])}, {fmt(found[1])}] ({found[2]})")


def _convert_key(conv):
    return None if conv is None else (conv.qtype, conv.scale, conv.zero_point)


def rederive(model: QModel, config: QuantConfig, raised, label: str) -> dict[str, TensorQuant]:
    """After the qparams of ``raised`` entries changed in the table: the new entries (reason
    appended) of every entry deriving from them, whole chains, whose qparams change."""
    table = model.quant
    todo = dependents(table, raised)

    def root(name, tq):   # every root is final already: only derived entries are resolved
        raise RuntimeError(f"'{name}' is not derived from {sorted(raised)}")

    resolver = Resolver(model, config, root, label=label, raised=raised,
                        done={n: tq for n, tq in table.items() if n not in todo},
                        explain_unchanged_converts=False)
    out = {}
    for name in sorted(todo):
        resolver.resolve(name)
        new = resolver.done.get(name)
        if new is not None and qparams_key(new) != qparams_key(table[name]):
            reason = resolver.reasons.get(name)
            out[name] = new.because(reason) if reason else new
    return out
