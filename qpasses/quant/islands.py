"""Quantized islands: tensors an 8-bit grid would round where no integer kernel reads or writes them.

A data-movement op (its outputs share its input's qparams) that starts a quantized region on its own
(Split, Pad) quantizes its input even when only float ops surround it: yolo_detector's class logits
went through a Concat -> Split whose Q -> DQ, on a grid spanning the box logits too (step 0.34),
fed the final Sigmoid, and no kernel ran in 8 bits for it."""
from __future__ import annotations


def unanchored(nodes: list[tuple[bool, list[str], list[str]]], quantized: set[str], keep: set[str]) -> set[str]:
    """The tensors of ``quantized`` connected, through quantized data-movement ops only, to no
    quantized op that computes (and to none of ``keep``). ``nodes``: (moves data, input names,
    output names) of every quantized node."""
    parent = {name: name for name in quantized}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    anchored = set(keep & quantized)
    for moves, inputs, outputs in nodes:
        names = [n for n in inputs + outputs if n in parent]
        if not moves:
            anchored.update(names)
            continue
        for other in names[1:]:
            parent[root(other)] = root(names[0])
    held = {root(n) for n in anchored}
    return {n for n in quantized if root(n) not in held}
