"""compute-qparams: fill scale/zero_point of every table entry from ranges, weight values and biases."""
from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import numpy as np

from ..analysis.derivations import Resolver, describe_options, qparams_key, qparams_options
from ..analysis.mixed_ranges import mixed_range_concats
from ..analysis.ranges import entry_range, fmt as _fmt
from ..analysis.requests import named_tensors, pinned
from ..analysis.scopes import UNOBSERVED
from ..config.overrides import raise_problems
from ..config.quant_config import QuantConfig
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..ir.analyses import GRAPH, RANGES, WEIGHTS
from ..ir.annotations import TensorQuant
from ..ir.decisions import leave_float
from ..ir.model import QModel
from ..quant.qparams import compute_qparams, is_finite_range
from . import CONV_RELU_EXAMPLE

NAME = "compute-qparams"


class _Planner:
    """Computes every entry: roots from their range here, derived ones through the shared Resolver."""

    def __init__(self, model: QModel, config: QuantConfig):
        self.model, self.table, self.config = model, model.quant, config
        self._pinned: set[str] | None = None

    def asked(self, name: str) -> bool:
        """A tensor the config asks for (qpasses.analysis.requests) or a preset's: no policy leaves it float."""
        if self._pinned is None:
            self._pinned = pinned(self.model, self.config)
        return bool(self.config.target) or name in self._pinned

    def plan(self) -> Resolver:
        self._precompute()
        resolver = Resolver(self.model, self.config, self._root, label=NAME)
        for name in self.table:
            resolver.resolve(name)
        return resolver

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

    def _root(self, name: str, tq: TensorQuant):
        """A fixed entry as it is, else qparams from its range: (entry, reason, kind), or why it stays float."""
        if tq.fixed:
            return replace(tq, why=list(tq.why)), None, "fixed"
        found = self.found[name]
        if found is None:
            missed = self.model.decisions.get("calibration", {}).get("unobserved", ())
            return UNOBSERVED if name in missed else "no calibrated range"
        rmin, rmax, source = found
        if not is_finite_range(rmin, rmax):
            return f"range from {source} is not finite"
        mixed = mixed_range_concats(self.model).get(name)
        if mixed and not self.asked(name):
            return mixed
        opts = qparams_options(tq, self.config)
        scale, zp = self.computed.get(name) or compute_qparams(rmin, rmax, tq.qtype, **opts)
        return tq.with_qparams(scale, zp), (f"{NAME}: range [{_fmt(np.min(rmin))}, {_fmt(np.max(rmax))}] "
                                            f"from {source}; {describe_options(tq.qtype, opts)}"), tq.role


def apply_plan(model: QModel, planned: dict, reasons: dict, dropped: dict, pass_name: str = NAME) -> int:
    """Write planned entries whose qparams changed (with their reason) and drop the unquantizable.

    Returns the number of table changes."""
    changed = 0
    for name, new in planned.items():
        if qparams_key(new) != qparams_key(model.quant[name]):
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
    (and the entries depending on them) leave the table, with the reason in ``model.decisions["float"]``;
    for a tensor the config names (tensor_overrides, mixed_precision) that is a ConfigError. A Concat
    output joining ranges too far apart stays float too, unless the config asks for it or a target
    preset is set.
    Invariants: zero points are integers in the type's range; scales are finite, positive and
    representable in the scale type; 0.0 is exactly representable.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"calibrated", "types-annotated"})
    establishes: ClassVar[frozenset] = frozenset({"qparams-computed"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated"})
    unchanged: ClassVar[frozenset] = frozenset({GRAPH, WEIGHTS, RANGES})   # it changes the table only
    example: ClassVar[str] = CONV_RELU_EXAMPLE
    example_prelude: ClassVar[str] = "calibrate,annotate-types"

    def run(self, model: QModel, ctx) -> PassResult:
        resolved = _Planner(model, ctx.config).plan()
        planned, dropped = resolved.done, resolved.dropped
        named = named_tensors(ctx.config)
        raise_problems([f"{named[name]}['{name}']: cannot be quantized: {why}"
                        for name, why in sorted(dropped.items()) if name in named])
        changed = apply_plan(model, planned, resolved.reasons, dropped)
        stats = {"changed": changed}
        for kind in resolved.kind.values():
            stats[kind] = stats.get(kind, 0) + 1
        stats["converts"] = sum(1 for tq in planned.values() if tq.convert is not None)
        stats["unquantized"] = len(dropped)
        return PassResult(model, changed > 0, stats)
