"""insert-converts: DQ -> Q -> DQ re-quantization for the receiving readers only."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from tests.passes.test_insert_qdq import act_entry, assert_close_to_float, build_table, feeds_for, insert, observe, text

from qpasses import Convert, ModelError, PassManager, PreconditionError, TensorQuant
from qpasses.core.verify import check_onnx
from qpasses.passes.insert_converts import InsertConverts, analyse, plan_converts
from qpasses.quant.qparams import compute_qparams
from qpasses.testing import model_from_text, run_pass

MIXED = """
g (float[2,4] x) => (float[2,4] y, float[2,4] z) { [sq] a = Mul(x, x)  [t] y = Tanh(a)  [n] z = Neg(a) }"""
OUTPUT = """
g (float[2,4] x) => (float[2,4] a, float[2,4] y) { [sq] a = Mul(x, x)  [t] y = Tanh(a) }"""


def with_convert(body: str, recv: list[str], qt: str = "uint16"):
    """Float reference and a model with Q/DQ inserted whose tensor 'a' converts to ``qt`` for ``recv``."""
    ref, model = model_from_text(body), model_from_text(body)
    feeds = feeds_for(model)
    acts = [t.name for t in model.graph.inputs] + [n.outputs[0].name for n in model.graph.nodes]
    build_table(model, feeds, acts=acts)
    lo, hi, _ = observe(ref, feeds, ["a"])["a"]
    scale, zp = compute_qparams(lo, hi, qt)
    model.quant["a"].convert = Convert(qt, recv, scale=[float(scale)], zero_point=[int(zp)])
    insert(model)
    model.facts |= {"qdq-inserted"}
    return ref, model, feeds


def converts(model):
    result = run_pass(InsertConverts(), model)
    model.touch()
    return result


def readers_of(model, tensor: str) -> list[str]:
    return sorted(n.name for n in model.tensors()[tensor].outputs)


def test_some_readers_convert_from_a_copy_of_the_dq():
    ref, model, feeds = with_convert(MIXED, ["t"])
    result = converts(model)
    assert result.modified and result.stats == {"converts": 1, "q_nodes": 1, "dq_nodes": 2, "readers_moved": 1,
                                               "opset_raised_to": 21}
    assert readers_of(model, "a_dequantized") == ["n"]
    assert readers_of(model, "a_quantized") == ["a_convert_in_dq", "a_dq"]
    assert readers_of(model, "a_convert_in") == ["a_convert_q"]
    assert readers_of(model, "a_convert_dequantized") == ["t"]
    assert model.opset == 21
    proto = check_onnx(model)
    zps = {t.name: t.data_type for t in proto.graph.initializer}
    assert zps["a_convert_zero_point"] == onnx.TensorProto.UINT16 and zps["a_zero_point"] == onnx.TensorProto.UINT8
    assert_close_to_float(ref, model, feeds)


GOLDEN_ALL_CONVERT = """\
   [sq] a = Mul (x_dequantized, x_dequantized)
   [a_q] a_quantized = QuantizeLinear (a, a_scale, a_zero_point)
   [a_dq] a_dequantized = DequantizeLinear (a_quantized, a_scale, a_zero_point)
   [a_convert_q] a_convert_quantized = QuantizeLinear (a_dequantized, a_convert_scale, a_convert_zero_point)
   [a_convert_dq] a_convert_dequantized = DequantizeLinear (a_convert_quantized, a_convert_scale, a_convert_zero_point)
   [t] y_float = Tanh (a_convert_dequantized)
   [y_q] y_quantized = QuantizeLinear (y_float, y_scale, y_zero_point)
   [y_dq] y = DequantizeLinear (y_quantized, y_scale, y_zero_point)
   [n] z_float = Neg (a_convert_dequantized)"""


def test_all_readers_convert_straight_from_the_dq():
    ref, model, feeds = with_convert(MIXED, [], qt="int8")
    opset = model.opset
    assert converts(model).stats["dq_nodes"] == 1
    assert GOLDEN_ALL_CONVERT in text(model)
    assert model.opset == opset  # int8 needs no newer opset
    assert_close_to_float(ref, model, feeds)


@pytest.mark.parametrize("recv", [["t"], []])
def test_graph_output_keeps_its_name_type_and_original_value(recv):
    ref, model, feeds = with_convert(OUTPUT, recv)
    converts(model)
    proto = check_onnx(model)
    assert [(o.name, o.type.tensor_type.elem_type) for o in proto.graph.output] == \
        [("a", onnx.TensorProto.FLOAT), ("y", onnx.TensorProto.FLOAT)]
    assert readers_of(model, "a_convert_dequantized") == ["t"]
    assert model.tensors()["a"].inputs[0].name == "a_dq"  # the output is the original uint8 DQ
    assert_close_to_float(ref, model, feeds)


def test_plan_is_pure():
    _, model, _ = with_convert(MIXED, ["t"])
    before = text(model)
    facts = analyse(model)
    steps = plan_converts(model.quant, facts)
    assert text(model) == before
    assert [(s.tensor, s.recv, s.clone, s.qparams.qtype.name) for s in steps] == [("a", ("t",), True, "uint16")]
    assert facts["a"].dequantized == "a_dequantized" and facts["a"].readers == ("t", "n")


def test_second_run_changes_nothing():
    _, model, _ = with_convert(MIXED, ["t"])
    PassManager("insert-converts").run(model)
    before = text(model)
    record, = PassManager("insert-converts").run(model)
    assert record.modified is False and text(model) == before


def test_no_converts_is_a_no_op():
    model = model_from_text(MIXED)
    model.quant["a"] = act_entry(0, 4)
    model.facts |= {"qparams-computed"}
    insert(model)
    model.facts |= {"qdq-inserted"}
    before = text(model)
    result = converts(model)
    assert result.modified is False and text(model) == before


def test_receiving_node_that_does_not_read_the_tensor_is_ignored():
    _, model, _ = with_convert(MIXED, ["nobody"])
    before = text(model)
    assert converts(model).modified is False and text(model) == before


def test_requires_qdq_inserted():
    model = model_from_text(MIXED)
    with pytest.raises(PreconditionError, match="qdq-inserted"):
        PassManager("insert-converts").run(model)


def test_convert_without_qdq_is_a_one_line_error():
    model = model_from_text(MIXED)
    model.quant["a"] = TensorQuant("uint8", scale=[0.1], zero_point=[0],
                                   convert=Convert("uint16", ["t"], scale=[0.001], zero_point=[0]))
    model.facts |= {"qdq-inserted"}
    with pytest.raises(ModelError, match="tensor 'a'.*insert-qdq"):
        converts(model)


def test_converts_claim_is_checked_on_the_graph():
    from qpasses.core.facts import check_facts, fact_problems

    _, model, _ = with_convert(MIXED, ["t"])
    PassManager("insert-converts").run(model)   # checks the claim at the end of the run
    assert "converts-inserted" in model.facts
    check_facts(model)
    dq = model.tensors()["a_convert_dequantized"]
    tanh = next(n for n in dq.outputs if n.name == "t")
    tanh.inputs[0] = model.tensors()["a_dequantized"]   # the receiving reader back on the original
    fact, text = fact_problems(model)
    assert fact == "converts-inserted"
    assert "tensor 'a' has a convert to uint16 that node 't' does not read" in text


def test_a_convert_whose_reader_reads_the_float_value_is_not_a_claim():
    """mixed_precision's region gives gemm_5 a convert for Gemm_9, whose weight stays float (not
    selected): Gemm_9 reads the float value, cleanup drops the unread Q/DQ, and the run does not
    report a convert it could not insert (found by the 4-bit CLI fuzz run)."""
    import qpasses
    from qpasses.testing import parse

    rng = np.random.default_rng(0)
    w4, w7 = rng.normal(size=(4, 3)), rng.normal(size=(3, 2))
    proto = parse("""
