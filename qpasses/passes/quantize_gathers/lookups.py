"""Embedding lookups: Gathers whose data input is a large constant float table.

onnxruntime runs a DequantizeLinear of a constant on every run (it never folds one), so a table
must stay quantized through the lookup: the Gather reads the codes and only the rows it selects are
dequantized. A DequantizeLinear in front of the Gather would expand a 30522 x 384 table on every
run (5-40 ms on one core, tools/README.md "Embedding tables").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...evaluation.evaluate import snr_db
from ...ir.graphutil import in_default_domain, overridable_initializers
from ...ir.model import body_graphs, constant_dtype, read_values
from ...weightonly.matmulnbits import nbits_inputs
from ...weightonly.rtn import quantize_rtn

FLOAT_KINDS = ("float32", "float16")
MIN_ROW = 8   # values per row: a scale per shorter row (a table of row scales) saves nothing


@dataclass
class Table:
    """A constant table and the Gathers (axis 0) that read it."""

    table: gs.Constant
    gathers: list[gs.Node] = field(default_factory=list)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(constant_dtype(self.table))

    @property
    def values(self) -> int:
        return math.prod(self.table.shape)


def _axis(node: gs.Node, rank: int) -> int:
    axis = int(node.attrs.get("axis", 0))
    return axis + rank if axis < 0 else axis


def lookup_tables(model, min_values: int, excluded) -> tuple[list[Table], dict[str, str]]:
    """(tables of at least ``min_values`` values, MIN_ROW per row, read only by axis-0 Gathers of the main graph, in
    graph order; {table: why it stays float} for large tables that cannot be quantized so).
    ``excluded(name)``: a node or table name the config keeps float (the reason names the setting)."""
    tables: dict[str, Table] = {}
    feedable = overridable_initializers(model)
    for node in model.graph.nodes:
        if node.op != "Gather" or not in_default_domain(node) or not node.inputs:
            continue
        t = node.inputs[0]
        if not isinstance(t, gs.Constant) or constant_dtype(t) not in FLOAT_KINDS or t.shape is None:
            continue
        if (len(t.shape) < 2 or math.prod(t.shape) < min_values or math.prod(t.shape[1:]) < MIN_ROW
                or _axis(node, len(t.shape)) != 0):
            continue
        tables.setdefault(t.name, Table(t)).gathers.append(node)
    in_bodies = {i.name for body in body_graphs(model.graph) for n in body.nodes for i in n.inputs}
    found, skipped = [], {}
    for name, entry in tables.items():
        others = [n for n in entry.table.outputs if n not in entry.gathers]
        why = next(filter(None, (excluded(n) for n in [name] + [g.name for g in entry.gathers])), None)
        if name in feedable:
            skipped[name] = "a table the user may feed (an initializer listed as a graph input) stays float"
        elif why:
            skipped[name] = why
        elif others:
            skipped[name] = (f"also read by {others[0].op} '{others[0].name}': an int8 copy for the lookup "
                             "would add to the model's size")
        elif name in in_bodies:
            skipped[name] = "also read inside an If/Loop/Scan body"
        elif _whole_numbers(entry.table):
            skipped[name] = "it holds whole numbers only (an index or coordinate table, kept exact)"
        else:
            found.append(entry)
    return found, skipped


def _whole_numbers(t: gs.Constant) -> bool:
    values = read_values(t)
    return bool(np.all(np.asarray(values) == np.rint(values)))


def per_row_int8(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes of a table [V, ...] with one scale per row (max |row| / 127): (codes,
    scales [V, 1, ...] float32). A row of zeros gets scale 0 and codes 0."""
    w = np.asarray(table, np.float32)
    peak = np.abs(w.reshape(w.shape[0], -1)).max(axis=1)
    scales = (peak / 127.0).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0).reshape((-1,) + (1,) * (w.ndim - 1))
    codes = np.clip(np.rint(w / safe), -127, 127).astype(np.int8)
    return codes, scales.reshape((-1,) + (1,) * (w.ndim - 1))


