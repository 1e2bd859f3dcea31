"""The providers ``qpasses compare --per-layer`` runs a QDQ model on, reading its integer tensors.

Each backend runs the model twice: as deployed (nothing added: the output SNR the user gets) and
with every activation's QuantizeLinear output added to the model's outputs. The Q output is the
integer tensor itself and the last tensor of a fused group (DQ -> Conv -> Q becomes one
QLinearConv writing it), so asking for it leaves the fusion in place; a DequantizeLinear output
as a model output would keep the DQ from fusing into its reader. ``notes`` says what the added
outputs still changed (op types, precisions), and the deployed outputs are compared with the
exposed run's outputs by the caller.
"""
from __future__ import annotations

import collections
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx

from ..calibration.sessions import ort_session
from ..errors import QpassesError

INT_KERNELS = {"QLinearConv", "NhwcQLinearConv", "QGemm", "QLinearMatMul", "QLinearConvTranspose",
               "MatMulInteger", "ConvInteger", "Convolution", "GroupConvolution", "Deconvolution",
               "FullyConnected", "MatMul"}
_ORT_CAUSES = {
    "requant": "fused int8 kernel: exact int32 sum requantized by one float multiplier (the simulation "
               "quantizes a float32 sum)",
    "QLinearAdd": "requantized Add: the integer kernel rescales both inputs to the output grid (the "
                  "simulation adds dequantized floats)",
    "QLinearMul": "requantized Mul: integer kernel on the inputs' grids (the simulation multiplies floats)",
    "QLinearConcat": "requantizing Concat: inputs on other grids are requantized to the output's",
    "QLinearSigmoid": "lookup-table kernel (256 precomputed outputs)",
    "QLinearLeakyRelu": "lookup-table kernel (256 precomputed outputs)",
    "QLinearSoftmax": "integer Softmax kernel (lookup table)",
    "average": "integer average with its own rounding",
}
_REQUANT = {"QLinearConv", "NhwcQLinearConv", "QGemm", "QLinearMatMul", "QLinearConvTranspose"}
_AVERAGE = {"QLinearAveragePool", "QLinearGlobalAveragePool", "QLinearReduceMean"}


def with_outputs(proto: onnx.ModelProto, names) -> onnx.ModelProto:
    present = {o.name for o in proto.graph.output} | {i.name for i in proto.graph.input}
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    out.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in present)
    return out


class OrtInt8:
    """onnxruntime CPU at ORT_ENABLE_ALL: its QDQ fusions into QLinear*/QGemm kernels, NHWC layout."""

    name = "ort-int8"

    def __init__(self, qproto: onnx.ModelProto, qnames: list[str]):
        self.outputs = [o.name for o in qproto.graph.output]
        self.qnames = list(qnames)
        self.source = {n.name for n in qproto.graph.node}
        exposed = with_outputs(qproto, self.qnames)
        self.qproto = qproto
        self._deployed, self._exposed = _ort(qproto), _ort(exposed)
        plain, graph = _ort_graph(qproto), _ort_graph(exposed)
        self._producer = {o: n for n in graph.node for o in n.output}
        self.readable = set(self.qnames)
        self.dropped: set[str] = set()
        self.notes = _op_changes(collections.Counter(n.op_type for n in plain.node),
                                 collections.Counter(n.op_type for n in graph.node))

    def run(self, feed) -> dict[str, np.ndarray]:
        names = self.qnames + self.outputs
        return dict(zip(names, self._exposed.run(names, feed)))

    def deployed(self, feed) -> list[np.ndarray]:
        return self._deployed.run(self.outputs, feed)

    def reading(self, names):
        """The model compiled with ``names`` read: a function of a feed giving its outputs."""
        sess = _ort(with_outputs(self.qproto, names))
        return lambda feed: sess.run(self.outputs, feed)

    def _writer(self, name: str):
        """The node computing ``name``, past the Transposes the layout optimizer inserted."""
        node = self._producer.get(name)
        while node is not None and node.op_type == "Transpose" and node.name not in self.source:
            node = self._producer.get(node.input[0])
        return node

    def kernel(self, qname: str) -> str:
        node = self._writer(qname)
        if node is None:
            return "?"
        if node.op_type == "QuantizeLinear":
            before = self._writer(node.input[0])
            return f"{before.op_type if before is not None else 'input'} -> QuantizeLinear"
        return node.op_type

    def cause(self, qname: str) -> str:
        kernel = self.kernel(qname)
        op = kernel.split(" ")[0]
        if op in _REQUANT:
            return _ORT_CAUSES["requant"]
        if op in _AVERAGE:
            return _ORT_CAUSES["average"]
        if op in _ORT_CAUSES:
            return _ORT_CAUSES[op]
        if kernel.endswith("QuantizeLinear"):
            return (f"float {op} at full optimization, then QuantizeLinear (float kernel rounding"
                    + (", an op the optimizer fused" if op in _ORT_FUSED else "") + ")")
        return f"{kernel} on integers"