g (float[1, 2, 2] x) => (float[1, 2] gemm_8) <float[4, 3] w4 = {%s}, float[3, 2] w7 = {%s}>
{ flat_2 = Flatten<axis=1>(x)  gemm_5 = Gemm(flat_2, w4)  gemm_8 = Gemm(gemm_5, w7) }""" % (
        ", ".join(map(str, w4.ravel())), ", ".join(map(str, w7.ravel()))), opset=13)
    for node, name in zip(proto.graph.node, ("Flatten_3", "Gemm_6", "Gemm_9")):
        node.name = name
    feeds = [{"x": rng.normal(size=(1, 2, 2)).astype(np.float32)} for _ in range(8)]
    model = qpasses.quantize(proto, feeds, config={"activation_type": "uint4", "nodes_to_quantize": ["Flatten_3"],
                                                   "mixed_precision": {"flat_2": "uint16"}})
    assert model.quant["gemm_5"].convert is not None and model.quant["flat_2"].qtype == "uint16"
    gemm = next(n for n in model.to_proto().graph.node if n.name == "Gemm_9")
    assert gemm.input[0] == "gemm_5"


def test_the_type_a_reader_sees_matches_what_insert_converts_does():
    """An empty recv_nodes converts for every reader (insert-converts); the analyses that ask which
    type a node reads (saturation, targets, annotate-types) read it the same way."""
    for recv, converted in (([], {"t", "n"}), (["t"], {"t"})):
        _, model, _ = with_convert(MIXED, recv)
        tq = model.quant["a"]
        assert {r for r in ("t", "n") if tq.qtype_read_by(r) == "uint16"} == converted
        converts(model)
        assert set(readers_of(model, "a_convert_dequantized")) == converted
