"""fix-bias-scales: raise weight scales so int32 biases (scale = input_scale * weight_scale) never clip."""
from __future__ import annotations

from dataclasses import field
from typing import ClassVar

import numpy as np

from ..analysis.bias_fixes import bias_fixes
from ..analysis.derivations import rederive
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..ir.analyses import GRAPH, RANGES, WEIGHTS
from ..ir.model import QModel

NAME = "fix-bias-scales"


@register
class FixBiasScales(Pass):
    """Raise weight scales so every int32 bias fits without clipping.

    Reads: bias entries (derived_from = [input, weight]) and their constant values, weight entries and
    values, the config (fix_bias_scales, scale_type; calibration method pow2).
    Writes: raised weight scales (only the channels that need it, zero points re-derived so the
    weight's range stays covered); every entry derived from a raised weight, whole chains (sharing
    it through any number of links, biases, converts: compute-qparams' Resolver); the findings'
    ``bias_fixes``.
    Invariants: every bias scale = input scale * weight scale, and |bias| / scale < 2^31 - 1.
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[frozenset] = frozenset({"qparams-computed"})
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated", "qparams-computed"})
    unchanged: ClassVar[frozenset] = frozenset({GRAPH, WEIGHTS, RANGES})   # it changes the table only
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
        fixes, raised = [], {}
        for weight, (need, new) in bias_fixes(model, ctx.config).items():
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