_ORT_FUSED = {"FusedConv", "FusedGemm", "FusedMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
              "Gelu", "BiasGelu", "FastGelu", "QuickGelu", "SkipLayerNormalization", "LayerNormalization",
              "BiasSoftmax", "BiasAdd", "NhwcFusedConv"}


def _ort(proto: onnx.ModelProto):
    return ort_session(proto.SerializeToString(), optimization="all")


def _ort_graph(proto: onnx.ModelProto) -> onnx.GraphProto:
    """The graph onnxruntime executes at ORT_ENABLE_ALL (its saved optimized model)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        ort_session(proto.SerializeToString(), optimization="all", optimized_to=path)
        return onnx.load(path, load_external_data=False).graph


def _op_changes(plain: collections.Counter, exposed: collections.Counter) -> list[str]:
    diff = sorted(set(plain) | set(exposed))
    changed = [f"{op} {plain[op]} -> {exposed[op]}" for op in diff if plain[op] != exposed[op]]
    if not changed:
        return ["the added outputs left the optimized graph's op counts unchanged"]
    kernels = [c for c in changed if c.split(" ")[0] not in _MOVES]
    return ["the added outputs changed the optimized graph's op counts: " + ", ".join(changed)
            + (" (layout and data-movement ops only)" if not kernels else "")]


_MOVES = {"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "MaxPool", "NhwcMaxPool"}


class OpenVino:
    """OpenVINO's CPU plugin (its low-precision transformations run Q/DQ models in u8/i8)."""

    name = "openvino"

    def __init__(self, qproto: onnx.ModelProto, qnames: list[str]):
        try:
            import openvino as ov
        except ImportError:
            raise QpassesError("--provider openvino needs OpenVINO: pip install 'qpasses[openvino]'") from None
        self.outputs = [o.name for o in qproto.graph.output]
        quantizers = [n for n in qproto.graph.node if n.op_type == "QuantizeLinear"]
        self.q_node = {n.output[0]: n.name for n in quantizers}
        writer = {o: n.name for n in qproto.graph.node for o in n.output}
        self.compute = {n.output[0]: writer.get(n.input[0], "") for n in quantizers}  # the float op quantized
        self._core, self._bytes = ov.Core(), qproto.SerializeToString()
        core, plain, exposed = self._core, self._read(), self._read()
        known = {name for op in exposed.get_ordered_ops() for port in op.outputs() for name in port.get_names()}
        self.qnames = [q for q in qnames if q in known]
        self.readable = set(self.qnames)
        if self.qnames:
            exposed.add_outputs(self.qnames)
        self._deployed, self._exposed = core.compile_model(plain, "CPU"), core.compile_model(exposed, "CPU")
        self.layers_plain, self.layers = _ov_layers(self._deployed), _ov_layers(self._exposed)
        self.dropped = {q for q in self.qnames if self.q_node.get(q) not in self.layers_plain}
        self.precision = core.get_property("CPU", "INFERENCE_PRECISION_HINT").to_string()
        changed = sorted(name for name, layer in self.layers_plain.items()
                         if name in self.layers and layer[1:] != self.layers[name][1:])
        self.notes = [f"OpenVINO {ov.__version__}, CPU inference precision {self.precision}",
                      (f"the added outputs changed the layer type or precision of {len(changed)} original "
                       f"layers (e.g. {', '.join(changed[:3])})" if changed else
                       "the added outputs left every original layer's type and precision unchanged")]
        kinds = {name.split("/")[0]: layer[2] for name, layer in self.layers_plain.items() if layer[1] in INT_KERNELS}
        floats = sorted(name for name in uint8_weight_readers(qproto) if kinds.get(name, "u8") not in ("u8", "i8"))
        if floats:
            self.notes.append(
                f"{len(floats)} layers with uint8 weights run in float ({', '.join(floats[:5])}): "
                "protect-pair-sums{fix=uint8} (cpu x86-64) stores them so for CPUs without VNNI, and OpenVINO "
                "runs int8 weights only; its default, fix=grid, keeps them int8 on every CPU")

    def run(self, feed) -> dict[str, np.ndarray]:
        result = self._exposed.create_infer_request().infer(feed)
        return {name: np.asarray(value) for port, value in result.items() for name in port.get_names()}

    def deployed(self, feed) -> list[np.ndarray]:
        return _ov_outputs(self._deployed, feed, self.outputs)

    def _read(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.onnx"
            path.write_bytes(self._bytes)
            return self._core.read_model(str(path))

    def reading(self, names):
        """The model compiled with ``names`` read: a function of a feed giving its outputs."""
        model = self._read()
        if names:
            model.add_outputs(list(names))
        compiled = self._core.compile_model(model, "CPU")
        return lambda feed: _ov_outputs(compiled, feed, self.outputs)

    def _layer(self, qname: str, layers: dict) -> tuple | None:
        return layers.get(self.q_node.get(qname))

    def kernel(self, qname: str) -> str:
        layer = self._layer(qname, self.layers)
        return "?" if layer is None else f"{layer[1]} {layer[2]}->{layer[3]}"

    def cause(self, qname: str) -> str:
        if qname in self.dropped:
            return "a Q/DQ pair the provider dropped (its QuantizeLinear is in no executed layer as deployed)"
        layer = self._layer(qname, self.layers)
        if layer is None:
            return "?"
        _, kind, runtime, output = layer
        deployed = self._layer(qname, self.layers_plain) or layer
        writer = self.layers.get(self.compute.get(qname, ""), layer)
        if "bf16" in (runtime, output, deployed[2], deployed[3], writer[2], writer[3]):
            return "float section run in bf16 (OpenVINO's CPU inference precision here), then quantized"
        if kind in INT_KERNELS and runtime in ("u8", "i8"):
            return "int8 oneDNN kernel, requantization fused as its post-ops (rounding in float32)"
        if kind == "Eltwise" and runtime in ("u8", "i8"):
            return "requantized Eltwise (Add/Mul on the integer inputs, quantization fused)"
        if kind == "Subgraph":
            return f"float subgraph (Snippets) in {runtime}, then quantized"
        return f"{kind} in {runtime}"


def uint8_weight_readers(proto: onnx.ModelProto) -> set[str]:
    """Names of the nodes whose weight (input 1) is dequantized from a uint8 initializer."""
    inits = {t.name: t.data_type for t in proto.graph.initializer}
    uint8 = {n.output[0] for n in proto.graph.node
             if n.op_type == "DequantizeLinear" and inits.get(n.input[0]) == onnx.TensorProto.UINT8}
    return {n.name for n in proto.graph.node if len(n.input) > 1 and n.input[1] in uint8}


def _ov_outputs(compiled, feed, outputs: list[str]) -> list[np.ndarray]:
    result = compiled.create_infer_request().infer(feed)
    by_name = {name: np.asarray(value) for port, value in result.items() for name in port.get_names()}
    return [by_name[o] for o in outputs]


def _ov_layers(compiled) -> dict[str, tuple]:
    """Original (ONNX) node name -> (runtime layer, its type, runtime precision, output precisions)."""
    found = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        get = lambda key: info[key].astype(str) if key in info else ""   # noqa: E731
        layer = (op.get_friendly_name(), get("layerType"), get("runtimePrecision"), get("outputPrecisions"))
        for name in get("originalLayersNames").split(","):
            if name:
                found.setdefault(name, layer)
    return found
