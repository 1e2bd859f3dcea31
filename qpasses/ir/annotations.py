"""The quantization table: one TensorQuant decision per tensor name, with the reasons for it.

Contract between the passes:
- annotate-types creates an entry for every tensor it decides to quantize (role, qtype, symmetric,
  axis, reduce_range, restricted, shares, fixed qparams from overrides) and appends reasons to ``why``.
- propagate-mixed-precision changes ``qtype`` and sets ``convert`` on entries.
- compute-qparams fills ``scale``/``zero_point`` (and those of ``convert``) for every entry that is
  not ``fixed``: activations from ``model.ranges`` (or ``rmin``/``rmax``), weights from their values,
  biases from ``derived_from`` (input scale * weight scale), ``shares`` from the shared tensor.
- fix-bias-scales may raise weight scales; insert-qdq and insert-converts only read the table.

Keys are tensor names, also for the tensors of If/Loop/Scan bodies (qpasses.analysis.scopes):
- a name defined (graph input, node output, own initializer) in exactly one graph of the model is
  its key, wherever it lives: ONNX keeps names unique within a graph and forbids a body to redefine
  a name of an enclosing graph, and exporters keep them unique across bodies in practice;
- a name that two sibling bodies both define (legal: the branches of one If, two Loops) is
  ambiguous: it gets no entry and stays float, its reason naming the graphs (``decisions.FLOAT``);
  equal constants of one name (an outer initializer copied into each body) count as one tensor;
- an outer tensor read inside a body is the outer graph's tensor: one entry, quantized where it is
  produced; insert-qdq gives each body reading it a DequantizeLinear of its own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from typing import Iterator

import numpy as np

ROLES = ("activation", "weight", "bias")


@dataclass
class Convert:
    """Readers in ``recv_nodes`` read the tensor re-quantized to ``qtype`` (a DQ->Q pair)."""

    qtype: str
    recv_nodes: list[str]
    symmetric: bool | None = None
    scale: list[float] | None = None
    zero_point: list[int] | None = None


@dataclass
class TensorQuant:
    """How one tensor is quantized. ``scale``/``zero_point`` are lists (length 1 when per-tensor)."""

    qtype: str
    role: str = "activation"
    symmetric: bool = False
    axis: int | None = None
    reduce_range: bool = False
    restricted: bool = False          # uint8 zero point snapped to 0 or 128
    rmin: float | None = None         # user-fixed range (overrides calibration)
    rmax: float | None = None
    scale: list[float] | None = None
    zero_point: list[int] | None = None
    fixed: bool = False               # scale/zero_point given by the user or a preset: never recomputed
    shares: str | None = None         # takes its qparams from this tensor (shape-only ops)
    derived_from: list[str] | None = None  # bias: [input activation, weight]; scale = product
    convert: Convert | None = None
    why: list[str] = field(default_factory=list)

    @property
    def per_channel(self) -> bool:
        return self.axis is not None

    def converted_for(self, node: str) -> bool:
        """Whether reader ``node`` reads the tensor through its convert: it is in ``recv_nodes``, or
        ``recv_nodes`` is empty (every reader, as insert-converts reads it)."""
        return self.convert is not None and (not self.convert.recv_nodes or node in self.convert.recv_nodes)

    def qtype_read_by(self, node: str) -> str:
        """The type reader ``node`` reads the tensor in: the convert's when it is converted for it."""
        return self.convert.qtype if self.converted_for(node) else self.qtype

    def because(self, reason: str) -> "TensorQuant":
        """Append a reason (returns self, for chaining)."""
        self.why.append(reason)
        return self

    def with_qparams(self, scale, zero_point, reason: str | None = None) -> "TensorQuant":
        new = replace(self, scale=[float(s) for s in np.ravel(scale)],
                      zero_point=[int(z) for z in np.ravel(zero_point)], why=list(self.why))
        return new.because(reason) if reason else new

    def to_dict(self) -> dict:
        """JSON-ready dict without unset fields (shallow: asdict's deep copy is slow on big tables)."""
        d = {}
        for name in _TQ_FIELDS:
            value = getattr(self, name)
            # ``is``/``==`` tests, not ``in``: axis 0 == False would be dropped by a membership test
            if value is None or value is False or (isinstance(value, list) and not value):
                continue
            d[name] = _convert_dict(value) if isinstance(value, Convert) else value
        d["qtype"] = self.qtype
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TensorQuant":
        d = {k: v for k, v in d.items() if k in _TQ_FIELDS}
        if d.get("convert") is not None:
            d["convert"] = Convert(**d["convert"])
        return cls(**d)


_TQ_FIELDS = tuple(f.name for f in fields(TensorQuant))


def _convert_dict(c: Convert) -> dict:
    return {k: v for k, v in vars(c).items() if v is not None}


class QuantTable:
    """tensor name -> TensorQuant. Serialises to JSON for the model's metadata_props."""

    def __init__(self, entries: dict[str, TensorQuant] | None = None):
        self._entries: dict[str, TensorQuant] = dict(entries or {})

    def __getitem__(self, name: str) -> TensorQuant:
        return self._entries[name]

    def __setitem__(self, name: str, tq: TensorQuant) -> None:
        if tq.role not in ROLES:
            raise ValueError(f"unknown role {tq.role!r} for tensor {name!r}")
        self._entries[name] = tq

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str, default=None):
        return self._entries.get(name, default)

    def items(self):
        return self._entries.items()

    def rename(self, old: str, new: str) -> None:
        """Move an entry to a new tensor name and fix every reference to it."""
        self.rename_many({old: new})

    def rename_many(self, names: dict[str, str]) -> None:
        """``rename`` for many tensors in one pass over the table (new names are not renamed again)."""
        if not names:
            return
        for old, new in names.items():
            if old in self._entries:
                self._entries[new] = self._entries.pop(old)
        for tq in self._entries.values():
            if tq.shares in names:
                tq.shares = names[tq.shares]
            if tq.derived_from and any(n in names for n in tq.derived_from):
                tq.derived_from = [names.get(n, n) for n in tq.derived_from]

    def clear(self) -> None:
        self._entries.clear()

    def to_json(self) -> str:
        return json.dumps({k: self._entries[k].to_dict() for k in sorted(self._entries)},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "QuantTable":
        return cls({k: TensorQuant.from_dict(v) for k, v in json.loads(text).items()})

    def __eq__(self, other) -> bool:
        return isinstance(other, QuantTable) and self.to_json() == other.to_json()
