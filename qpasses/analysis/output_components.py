"""Output components: which model outputs are concatenations, and of which pieces (static, from
the float model). The accuracy objective (qpasses.evaluation.objective) scores each piece on its own.

An output whose producer -- looking through Identity and Transpose nodes (a Transpose moves the
axis) -- is a Concat along a non-batch axis (axis 0 is taken as the batch axis), with a static
size along that axis for every input (value_info, else onnx shape inference on a copy whose big
initializers are data-less stubs, else onnxruntime's symbolic shape inference on it), has one
component per non-empty input, named ``output[input_tensor]`` (``output[start:stop]`` when an input
tensor repeats). Every other output is one component named like the output.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..errors import ModelError, first_line
from ..ir.graphutil import DEFAULT_DOMAINS


@dataclass(frozen=True)
class Component:
    """A piece of a model output: ``output[start:stop]`` along ``axis`` (``axis`` None: all of it)."""

    output: str
    name: str
    axis: int | None = None
    start: int = 0
    stop: int | None = None
    source: str | None = None   # the Concat input tensor it comes from

    def take(self, array: np.ndarray) -> np.ndarray:
        """This component of one feed's output (a view)."""
        if self.axis is None:
            return array
        index = [slice(None)] * array.ndim
        index[self.axis] = slice(self.start, self.stop)
        return array[tuple(index)]

    @property
    def where(self) -> str:
        """``out[0:4] on axis 1`` (empty for a whole output)."""
        return "" if self.axis is None else f"{self.output}[{self.start}:{self.stop}] on axis {self.axis}"


def output_components(model) -> dict[str, list[Component]]:
    """Per graph output of the float ``model`` (path, ModelProto, bytes or QModel), its components
    in order (one component for an output that is not a Concat along a non-batch axis)."""
    graph_model = _proto(model)
    graph = graph_model.graph
    producers = {out: node for node in graph.node for out in node.output}
    shapes = _static_shapes(graph)
    inferences = [_inferred_shapes, _symbolic_shapes]   # tried in turn, each once, when shapes are missing
    stripped = None
    result = {}
    for vi in graph.output:
        found = _concat_pieces(vi.name, producers, shapes)
        while found == "need shapes" and inferences:
            stripped = stripped or _stripped(graph_model)
            shapes.update({k: v for k, v in inferences.pop(0)(stripped).items() if k not in shapes or None in shapes[k]})
            found = _concat_pieces(vi.name, producers, shapes)
        result[vi.name] = found if isinstance(found, list) else [Component(vi.name, vi.name)]
    return result


def _proto(model) -> onnx.ModelProto:
    from ..ir.model import QModel

    if isinstance(model, QModel):
        return model.to_proto(metadata=False, weights={})   # big weights as stubs: not copied
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    try:
        return onnx.load(str(model), load_external_data=False)
    except Exception as exc:
        raise ModelError(f"{model}: not a readable ONNX model ({first_line(exc)})") from None


def _dims(type_proto) -> tuple | None:
    """Static dims (int or None per axis) of a tensor type, None when the rank is unknown."""
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in type_proto.tensor_type.shape.dim)


def _static_shapes(graph: onnx.GraphProto) -> dict[str, tuple]:
    shapes = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        dims = _dims(vi.type)
        if dims is not None:
            shapes[vi.name] = dims
    for init in graph.initializer:
        shapes[init.name] = tuple(init.dims)
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    shapes[node.output[0]] = tuple(attr.t.dims)
    return shapes


