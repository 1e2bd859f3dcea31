"""fix-bias-scales: raise weight scales so int32 biases (scale = input_scale * weight_scale) never clip."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx_graphsurgeon as gs

from ..analysis.derivations import bias_reader, qparams_options, rederive, scale_read_by
from ..analysis.ranges import entry_range
from ..errors import ModelError
from ..ir import QModel
from ..pipeline import Pass, PassResult
from ..qparams import bias_min_scale, compute_qparams
from ..qtypes import qtype
from ..registry import register

NAME = "fix-bias-scales"


@dataclass
class WeightNeed:
    """What the biases of one weight need: a minimum scale per weight channel (0: no need)."""

    required: np.ndarray
    biases: list = field(default_factory=list)  # (bias, node or None, channel mask)


def _bias_absmax(name: str, values: np.ndarray, channels: int) -> np.ndarray:
    """max |bias| per weight channel: (N) and (1, N) biases both give N values."""
    values = np.abs(np.asarray(values, np.float64))
    if channels == 1:
        return np.array([values.max(initial=0.0)])
    if values.size != channels:
        raise ModelError(f"bias '{name}': {values.size} values for a weight with {channels} channel scales")
    return values.reshape(channels)


def plan_bias_fixes(model: QModel, config) -> dict[str, WeightNeed]:
    """Pure analysis: weight name -> the scales its int32 biases need (only weights that must grow)."""
    tensors = model.tensors()
    plan: dict[str, WeightNeed] = {}
    for name in sorted(model.quant):
        tq = model.quant[name]
        if tq.role != "bias" or tq.fixed or not tq.scale or not tq.derived_from or len(tq.derived_from) != 2:
            continue
        inp, weight = (model.quant.get(n) for n in tq.derived_from)
        tensor = tensors.get(name)
        node = bias_reader(model, name)
        in_scale = scale_read_by(inp, node) if inp is not None else None
        if (weight is None or not in_scale or not weight.scale or len(in_scale) != 1
                or not isinstance(tensor, gs.Constant)):
            continue
        channels = len(weight.scale)
        need = bias_min_scale(_bias_absmax(name, tensor.values, channels), config.scale_type, qtype(tq.qtype).qmax)
        clips = need > np.asarray(tq.scale, np.float64)
        if not clips.any():
            continue
        required = np.where(clips, need / in_scale[0], 0.0)
        entry = plan.setdefault(tq.derived_from[1], WeightNeed(np.zeros(channels)))
        entry.required = np.maximum(entry.required, required)
        entry.biases.append((name, node, clips))
    return plan


def _raise_weight(model: QModel, weight: str, need: WeightNeed, config):
    """New (scale, zero_point, factor per channel) of a weight, raised only where needed; None if it can't be."""
    tq = model.quant[weight]
    found = entry_range(model, weight, tq, config)
    if tq.fixed or found is None:
        return None
    old_s = np.asarray(tq.scale, np.float64)
    old_zp = np.asarray(tq.zero_point, np.int64)
    new_s, new_zp = compute_qparams(found[0], found[1], tq.qtype, **qparams_options(tq, config),
                                    min_scale=need.required)
    grow = (need.required > 0) & (new_s > old_s)
    scale = np.where(grow, new_s, old_s)
    return scale, np.where(grow, new_zp, old_zp), scale / old_s


@register
class FixBiasScales(Pass):
    """Raise weight scales so every int32 bias fits without clipping.

    Reads: bias entries (derived_from = [input, weight]) and their constant values, weight entries and
    values, the config (fix_bias_scales, scale_type; calibration method pow2).
    Writes: raised weight scales (only the channels that need it, zero points re-derived so the
    weight's range stays covered), the biases' scales; the findings' ``bias_fixes``.
    Invariants: every bias scale = input scale * weight scale, and |bias| / scale < 2^31 - 1.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"qparams-computed"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated", "qparams-computed"})
    example: ClassVar[str] = """
g (float[1,2,4,4] x) => (float[1,2,4,4] y)
  <float[2,2,1,1] w = {1e-7, -1e-7, -1e-7, 1e-7}, float[2] b = {5.0, -4.5}>
{
  y = Conv(x, w, b)
}
"""
    example_prelude: ClassVar[str] = "calibrate,annotate-types,compute-qparams"
    enabled: bool = field(default=True, metadata={"help": "raise weight scales when an int32 bias would clip "
                                                          "(also off with config fix_bias_scales: false)"})

    def run(self, model: QModel, ctx) -> PassResult:
        if not self.enabled or not ctx.config.fix_bias_scales:
            return PassResult(model, False, {"disabled": 1})
        plan = plan_bias_fixes(model, ctx.config)
        fixes, raised = [], {}
        for weight in sorted(plan):
            need = plan[weight]
            new = _raise_weight(model, weight, need, ctx.config)
            if new is None:
                for bias, _, _ in need.biases:
                    model.quant[bias].because(f"{NAME}: would clip, but weight '{weight}' cannot be rescaled")
                continue
            scale, zp, factor = new
            if not (factor > 1).any():
                continue
            raised[weight] = factor
            per_channel = factor.size > 1
            for bias, node, clips in need.biases:
                channels = [int(c) for c in np.flatnonzero(clips)] if per_channel else None
                fixes.append({"weight": weight, "bias": bias, "node": node, "channels": channels,
                              "factor": float(factor[clips].max())})
            where = f" (channels {[int(c) for c in np.flatnonzero(factor > 1)]})" if per_channel else ""
            biases = ", ".join(f"'{b}'" for b, _, _ in need.biases)
            model.quant[weight] = model.quant[weight].with_qparams(
                scale, zp, f"{NAME}: scale x{float(factor.max()):.6g}{where} so the int32 bias {biases} fits")
        for name, new in rederive(model, ctx.config, set(raised), NAME).items():   # whole chains
            model.quant[name] = new
        if fixes:
            ctx.findings.add_rows("bias_fixes", [f | {"key": f"{f['weight']}/{f['bias']}"} for f in fixes], by="key")
        stats = {"weights_rescaled": len(raised), "biases_fixed": len(fixes),
                 "channels_rescaled": int(sum(int((f > 1).sum()) for f in raised.values()))}
        return PassResult(model, bool(raised), stats)
