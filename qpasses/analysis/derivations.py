"""Qparams one entry derives from others: the compute options of an entry, the scale a node reads
a tensor with (its convert's), and a bias's reader and axis."""
from __future__ import annotations

from ..annotations import TensorQuant
from ..config import QuantConfig
from ..errors import ModelError
from ..ir import QModel


def qparams_options(tq: TensorQuant, config: QuantConfig, *, symmetric: bool | None = None) -> dict:
    """Keyword options of qparams.compute_qparams for a table entry under a config."""
    return {
        "symmetric": tq.symmetric if symmetric is None else symmetric,
        "reduce_range": tq.reduce_range,
        "restricted": tq.restricted,
        "minimum_real_range": config.minimum_real_range,
        "power_of_two": config.calibration.method == "pow2",
        "scale_type": config.scale_type,
    }


def describe_options(qt: str, opts: dict) -> str:
    """Short text for a ``why`` line: 'int8 symmetric, pow2'."""
    mode = "symmetric" if opts["symmetric"] else "restricted" if opts["restricted"] else "asymmetric"
    extra = [name for name, on in (("reduce-range", opts["reduce_range"]), ("pow2", opts["power_of_two"]),
                                   ("float16 scale", opts["scale_type"] == "float16")) if on]
    if opts["minimum_real_range"]:
        extra.append(f"minimum range {opts['minimum_real_range']:g}")
    return ", ".join([f"{qt} {mode}"] + extra)


def bias_reader(model: QModel, bias: str) -> str | None:
    """The node that reads a bias constant (annotate-types gives every bias a single reader)."""
    tensor = model.tensors().get(bias)
    return tensor.outputs[0].name if tensor is not None and tensor.outputs else None


def scale_read_by(entry: TensorQuant, node: str | None) -> list[float] | None:
    """The scale ``node`` actually reads a tensor with: its convert's when ``node`` receives the convert."""
    conv = entry.convert
    if conv is not None and conv.scale and node is not None and (not conv.recv_nodes or node in conv.recv_nodes):
        return conv.scale
    return entry.scale


def bias_axis(model: QModel, name: str, channels: int) -> int | None:
    """Axis of a per-channel bias with ``channels`` values: (N) -> 0, (1, N) -> 1."""
    if channels <= 1:
        return None
    tensor = model.tensors().get(name)
    shape = list(getattr(tensor, "shape", None) or [channels])
    for axis in range(len(shape) - 1, -1, -1):
        if shape[axis] == channels:
            return axis
    raise ModelError(f"bias '{name}': shape {shape} has no axis of size {channels} (the weight's channels)")