def _stripped(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy for shape inference whose big initializers are data-less stubs (small ones stay:
    shape inference reads them, e.g. Reshape's shape)."""
    stripped = onnx.ModelProto()
    for field in ("ir_version", "producer_name", "domain", "model_version"):
        setattr(stripped, field, getattr(model, field))
    stripped.opset_import.extend(model.opset_import)
    stripped.functions.extend(model.functions)
    graph, src = stripped.graph, model.graph
    graph.name = src.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(graph, field).extend(getattr(src, field))
    for init in src.initializer:
        if init.ByteSize() <= 4096:
            graph.initializer.append(init)
        else:
            stub = graph.initializer.add()
            stub.name, stub.data_type = init.name, init.data_type
            stub.dims.extend(init.dims)
            stub.data_location = onnx.TensorProto.EXTERNAL
            entry = stub.external_data.add()
            entry.key, entry.value = "location", "qpasses-shape-stub"
    return stripped


def _inferred_shapes(stripped: onnx.ModelProto) -> dict[str, tuple]:
    """Shapes from onnx shape inference; {} when inference fails."""
    try:
        inferred = onnx.shape_inference.infer_shapes(stripped, strict_mode=False)
    except Exception:
        return {}
    return _static_shapes(inferred.graph)


def _symbolic_shapes(stripped: onnx.ModelProto) -> dict[str, tuple]:
    """Shapes from onnxruntime's symbolic shape inference, which follows Shape -> Gather -> Concat ->
    Reshape chains (an exporter's dynamic-size arithmetic) that onnx's leaves unknown; {} when it fails."""
    try:
        inferred = _symbolic_inference().infer_shapes(stripped, auto_merge=True, guess_output_rank=False)
    except Exception:
        return {}
    return _static_shapes(inferred.graph) if inferred is not None else {}


SYMBOLIC_MODULE = "onnxruntime.tools.symbolic_shape_infer"
LOADED_AS = "qpasses._symbolic_shape_infer"


def _symbolic_inference():
    """onnxruntime's SymbolicShapeInference, loaded from its own file: importing it by name runs
    onnxruntime/tools/__init__.py, which imports torch when torch is installed (1.2 s of yolo_detector's
    10 s quantization here); the module itself needs only onnx, numpy and sympy. By name when an
    onnxruntime build keeps it elsewhere."""
    module = sys.modules.get(SYMBOLIC_MODULE) or sys.modules.get(LOADED_AS)
    if module is None:
        import onnxruntime

        path = Path(onnxruntime.__file__).parent / "tools" / "symbolic_shape_infer.py"
        if not path.is_file():
            return importlib.import_module(SYMBOLIC_MODULE).SymbolicShapeInference
        spec = importlib.util.spec_from_file_location(LOADED_AS, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[LOADED_AS] = module
    return module.SymbolicShapeInference


def _concat_pieces(output: str, producers: dict, shapes: dict):
    """The components of ``output`` if it is a Concat along a non-batch axis (looking through
    Identity and Transpose), "need shapes" when a needed static shape is missing, else None."""
    perms, name = [], output
    while True:
        node = producers.get(name)
        if node is None or node.domain not in DEFAULT_DOMAINS:
            return None
        if node.op_type == "Identity":
            name = node.input[0]
        elif node.op_type == "Transpose":
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            perms.append(perm)
            name = node.input[0]
        elif node.op_type == "Concat":
            break
        else:
            return None
    inputs = [i for i in node.input if i]
    if len(inputs) < 2:
        return None
    if any(shapes.get(i) is None for i in inputs):
        return "need shapes"
    rank = len(shapes[inputs[0]])
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    if rank == 0 or not -rank <= axis < rank or any(len(shapes[i]) != rank for i in inputs):
        return None
    axis %= rank
    if axis == 0:   # the batch axis: pieces are samples, not parts of a result
        return None
    sizes = [shapes[i][axis] for i in inputs]
    if any(s is None for s in sizes):
        return "need shapes"
    for perm in reversed(perms):   # from the Concat out to the graph output
        perm = list(reversed(range(rank))) if perm is None else perm
        if sorted(perm) != list(range(rank)):
            return None
        axis = perm.index(axis)
    pieces, start = [], 0
    for tensor, size in zip(inputs, sizes):
        if size > 0:
            pieces.append((tensor, start, start + size))
        start += size
    if len(pieces) < 2:
        return None
    unique = len({t for t, _, _ in pieces}) == len(pieces)
    return [Component(output, f"{output}[{t}]" if unique else f"{output}[{a}:{b}]", axis, a, b, t)
            for t, a, b in pieces]
