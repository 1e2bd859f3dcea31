"""tensor_overrides parsing and validation (onnxruntime's TensorQuantOverrides schema)."""
import numpy as np
import pytest
from onnxruntime.quantization import QuantType

from qpasses.config.overrides import parse_overrides, validate
from qpasses.config.quant_config import QuantConfig
from qpasses.errors import ConfigError
from qpasses.testing import model_from_text

MODEL = """
g (float[1,2,4,4] x) => (float[1,2,4,4] y, float[1,2,4,4] z)
  <float[2,2,1,1] w = {0.5, -0.25, 0.125, 1.0}, float[2] b = {0.1, -0.2}> {
  [conv] c = Conv(x, w, b)
  [relu] y = Relu(c)
  [sig] s = Sigmoid(c)
  [erf] z = Erf(s)
}"""


@pytest.fixture(scope="module")
def model():
    return model_from_text(MODEL)


def problems(model, overrides, **cfg) -> str:
    with pytest.raises(ConfigError) as info:
        validate(model, QuantConfig(tensor_overrides=overrides, **cfg))
    text = str(info.value)
    assert "\n" not in text
    return text


# one line per case: overrides -> a fragment of the message (every message names the tensor)
CASES = [
    ({"cc": [{}]}, "tensor_overrides['cc']: no such tensor in the model (did you mean 'c'?)"),
    ({"c": [{"scal": 0.1}]}, "tensor_overrides['c']: unknown key 'scal' (did you mean 'scale'?)"),
    ({"c": [{"scale": 0.1}]}, "tensor_overrides['c']: 'scale' given without 'zero_point'"),
    ({"c": [{"zero_point": 3}]}, "tensor_overrides['c']: 'zero_point' given without 'scale'"),
    ({"c": [{"scale": 0.1, "zero_point": 0, "symmetric": True}]}, "'symmetric' contradict(s) the fixed"),
    ({"w": [{"scale": 0.1, "zero_point": 0, "reduce_range": True}]}, "'reduce_range' contradict(s)"),
    ({"c": [{"scale": 0.1, "zero_point": 0, "rmin": -1.0, "rmax": 1.0}]}, "'rmin', 'rmax' contradict(s)"),
    ({"w": [{"axis": 0}, {}, {}]}, "tensor_overrides['w']: 3 per-channel overrides but axis 0 has 2 channels"),
    ({"c": [{"quant_type": "uint9"}]}, "tensor_overrides['c']: quant_type 'uint9' is not a quantized type"),
    ({"c": [{"quant_type": "int32"}]}, "quant_type 'int32' is reserved for biases"),
    ({"c": [{"scale": -1.0, "zero_point": 0}]}, "scale -1.0 is not a positive finite number"),
    ({"c": [{"scale": float("nan"), "zero_point": 0}]}, "is not a positive finite number"),
    ({"c": [{"scale": 0.1, "zero_point": 300}]}, "zero_point 300 is outside the uint8 range [0, 255]"),
    ({"w": [{"scale": 0.1, "zero_point": 200}]}, "tensor_overrides['w']: zero_point 200 is outside the int8 range"),
    ({"c": [{"quant_type": "int16", "scale": 0.1, "zero_point": 40000}]}, "outside the int16 range"),
    ({"c": [{"scale": 0.1, "zero_point": 1.5}]}, "zero_point 1.5 is not an integer"),
    ({"c": [{"convert": {"quant_type": "uint16", "recv_nodes": ["rel"]}}]},
     "convert.recv_nodes: 'rel' does not read this tensor (did you mean 'relu'?)"),
    ({"c": [{"convert": {"quant_type": "uint16", "recv_nodes": "relu"}}]}, "recv_nodes must be a list"),
    ({"c": [{"convert": {"quant_type": "uint16", "recv_nodes": []}}]}, "convert.recv_nodes is empty: name the readers"),
    ({"c": [{"convert": {"quant_type": "uint8"}}]}, "convert.quant_type uint8 is the same as the tensor's type"),
    ({"c": [{"convert": {"recv_nodes": ["relu"]}}]}, "tensor_overrides['c']: 'convert' needs a 'quant_type'"),
    ({"c": [{"convert": {"quant_type": "uint16", "reduce_range": True}}]}, "not allowed in 'convert'"),
    ({"c": [{"convert": {"quant_type": "uint16", "rmin": 0.0}}]}, "'convert.rmin' is not supported"),
    ({"c": [{"convert": {"quant_type": "uint16", "scale": 0.1}}]}, "convert: 'scale' given without 'zero_point'"),
    ({"c": [{"convert": {"quant_type": "uint16", "colour": 1}}]}, "unknown key 'convert.colour'"),
    ({"w": [{"convert": {"quant_type": "uint16"}}]}, "'convert' is not allowed on weights"),
    ({"c": [{"reduce_range": True}]}, "'reduce_range' is only supported for weights"),
    ({"c": [{"axis": 1}]}, "per-channel overrides need a weight (constant)"),
    ({"w": [{"axis": 4}]}, "axis 4 is out of range for a weight of rank 4"),
    ({"w": [{}, {}]}, "2 per-channel overrides but no 'axis' in the first one"),
    ({"w": [{"axis": 0, "quant_type": "int8"}, {"quant_type": "uint8"}]}, "channel 1: 'quant_type' differs"),
    ({"w": [{"axis": 0, "scale": 0.1, "zero_point": 0}, {}]}, "channel 1: give 'scale'/'zero_point'"),
    ({"w": [{"axis": 0, "rmin": -1.0, "rmax": 1.0}, {"rmin": -2.0, "rmax": 1.0}]}, "per-channel 'rmin' must be"),
    ({"c": [{"symmetric": "yes"}]}, "tensor_overrides['c']: symmetric 'yes' is not true/false"),
    ({"c": [{"rmin": 2.0, "rmax": 1.0}]}, "rmin 2.0 is greater than rmax 1.0"),
    ({"c": [{"rmax": "big"}]}, "rmax 'big' is not a finite number"),
    ({"c": {"quant_type": "uint16"}}, "tensor_overrides['c']: expected a list of override dicts"),
    ({"c": ["uint16"]}, "tensor_overrides['c']: every override must be a dict"),
]


