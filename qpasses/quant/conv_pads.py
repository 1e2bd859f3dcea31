"""How a Conv pads each spatial axis: its explicit ``pads`` or its ``auto_pad`` rule, in one place."""
from __future__ import annotations


def auto_pad_of(attrs: dict) -> str:
    """The node's auto_pad attribute as text (onnx-graphsurgeon may hand it over as bytes)."""
    value = attrs.get("auto_pad", "NOTSET")
    return value.decode() if isinstance(value, bytes) else str(value)


def conv_pads(auto_pad: str, pads, sizes, kernel, strides, dilations) -> tuple[list[int], list[int]]:
    """(begins, ends) per spatial axis of a Conv reading an input of spatial ``sizes``: VALID pads
    nothing, SAME_UPPER/SAME_LOWER pad so that the output has ceil(size / stride) positions (the odd
    one at the end / the beginning), NOTSET reads ``pads`` (begins then ends)."""
    rank = len(sizes)
    if auto_pad == "VALID":
        return [0] * rank, [0] * rank
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for size, k, s, d in zip(sizes, kernel, strides, dilations):
            total = max(0, (-(-size // s) - 1) * s + (k - 1) * d + 1 - size)
            begins.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
            ends.append(total - begins[-1])
        return begins, ends
    pads = [int(p) for p in pads]
    return pads[:rank], pads[rank:2 * rank]
