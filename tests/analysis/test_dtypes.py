"""analysis/dtypes: float dtypes from gs, the op rules and at most one shape inference per generation."""
import pytest

from qpasses.analysis import dtypes
from qpasses.analysis.dtypes import float_tensors, float_types
from qpasses.ir.model import from_proto
from qpasses.testing import parse

# gs knows only x and y: Sign is neither a rule op nor a same-dtype op, so the Relu reading its
# output needs shape inference; Transpose's output is typed by the rules
FP16 = """
g (float16[1,2,4,4] x) => (float16[1,2,2,2] y) {
  s = Sign (x)
  r = Relu (s)
  t = Transpose <perm = [0, 1, 3, 2]> (r)
  y = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (t)
}
"""


@pytest.fixture
def inferences(monkeypatch):
    calls = []
    real = dtypes.infer_types
    monkeypatch.setattr(dtypes, "infer_types", lambda proto: calls.append(1) or real(proto))
    return calls


def test_one_inference_per_generation_serves_every_question(inferences):
    model = from_proto(parse(FP16, opset=17))
    assert {"x", "s", "r", "t", "y"} <= float_tensors(model)
    assert float_types(model, ["s", "r", "t", "y"]) == dict.fromkeys(["s", "r", "t", "y"], "float16")
    assert len(inferences) == 1
    model.touch()   # a new generation: the graph may have changed
    assert float_types(model, ["r"]) == {"r": "float16"} and len(inferences) == 2


def test_float32_models_need_no_inference(inferences):
    model = from_proto(parse(FP16.replace("float16", "float").replace("Sign", "Neg"), opset=17))
    assert {"s", "r", "t"} <= float_tensors(model)
    assert float_types(model, ["s", "t"]) == {"s": "float32", "t": "float32"}
    assert inferences == []
