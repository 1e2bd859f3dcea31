"""quantize-gathers: embedding tables left float become int8 with a scale per row."""
from __future__ import annotations

import fnmatch
from dataclasses import field
from typing import ClassVar

from ...core.pipeline import Pass, PassResult
from ...core.registry import register
from ...ir.decisions import FLOAT, leave_float
from ...ir.model import QModel, relaxed_gc
from ...quant.qdq import Placement, new_namer
from ...quant.qtypes import qtype
from .lookups import block_lookup_problem, lookup_tables, to_block_lookup, to_row_lookup

NAME = "quantize-gathers"
DECISION = "gathers"
EXAMPLE = """
<ir_version: 10, opset_import: ["" : 17]>
g (int64[1, 3] ids) => (float[1, 3, 16] y) <float[16, 16] table = {%s}>
{
  y = Gather(table, ids)
}
""" % ", ".join(f"{((i * 37) % 101 - 50) / 40:g}" for i in range(16 * 16))


@register
class QuantizeGathers(Pass):
    """Store large embedding tables that stay float as int8 (or, weight-only, 4/8-bit block) codes.

    Reads: the graph (a Gather on axis 0 whose data input is a float32/float16 constant of at least
    ``min_values`` values, read by nothing but such Gathers; a table the quantization table already
    quantizes is read through a DequantizeLinear and not seen) and the config (mode, op selection,
    nodes_to_exclude, weight_type; under ``mode: weight_only`` its bits, block_size, symmetric and
    exclude). Writes, static and dynamic modes: each Gather reads symmetric int8 codes (max |row| /
    127 per row) and its output is Cast(codes) * Gather(row scales, same indices), standard ONNX at
    any opset. Weight-only: the Gather becomes com.microsoft.GatherBlockQuantized (round-to-nearest
    codes, a scale per block along the row; the only form in which onnxruntime gathers 4-bit rows).
    Either way the table shrinks 4x (8x at 4 bits) and onnxruntime dequantizes only the rows it
    selects: a DequantizeLinear before the Gather would expand the whole table on every run (5-40
    ms for 30522 x 384 on one core). ``model.decisions["gathers"]`` holds each table's form and SNR;
    tables that stay float are in ``model.decisions["float"]`` with the reason. Invariants: only
    when Gather is selected (the default selection, ``all``, or a list naming it), no target preset is
    set and, in static and dynamic modes, the weight type is an 8-bit integer; graph outputs keep their names and types; a
    second run finds nothing left to quantize.
    """

    name: ClassVar[str] = NAME
    preserves: ClassVar[frozenset] = frozenset({"types-annotated", "calibrated", "qparams-computed", "qdq-inserted",
                                                "converts-inserted"})
    example: ClassVar[str] = EXAMPLE
    example_prelude: ClassVar[str] = ""

    min_values: int = field(default=256, metadata={
        "help": "smallest table (values) worth the lookup's three extra nodes"})

    def run(self, model: QModel, ctx) -> PassResult:
        config = ctx.config
        chosen, only = config.op_types_to_quantize, config.nodes_to_quantize
        weights = qtype(config.weight_type)
        blocks = config.mode == "weight_only"
        if (not (chosen in (None, "all") or "Gather" in chosen) or not (blocks or (not weights.is_float and weights.bits == 8))
                or config.target):   # a preset's provider gets the Gathers its quantizer would give it
            return PassResult(model, False, {"tables": 0})
        wo = config.weight_only

        def excluded(name: str) -> str | None:
            if name in config.nodes_to_exclude:
                return f"the config excludes '{name}' (nodes_to_exclude)"
            if blocks and any(fnmatch.fnmatchcase(name, p) for p in wo.exclude):
                return f"excluded by weight_only.exclude ('{name}')"
            if only is not None and name in gathers and name not in only:
                return f"the config's nodes_to_quantize does not name '{name}'"
            return None

        gathers = {n.name for n in model.graph.nodes if n.op == "Gather"}
        tables, skipped = lookup_tables(model, self.min_values, excluded)
        if blocks:
            for entry in list(tables):
                why = (f"weight_only.scheme {wo.scheme}: tables are held as integer codes only"
                       if wo.scheme != "int" else block_lookup_problem(entry, wo.block_size))
                if why:
                    skipped[entry.table.name] = why
                    tables.remove(entry)
        known = model.decisions.get(FLOAT, {})
        news = {t: why for t, why in skipped.items() if known.get(t, {}).get("reason") != why}
        leave_float(model, news, NAME)
        if not tables:
            return PassResult(model, bool(news), {"tables": 0})
        namer, place = new_namer(model), Placement(model.graph)
        done = model.decisions.setdefault(DECISION, {})
        floats = model.decisions.get(FLOAT, {})
        with relaxed_gc():
            for entry in tables:
                name, rows, lookups = entry.table.name, entry.table.shape[0], len(entry.gathers)
                read = f"read by {lookups} Gather{'s' if lookups > 1 else ''}"
                if blocks:
                    snr = to_block_lookup(entry, namer, place, wo.bits, wo.block_size, wo.symmetric)
                    done[name] = (f"{NAME}: rtn {'' if wo.symmetric else 'u'}int{wo.bits} block {wo.block_size} "
                                  f"along each row -> com.microsoft.GatherBlockQuantized, {read}; the table's SNR {snr:.1f} dB")
                else:
                    snr = to_row_lookup(entry, namer, place)
                    done[name] = f"{NAME}: int8, one scale per row ({rows} rows), {read}; the table's SNR {snr:.1f} dB"
                floats.pop(name, None)
            place.apply()
        model.decisions[DECISION] = dict(sorted(done.items()))
        model.touch()
        return PassResult(model, True, {"tables": len(tables), "gathers": sum(len(t.gathers) for t in tables)})