def to_row_lookup(entry: Table, namer, place) -> float:
    """Rewrite every Gather of ``entry`` into Gather(int8 codes) -> Cast -> Mul(Gather(row scales)):
    standard ONNX at any opset, each lookup dequantizing only its rows; the new nodes go right after
    each Gather (``place``: a qdq.Placement). Returns the table's SNR in dB."""
    table = read_values(entry.table)
    codes, scales = per_row_int8(table)
    dtype = entry.dtype
    snr = snr_db(table, codes.astype(np.float32) * scales)
    base = entry.table.name
    q = gs.Constant(namer(f"{base}_int8"), codes)
    s = gs.Constant(namer(f"{base}_row_scale"), scales.astype(dtype))
    to = onnx.helper.np_dtype_to_tensor_dtype(dtype)
    for node in entry.gathers:
        out = node.outputs[0]
        stem = node.name or base
        picked = gs.Variable(namer(f"{stem}_int8"), dtype=np.int8, shape=out.shape)
        real = gs.Variable(namer(f"{stem}_codes"), dtype=dtype, shape=out.shape)
        ids = node.inputs[1]
        row_scale = gs.Variable(namer(f"{stem}_scale"), dtype=dtype,
                                shape=None if ids.shape is None else list(ids.shape) + list(scales.shape[1:]))
        axis = {"axis": node.attrs["axis"]} if "axis" in node.attrs else {}
        node.inputs[0] = q
        node.outputs.clear()
        node.outputs.append(picked)
        place.after(node, [gs.Node("Cast", namer(f"{stem}_Cast"), {"to": to}, [picked], [real]),
                           gs.Node("Gather", namer(f"{stem}_scale_Gather"), dict(axis), [s, ids], [row_scale]),
                           gs.Node("Mul", namer(f"{stem}_dequantize"), {}, [real, row_scale], [out])])
    entry.table.values = np.zeros(0, np.float32)   # the float table goes
    return snr


def block_lookup_problem(entry: Table, block_size: int) -> str | None:
    """Why GatherBlockQuantized cannot hold this table in blocks of ``block_size`` (None: it can)."""
    shape = entry.table.shape
    if len(shape) != 2:
        return f"GatherBlockQuantized takes a 2-D table, this one is {len(shape)}-D"
    if shape[1] % block_size:
        return f"its rows ({shape[1]} values) are not a whole number of blocks of {block_size}"
    return None


def to_block_lookup(entry: Table, namer, place, bits: int, block_size: int, symmetric: bool) -> float:
    """Replace every Gather of a 2-D ``entry`` [V, D] by com.microsoft.GatherBlockQuantized: uint8
    data holding ``bits``-bit codes (two per byte at 4 bits), one scale (and zero point unless
    symmetric) per block of ``block_size`` along D, by round-to-nearest (weightonly.rtn, the table
    as W [K=D, N=V]). Returns the table's SNR in dB."""
    table = np.asarray(read_values(entry.table), np.float32)
    v, d = table.shape
    blocked = quantize_rtn(table.T, bits, block_size, symmetric, pack=bits == 4)
    arrays = nbits_inputs(blocked, entry.dtype)
    snr = snr_db(table, blocked.dequantize().T)
    base = entry.table.name
    inputs = [gs.Constant(namer(f"{base}_q{bits}"), arrays["B"].reshape(v, d * bits // 8)),
              None, gs.Constant(namer(f"{base}_scales"), np.ascontiguousarray(arrays["scales"].reshape(v, -1)))]
    if arrays["zero_points"] is not None:
        inputs.append(gs.Constant(namer(f"{base}_zero_points"), arrays["zero_points"].reshape(v, -1)))
    attrs = {"bits": bits, "block_size": block_size, "gather_axis": 0, "quantize_axis": 1}
    for node in entry.gathers:
        ids, outputs = node.inputs[1], list(node.outputs)
        node.inputs.clear()
        node.outputs.clear()
        place.after(node, [gs.Node("GatherBlockQuantized", node.name, dict(attrs), [inputs[0], ids, *inputs[2:]],
                                   outputs, domain="com.microsoft")])
        place.drop(node)
    entry.table.values = np.zeros(0, np.float32)
    return snr
