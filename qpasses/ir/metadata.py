"""The ``qpasses.*`` entries of a saved model's metadata_props, read with their types checked.

A model written by qpasses carries its quantization table, facts, ranges and decisions as JSON.
A model edited by hand or by another tool may hold anything there: each entry is parsed and its
schema checked, and every problem found is reported in one ModelError line naming the entry.
An entry longer than PACK_ABOVE characters is stored zlib-compressed in base64 behind PACKED (a
detector's table and why-lines are ~9 % of its int8 weights as plain JSON, ~3 % packed; the byte
classifier's 26 KB of table and decisions were 11 % of its 0.1 MB of weights at a 16 KiB threshold).
"""
from __future__ import annotations

import base64
import binascii
import json
import numbers
import zlib

from ..errors import ModelError

QUANT_TABLE_KEY = "qpasses.quant_table"
FACTS_KEY = "qpasses.facts"
RANGES_KEY = "qpasses.ranges"
OBSERVED_KEY = "qpasses.observed"
DECISIONS_KEY = "qpasses.decisions"
KEYS = (QUANT_TABLE_KEY, FACTS_KEY, RANGES_KEY, OBSERVED_KEY, DECISIONS_KEY)
PACKED = "zlib:"
PACK_ABOVE = 1024


def pack(text: str) -> str:
    """``text`` as stored: itself when short, else PACKED + base64 of its zlib compression."""
    if len(text) <= PACK_ABOVE:
        return text
    return PACKED + base64.b64encode(zlib.compress(text.encode("utf-8"), 9)).decode("ascii")


def unpack(stored: str) -> str:
    """The text ``pack`` stored (ValueError when a packed entry does not decode)."""
    if not isinstance(stored, str) or not stored.startswith(PACKED):
        return stored
    try:
        return zlib.decompress(base64.b64decode(stored[len(PACKED):], validate=True)).decode("utf-8")
    except (binascii.Error, zlib.error, UnicodeDecodeError) as exc:
        raise ValueError(f"packed but does not decode ({type(exc).__name__})") from None


