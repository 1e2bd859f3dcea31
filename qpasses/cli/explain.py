"""Explain a tensor's quantization from the table saved in the model."""
from __future__ import annotations

from ..analysis.saturation import decision_line
from ..analysis.scopes import scopes
from ..errors import QpassesError
from ..ir.decisions import float_reasons
from ..ir.model import QModel, load


def cmd_explain(args) -> int:
    for line in explain_lines(load(args.model), args.tensor):
        print(line)
    return 0


def explain_lines(model: QModel, tensor: str | None = None) -> list[str]:
    """Lines describing a tensor's type, scale, zero point and the chain of reasons for them."""
    floats = float_reasons(model)
    inside = scopes(model)   # body tensors are named by their plain name; a line says which body
    if not len(model.quant) and not floats:
        raise QpassesError("the model carries no quantization table (was it produced by qpasses?)")
    if tensor in floats:
        row = floats[tensor]
        return [f"{tensor}: left float", *_where(inside, tensor), f"  1. {row['pass']}: {row['reason']}"]
    names = [tensor] if tensor else sorted(model.quant)
    if tensor and tensor not in model.quant:
        import difflib

        close = difflib.get_close_matches(tensor, [*model.quant, *floats], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise QpassesError(f"tensor '{tensor}' is neither quantized nor left float by a pass{hint}")
    lines = []
    pair_sums = decision_line(model) if not tensor else None
    if pair_sums:
        lines.append(pair_sums)
    if not tensor and floats:
        lines += [f"{name}: left float ({row['pass']}: {row['reason']})" for name, row in floats.items()]
    for name in names:
        tq = model.quant[name]
        granularity = f"per-channel axis {tq.axis}" if tq.per_channel else "per-tensor"
        lines.append(f"{name}: {tq.qtype} {tq.role}, {'symmetric' if tq.symmetric else 'asymmetric'}, {granularity}")
        lines += _where(inside, name)
        if tq.scale is not None:
            lines.append(f"  scale {_short(tq.scale)}  zero_point {_short(tq.zero_point)}")
        if tq.shares:
            lines.append(f"  shares qparams with '{tq.shares}'")
        if tq.convert is not None:
            c = tq.convert
            readers = ", ".join(sorted(c.recv_nodes)) or "every reader"
            qparams = f": scale {_short(c.scale)}  zero_point {_short(c.zero_point)}" if c.scale else ""
            lines.append(f"  converted to {c.qtype} for {readers}{qparams}")
        for i, reason in enumerate(tq.why, 1):
            lines.append(f"  {i}. {reason}")
    return lines


def _where(inside, name: str) -> list[str]:
    """'  inside the then_branch of If 'if'' for a tensor of an If/Loop/Scan body."""
    where = inside.where(name) if inside.has_bodies else ""
    return [f"  inside {where}"] if where else []


def _short(values) -> str:
    values = list(values or [])
    text = ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in values[:4])
    return f"[{text}{', ...' if len(values) > 4 else ''}] ({len(values)})" if len(values) > 1 else text