@pytest.mark.parametrize("overrides, fragment", CASES, ids=[str(i) for i in range(len(CASES))])
def test_each_problem_is_reported(model, overrides, fragment):
    assert fragment in problems(model, overrides)


def test_every_problem_is_listed_in_one_error(model):
    text = problems(model, {"cc": [{}], "c": [{"scal": 1}], "w": [{"axis": 9}]},
                    nodes_to_exclude=["rleu"], op_types_to_quantize=["Convv", "Erf"])
    assert text.startswith("invalid quantization config (6 problems): ")
    for fragment in ("['cc']", "'scal'", "axis 9", "nodes_to_exclude: no node named 'rleu' (did you mean 'relu'?)",
                     "op_types_to_quantize: 'Convv' is neither", "(did you mean 'Conv'?)",
                     "op_types_to_quantize: qpasses has no quantization rule for Erf (node 'erf')"):
        assert fragment in text
    assert text.count("; ") == 5


def test_node_lists_are_checked(model):
    assert "nodes_to_quantize: no node named 'sigm' (did you mean 'sig'?)" in problems(
        model, {}, nodes_to_quantize=["conv", "sigm"])
    # an op type named that qpasses cannot quantize is refused, never left float in silence
    assert "op_types_to_quantize: qpasses has no quantization rule for Erf (node 'erf'): remove it" in problems(
        model, {}, op_types_to_quantize=["Conv", "Erf"])
    assert validate(model, QuantConfig(op_types_to_quantize=["Conv", "Tanh"])) == {}   # a rule, no such node


def test_parsed_form(model):
    raw = {
        "c": [{"quant_type": QuantType.QUInt16, "convert": {"quant_type": "QUInt8", "recv_nodes": {"sig", "relu"}}}],
        "s": [{"quant_type": "quint16", "scale": np.array(1 / 65536, dtype=np.float32),
               "zero_point": np.array(0, dtype=np.uint16)}],
        "w": [{"axis": 0, "scale": 0.5, "zero_point": 0}, {"axis": 0, "scale": 0.25, "zero_point": 0}],
        "x": [{"rmin": -1, "rmax": 1.0, "symmetric": True}],
        "b": [{"axis": -1, "quant_type": "int8"}],
    }
    parsed = parse_overrides(model, QuantConfig(tensor_overrides=raw))
    assert list(parsed) == ["b", "c", "s", "w", "x"]
    c = parsed["c"]
    assert (c.quant_type, c.convert.quant_type, c.convert.recv_nodes) == ("uint16", "uint8", ["relu", "sig"])
    assert c.keys == ("convert", "quant_type") and not c.fixed
    s = parsed["s"]
    assert (s.quant_type, s.scale, s.zero_point, s.fixed) == ("uint16", [1 / 65536], [0], True)
    w = parsed["w"]
    assert (w.axis, w.scale, w.zero_point) == (0, [0.5, 0.25], [0, 0])
    x = parsed["x"]
    assert (x.rmin, x.rmax, x.symmetric, x.axis) == (-1.0, 1.0, True, None)
    assert parsed["b"].axis == 0   # -1 normalised (rank 1)


def test_single_dict_applies_to_every_channel(model):
    parsed = parse_overrides(model, QuantConfig(tensor_overrides={"w": [{"axis": 0, "scale": 0.5, "zero_point": 0}]}))
    assert parsed["w"].scale == [0.5, 0.5] and parsed["w"].zero_point == [0, 0]


def test_empty_entries_are_accepted(model):
    assert parse_overrides(model, QuantConfig(tensor_overrides={"c": []})) == {}
    assert parse_overrides(model, QuantConfig(tensor_overrides={"c": [{}]}))["c"].keys == ()
