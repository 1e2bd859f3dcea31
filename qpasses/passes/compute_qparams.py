"""compute-qparams: fill scale/zero_point of every table entry from ranges, weight values and biases."""
from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import numpy as np

from ..analysis.derivations import bias_axis, bias_reader, describe_options, qparams_options, scale_read_by
from ..analysis.ranges import activation_range, entry_range, fmt as _fmt, weight_range
from ..annotations import TensorQuant
from ..config import QuantConfig
from ..decisions import leave_float
from ..errors import ModelError
from ..ir import QModel
from ..pipeline import Pass, PassResult
from ..qparams import bias_qparams, compute_qparams, is_finite_range
from ..qtypes import qtype
from ..registry import register
from . import CONV_RELU_EXAMPLE

NAME = "compute-qparams"


def _key(tq: TensorQuant):
    conv = tq.convert
    return (tq.qtype, tq.scale, tq.zero_point, tq.axis,
            None if conv is None else (conv.qtype, conv.scale, conv.zero_point))


class _Planner:
    """Computes the new entries; ``dropped`` maps tensors that cannot be quantized to a reason."""

    def __init__(self, model: QModel, config: QuantConfig):
        self.model, self.table, self.config = model, model.quant, config
        self.done: dict[str, TensorQuant] = {}
        self.reasons: dict[str, str] = {}
        self.dropped: dict[str, str] = {}
        self.kind: dict[str, str] = {}
        self._busy: set[str] = set()

    def plan(self):
        self._precompute()
        for name in self.table:
            self.resolve(name)
        return self.done, self.reasons, self.dropped

    def _precompute(self) -> None:
        """Ranges of every directly computed entry; scalar ranges are computed in one numpy call per
        (qtype, options) group (per-entry numpy calls dominate the time on large tables)."""
        self.found: dict = {}
        self.computed: dict = {}
        groups: dict = {}
        for name, tq in self.table.items():
            if tq.fixed or tq.shares is not None or tq.role == "bias":
                continue
            found = self.found[name] = entry_range(self.model, name, tq, self.config)
            if found is not None and np.ndim(found[0]) == 0 and np.ndim(found[1]) == 0:
                opts = qparams_options(tq, self.config)
                groups.setdefault((tq.qtype, tuple(opts.items())), []).append(name)
        for (qt, opts), names in groups.items():
            bounds = np.array([self.found[n][:2] for n in names], np.float64)
            scales, zps = compute_qparams(bounds[:, 0], bounds[:, 1], qt, **dict(opts))
            self.computed.update((n, (scales[i], zps[i])) for i, n in enumerate(names))

    def resolve(self, name: str) -> None:
        """Compute ``name``, following a chain of ``shares`` iteratively (cycles are internal errors)."""
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

    def _compute(self, name: str, tq: TensorQuant) -> None:
        if name in self._busy:
            raise RuntimeError(f"bias '{name}' is derived from itself")
        self._busy.add(name)
        try:
            if tq.fixed:
                self.kind[name] = "fixed"
                self._finish(name, replace(tq, why=list(tq.why)), None)
            elif tq.role == "bias":
                self._bias(name, tq)
            else:
                self._from_range(name, tq)
        finally:
            self._busy.discard(name)

    def _from_range(self, name: str, tq: TensorQuant) -> None:
        found = self.found[name]
        if found is None:
            self.dropped[name] = "no calibrated range"
            return
        rmin, rmax, source = found
        if not is_finite_range(rmin, rmax):
            self.dropped[name] = f"range from {source} is not finite"
            return
        opts = qparams_options(tq, self.config)
        scale, zp = self.computed.get(name) or compute_qparams(rmin, rmax, tq.qtype, **opts)
        new = tq.with_qparams(scale, zp)
        self.kind[name] = tq.role
        self._finish(name, new, f"{NAME}: range [{_fmt(np.min(rmin))}, {_fmt(np.max(rmax))}] from {source}; "
                                f"{describe_options(tq.qtype, opts)}")

    def _share(self, name: str, tq: TensorQuant) -> None:
        target = tq.shares
        if target in self.dropped:
            self.dropped[name] = f"shares qparams with '{target}', which is not quantized"
            return
        src = self.done[target]
        new = replace(tq, qtype=src.qtype, scale=list(src.scale or []) or None,
                      zero_point=list(src.zero_point or []) or None, axis=src.axis, why=list(tq.why))
        self.kind[name] = "shared"
        self._finish(name, new, f"{NAME}: qparams shared with '{target}'")

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
        self._finish(name, new, f"{NAME}: scale = scale('{tq.derived_from[0]}') * scale('{tq.derived_from[1]}')")

    def _finish(self, name: str, new: TensorQuant, reason: str | None) -> None:
        if new.convert is not None:
            reason = self._convert(name, new, reason)
        self.done[name] = new
        if reason:
            self.reasons[name] = reason

    def _convert(self, name: str, tq: TensorQuant, reason: str | None) -> str | None:
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
        text = (f"{NAME}: convert to {describe_options(conv.qtype, opts)} from range "
                f"[{_fmt(found[0])}, {_fmt(found[1])}] ({found[2]})")
        return f"{reason}; {text}" if reason else text


def apply_plan(model: QModel, planned: dict, reasons: dict, dropped: dict, pass_name: str = NAME) -> int:
    """Write planned entries whose qparams changed (with their reason) and drop the unquantizable.

    Returns the number of table changes."""
    changed = 0
    for name, new in planned.items():
        if _key(new) != _key(model.quant[name]):
            model.quant[name] = new.because(reasons[name]) if name in reasons else new
            changed += 1
    for name in dropped:
        del model.quant[name]
    leave_float(model, dropped, pass_name)
    return changed + len(dropped)


@register
class ComputeQParams(Pass):
    """Compute scale and zero point of every quantized tensor from its range.

    Reads: the table, model.ranges / model.observed (activations), constant values (weights),
    the config (minimum_real_range, scale_type, calibration.method) and the calibration method
    select-by-snr chose (``model.decisions["calibration"]``). An activation's range is
    widened to its MaxPool outputs' ranges and, when only Softmax reads it, to its rows' maxima at
    the top and clipped 20 below the smallest row maximum at the bottom (calibration.softmax).
    Writes: scale/zero_point of every entry not `fixed` (and of its `convert`); biases get
    input_scale * weight_scale; `shares` entries copy their target. Tensors without a finite range
    (and the entries depending on them) leave the table, with the reason in ``model.decisions["float"]``.
    Invariants: zero points are integers in the type's range; scales are finite, positive and
    representable in the scale type; 0.0 is exactly representable.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"calibrated", "types-annotated"})
    establishes: ClassVar[frozenset] = frozenset({"qparams-computed"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated"})
    example: ClassVar[str] = CONV_RELU_EXAMPLE
    example_prelude: ClassVar[str] = "calibrate,annotate-types"

    def run(self, model: QModel, ctx) -> PassResult:
        planner = _Planner(model, ctx.config)
        planned, reasons, dropped = planner.plan()
        changed = apply_plan(model, planned, reasons, dropped)
        stats = {"changed": changed}
        for kind in planner.kind.values():
            stats[kind] = stats.get(kind, 0) + 1
        stats["converts"] = sum(1 for tq in planned.values() if tq.convert is not None)
        stats["unquantized"] = len(dropped)
        return PassResult(model, changed > 0, stats)