def read_saved(meta: dict[str, str], *, entries_checked: bool = True) -> dict:
    """Pop the qpasses entries from ``meta`` (key -> JSON text) and return them parsed:
    ``quant`` (a QuantTable or None), ``facts``, ``ranges``, ``observed``, ``decisions``
    (``entries_checked=False``: the quant table's entries are taken as qpasses wrote them)."""
    from .annotations import QuantTable

    problems: list[str] = []
    texts = {key: meta.pop(key) for key in KEYS if key in meta}
    parsed = {}
    for key, text in texts.items():
        try:
            parsed[key] = json.loads(unpack(text))
        except ValueError as exc:
            problems.append(f"metadata '{key}' is not JSON ({getattr(exc, 'msg', None) or exc})")
        except (TypeError, RecursionError) as exc:
            problems.append(f"metadata '{key}' is not JSON ({type(exc).__name__})")
    table = parsed.get(QUANT_TABLE_KEY, {})
    facts = parsed.get(FACTS_KEY, [])
    ranges = parsed.get(RANGES_KEY, {})
    observed = parsed.get(OBSERVED_KEY, {})
    decisions = parsed.get(DECISIONS_KEY, {})
    if not isinstance(facts, list) or not all(isinstance(f, str) for f in facts):
        problems.append(f"metadata '{FACTS_KEY}' must be a list of fact names, got {_short(facts)}")
        facts = []
    for key, value in ((RANGES_KEY, ranges), (OBSERVED_KEY, observed)):
        if not isinstance(value, dict) or not all(_is_range(v) for v in value.values()):
            bad = next((k for k, v in value.items() if not _is_range(v)), None) if isinstance(value, dict) else None
            where = f" (entry '{bad}' is {_short(value[bad])})" if bad is not None else f", got {_short(value)}"
            problems.append(f"metadata '{key}' must map tensor names to [min, max] pairs of numbers{where}")
    if not isinstance(decisions, dict):
        problems.append(f"metadata '{DECISIONS_KEY}' must be a JSON object, got {_short(decisions)}")
        decisions = {}
    else:
        problems += _decision_problems(decisions)
    if not isinstance(table, dict):
        problems.append(f"metadata '{QUANT_TABLE_KEY}' must be a JSON object of tensor entries, got {_short(table)}")
        table = {}
    elif entries_checked:
        for name, entry in table.items():
            problems += [f"metadata '{QUANT_TABLE_KEY}': entry '{name}': {p}" for p in _entry_problems(entry)]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ModelError("; ".join(problems[:3]) + more)
    quant = QuantTable.from_json(json.dumps(table)) if QUANT_TABLE_KEY in texts else None
    return {"quant": quant, "facts": facts, "decisions": decisions,
            "ranges": {k: tuple(v) for k, v in ranges.items()},
            "observed": {k: tuple(v) for k, v in observed.items()}}


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_range(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(_number(x) for x in v)


def _decision_problems(decisions: dict) -> list[str]:
    where = f"metadata '{DECISIONS_KEY}'"
    problems = [f"{where}: '{key}' must be a JSON object, got {_short(value)}"
                for key, value in decisions.items() if key in ("float", "calibration", "bias_correction")
                and not isinstance(value, dict)]
    floats = decisions.get("float")
    if isinstance(floats, dict):
        for name, row in floats.items():
            if not (isinstance(row, dict) and isinstance(row.get("reason"), str) and isinstance(row.get("pass"), str)):
                problems.append(f"{where}: float['{name}'] must be {{\"reason\": text, \"pass\": text}}, got {_short(row)}")
    return problems


_ENTRY_TYPES = {   # field -> (test, what it must be); None is allowed for every optional field
    "role": (lambda v: v in ("activation", "weight", "bias"), "activation, weight or bias"),
    "symmetric": (lambda v: isinstance(v, bool), "true or false"),
    "reduce_range": (lambda v: isinstance(v, bool), "true or false"),
    "restricted": (lambda v: isinstance(v, bool), "true or false"),
    "fixed": (lambda v: isinstance(v, bool), "true or false"),
    "axis": (_integer, "an integer"),
    "rmin": (_number, "a number"),
    "rmax": (_number, "a number"),
    "scale": (lambda v: isinstance(v, list) and v and all(_number(x) for x in v), "a list of numbers"),
    "zero_point": (lambda v: isinstance(v, list) and v and all(_integer(x) for x in v), "a list of integers"),
    "shares": (lambda v: isinstance(v, str), "a tensor name"),
    "derived_from": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of tensor names"),
    "why": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of texts"),
}


def _entry_problems(entry) -> list[str]:
    from ..quant.qtypes import QTYPES

    if not isinstance(entry, dict):
        return [f"must be a JSON object, got {_short(entry)}"]
    problems = []
    if entry.get("qtype") not in QTYPES:
        problems.append(f"qtype {_short(entry.get('qtype'))} is not one of {', '.join(QTYPES)}")
    for key, (test, what) in _ENTRY_TYPES.items():
        value = entry.get(key)
        if value is not None and not test(value):
            problems.append(f"{key} must be {what}, got {_short(value)}")
    scale, zp = entry.get("scale"), entry.get("zero_point")
    if isinstance(scale, list) and isinstance(zp, list) and len(scale) != len(zp):
        problems.append(f"{len(scale)} scales but {len(zp)} zero points")
    convert = entry.get("convert")
    if convert is not None:
        if not (isinstance(convert, dict) and convert.get("qtype") in QTYPES
                and isinstance(convert.get("recv_nodes"), list)
                and all(isinstance(n, str) for n in convert["recv_nodes"])
                and set(convert) <= {"qtype", "recv_nodes", "symmetric", "scale", "zero_point"}
                and all(convert.get(k) is None or _ENTRY_TYPES[k][0](convert[k])
                        for k in ("symmetric", "scale", "zero_point"))):
            problems.append(f"convert must be {{qtype, recv_nodes[, symmetric, scale, zero_point]}}, "
                            f"got {_short(convert)}")
    return problems
