"""Which int32 biases clip at their scale, and the weight scales that make them fit.

fix-bias-scales applies this plan; insert-qdq refuses a table for which it would still change
something (``clipping_biases``), so no pass order silently undoes the fix."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from ..errors import ModelError
from ..ir.model import QModel
from ..quant.qparams import bias_min_scale, compute_qparams
from ..quant.qtypes import qtype
from .derivations import bias_reader, qparams_options, scale_read_by
from .ranges import entry_range


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


def raise_weight(model: QModel, weight: str, need: WeightNeed, config):
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


def bias_fixes(model: QModel, config) -> dict[str, tuple[WeightNeed, tuple | None]]:
    """Weight -> (what its biases need, ``raise_weight``'s result), in name order."""
    plan = plan_bias_fixes(model, config)
    return {weight: (plan[weight], raise_weight(model, weight, plan[weight], config)) for weight in sorted(plan)}


def clipping_biases(model: QModel, config) -> list[str]:
    """Biases that clip at their scale although raising their weight's scale would make them fit:
    exactly what fix-bias-scales would still change."""
    return [bias for need, raised in bias_fixes(model, config).values()
            if raised is not None and (raised[2] > 1).any() for bias, _, _ in need.biases]
