"""propagate-mixed-precision: the table after the pass, the report, no-ops, errors and an ORT run."""
from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.kits.example_graphs import ORT_PR_20028
from qpasses.config.quant_config import QuantConfig, load_config
from qpasses.core.context import RunContext
from qpasses.core.pipeline import PassManager
from qpasses.core.registry import all_passes
from qpasses.core.verify import check_onnx
from qpasses.errors import ConfigError, PreconditionError
from qpasses.ir.annotations import Convert, TensorQuant
from qpasses.ir.model import from_proto
from qpasses.passes.propagate_mixed_precision import PropagateMixedPrecision, float_tensors, sharing_nodes
from qpasses.testing import model_from_text, parse, random_feed, run

EXAMPLE = ORT_PR_20028

WEIGHTED = """
g (float[2,4] x) => (float[2,4] y, float[4,2] t) <float[4,4] w = {1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16}> {
  [mm] a = MatMul (x, w)
  [tr] t = Transpose <perm = [1, 0]> (a)
  [back] b = Transpose <perm = [1, 0]> (t)
  [sig] y = Sigmoid (b)
}"""


def annotate_by_hand(model, config: QuantConfig | None = None):
    """What annotate-types gives: float activations in the activation type, constants in the weight type."""
    config = config or QuantConfig()
    for name, tensor in model.tensors().items():
        if name not in float_tensors(model):
            continue
        if tensor.__class__.__name__ == "Constant":
            model.quant[name] = TensorQuant(config.weight_type, role="weight", symmetric=True,
                                            why=["annotate-types (by hand): weight"])
        else:
            model.quant[name] = TensorQuant(config.activation_type, why=["annotate-types (by hand)"])
    model.facts.add("types-annotated")
    return model


def prepared(text, mixed, **config):
    """(the model annotated by hand, a RunContext with the config that requests ``mixed``)."""
    model = model_from_text(text) if isinstance(text, str) else from_proto(text)
    ctx = RunContext(QuantConfig(mixed_precision=mixed, **config))
    return annotate_by_hand(model, ctx.config), ctx


def table_types(model):
    """node -> types its quantized activation inputs are read in and its outputs produced in."""
    out = {}
    for node in model.graph.nodes:
        types = set()
        for t in node.outputs:
            if (tq := model.quant.get(t.name)) is not None and tq.role == "activation":
                types.add(tq.qtype)
        for t in node.inputs:
            if (tq := model.quant.get(t.name)) is not None and tq.role == "activation":
                conv = tq.convert
                types.add(conv.qtype if conv and node.name in conv.recv_nodes else tq.qtype)
        out[node.name] = types
    return out


def test_example_table_and_report():
    model, ctx = prepared(EXAMPLE, {"op4_out": "uint16"})
    result = PropagateMixedPrecision().run(model, ctx)
    assert result.modified and result.stats == {"requests": 1, "changed": 4, "converts": 3, "skipped": 0}
    q = model.quant
    assert (q["op4_out"].qtype, q["op4_out"].convert) == ("uint16", None)
    assert (q["op2_out"].qtype, q["op2_out"].convert) == ("uint8", Convert("uint16", ["op4"]))
    assert (q["op3_out"].qtype, q["op3_out"].convert) == ("uint8", Convert("uint16", ["op5"]))
    assert (q["op5_out"].qtype, q["op5_out"].convert) == ("uint16", Convert("uint8", ["op6"]))
    for name in ("input_0", "input_1", "op1_out", "output_0", "output_1", "output_2"):
        assert (q[name].qtype, q[name].convert) == ("uint8", None)
    assert q["op4_out"].why[-1] == "propagate-mixed-precision: uint16 requested for 'op4_out'"
    assert q["op2_out"].why[-1] == "propagate-mixed-precision: convert to uint16 for op4"
    assert q["op5_out"].why[-2].startswith("propagate-mixed-precision: pulled into the uint16 region of "
                                           "'op4_out' (output of op5, a consumer of 'op4_out')")
    report = ctx.findings.as_dict()["mixed_precision_plan"]
    assert report["overrides"]["op2_out"] == [{"quant_type": "uint8",
                                               "convert": {"quant_type": "uint16", "recv_nodes": ["op4"]}}]
    assert report["regions"] == {"op4_out": ["op4", "op5"]} and report["skipped"] == []
    assert all(len(types) == 1 for types in table_types(model).values())


def test_second_run_is_a_noop():
    model, ctx = prepared(EXAMPLE, {"op4_out": "uint16", "input_0": {"quant_type": "int16", "symmetric": True}})
    assert PropagateMixedPrecision().run(model, ctx).modified
    table = model.quant.to_json()
    again = PropagateMixedPrecision().run(model, ctx)
    assert not again.modified and again.stats["changed"] == 0
    assert model.quant.to_json() == table
    assert model.quant["op1_out"].symmetric is True and model.quant["op1_out"].qtype == "int16"


@pytest.mark.parametrize("config", [None, QuantConfig()])
def test_no_requests_is_a_noop(config):
    model, ctx = annotate_by_hand(model_from_text(EXAMPLE)), RunContext(config)
    table = model.quant.to_json()
    result = PropagateMixedPrecision().run(model, ctx)
    assert not result.modified and result.stats == {}
    assert model.quant.to_json() == table and "mixed_precision_plan" not in ctx.findings.as_dict()


def test_default_type_request_changes_nothing():
    model, ctx = prepared(EXAMPLE, {"op4_out": "uint8"})
    assert not PropagateMixedPrecision().run(model, ctx).modified
    assert ctx.findings.as_dict()["mixed_precision_plan"]["notes"]


def test_graph_inputs_outputs_and_weights():
    model, ctx = prepared(WEIGHTED, {"x": "uint16", "y": "int16"})
    weight = model.quant["w"].to_dict()
    assert PropagateMixedPrecision().run(model, ctx).modified
    q = model.quant
    assert q["w"].to_dict() == weight                         # weights keep the weight type
    assert (q["x"].qtype, q["x"].convert) == ("uint16", None)  # requested graph input keeps its type
    # mm computes in uint16; the Transposes share a's qparams, so they join x's region
    assert (q["a"].qtype, q["a"].convert) == ("uint16", None)
    assert (q["t"].qtype, q["t"].convert) == ("uint16", None)  # graph output read inside the region
    assert (q["b"].qtype, q["b"].convert) == ("uint16", Convert("int16", ["sig"]))
    assert (q["y"].qtype, q["y"].convert) == ("int16", None)   # graph output keeps its region type
    assert all(len(types) == 1 for types in table_types(model).values())


def test_shape_ops_pull_regions_and_the_option_restores_onnxruntime():
    model, ctx = prepared(WEIGHTED, {"b": "int16"})
    PropagateMixedPrecision().run(model, ctx)
    q = model.quant
    # b's producer is a Transpose tied to tr, tied to mm: one int16 region from mm to sig.
    assert [q[t].qtype for t in ("x", "a", "t", "b", "y")] == ["uint8", "int16", "int16", "int16", "int16"]
    assert q["x"].convert == Convert("int16", ["mm"])
    assert ctx.findings.as_dict()["mixed_precision_plan"]["regions"] == {"b": ["back", "mm", "sig", "tr"]}
    model, ctx = prepared(WEIGHTED, {"b": "int16"})
    PassManager("propagate-mixed-precision{extend_through_shape_ops=false}").run(model, ctx)
    q = model.quant
    assert [q[t].qtype for t in ("x", "a", "t", "b", "y")] == ["uint8", "uint8", "uint8", "int16", "int16"]
    assert q["t"].convert == Convert("int16", ["back"])   # a convert between back and its input


def test_sharing_nodes_follow_oprules_conditions():
    model = model_from_text("""
    g (float[1,4] x) => (float[1,6] y, float[1,6] z) <float c = {1.5}, int64[4] pads = {0, 1, 0, 1}> {
      [pad0] y = Pad (x, pads)
      [pad1] z = Pad (x, pads, c)
    }""")
    assert sharing_nodes(model) == {"pad0"}   # a pad value of 1.5 is not in the input: no sharing


def test_target_constraints_apply():
    text = """
    g (float[1,4] x) => (float[1,8] y) {
      [p1] a = Relu (x)
      [p2] b = Sigmoid (x)
      [cat] y = Concat <axis = 1> (a, b)
    }"""
    model, ctx = prepared(text, {"a": "uint16"}, target="qnn")
    PropagateMixedPrecision().run(model, ctx)
    assert [model.quant[t].qtype for t in ("a", "b", "y")] == ["uint16"] * 3
    assert model.quant["x"].convert == Convert("uint16", ["p1", "p2"])
    model, ctx = prepared(text, {"a": "uint16"})   # no target: only the requested tensor's region
    PropagateMixedPrecision().run(model, ctx)
    assert model.quant["b"].convert == Convert("uint16", ["cat"])


def test_target_rules_run_after_types_change():
    # qnn fixes a 16-bit Sigmoid output's qparams; the rule must see the new uint16 type.
    model, ctx = prepared(EXAMPLE, {"output_2": "uint16"}, target="qnn")
    PropagateMixedPrecision().run(model, ctx)
    tq = model.quant["output_2"]
    assert tq.qtype == "uint16" and tq.fixed and tq.scale == [1.52587890625e-05] and tq.zero_point == [0]
    assert tq.why[-1].startswith("target qnn: Sigmoid output at uint16 fixed")


def test_entries_missing_from_the_table_are_skipped_and_reported():
    model, ctx = prepared(EXAMPLE, {"op4_out": "uint16"})
    del model.quant["op3_out"]
    result = PropagateMixedPrecision().run(model, ctx)
    assert result.stats["skipped"] == 1
    assert ctx.findings.as_dict()["mixed_precision_plan"]["skipped"] == ["op3_out"]
    assert "op3_out" in ctx.findings.as_dict()["mixed_precision_plan"]["overrides"]
    assert "op3_out" not in model.quant


def test_requires_types_annotated():
    model = model_from_text(EXAMPLE)
    ctx = RunContext(load_config({"mixed_precision": {"op4_out": "uint16"}}))
    with pytest.raises(PreconditionError, match="types-annotated"):
        PassManager("propagate-mixed-precision").run(model, ctx)


@pytest.mark.parametrize("mixed, match", [
    ({"op4_ot": "uint16"}, "did you mean 'op4_out'"),
    ({"op4_out": "uint16", "op5_out": "int16"}, "'op5_out' is pulled into uint16"),
])
def test_user_errors_are_one_line(mixed, match):
    model, ctx = prepared(EXAMPLE, mixed)
    with pytest.raises(ConfigError, match=match) as err:
        PassManager("propagate-mixed-precision").run(model, ctx)
    assert "\n" not in str(err.value)


def test_graph_is_untouched_and_checker_clean():
    model, ctx = prepared(EXAMPLE, {"op4_out": "uint16"})
    before = model.to_proto().graph.SerializeToString()
    PassManager("propagate-mixed-precision").run(model, ctx)
    assert model.to_proto().graph.SerializeToString() == before
    check_onnx(model)
    # no "mixed-precision-planned" fact any more (no pass read it); the new types keep the table's fact
    assert model.facts == {"types-annotated"}


def test_pass_is_registered_with_facts_and_example():
    cls = all_passes()["propagate-mixed-precision"]
    assert cls.requires == {"types-annotated"} and cls.establishes == frozenset()
    assert cls.preserves == {"types-annotated", "calibrated"}
    parse(cls.example)  # the docs example parses


MERGED_RELU = """
g (float[1,4] x, float[1,4] z) => (float[1,4] y) {
  [add] a = Add (x, z)
  [relu] b = Relu (a)
  [sig] y = Sigmoid (b)
}"""


def test_table_shares_links_tie_regions():
    # annotate-types merges the Relu into Add's range: 'a' shares the qparams of 'b'.
    model, ctx = prepared(MERGED_RELU, {"b": "uint16"})
    model.quant["a"].shares = "b"
    PropagateMixedPrecision().run(model, ctx)
    q = model.quant
    assert [q[t].qtype for t in ("a", "b", "y")] == ["uint16"] * 3
    assert q["a"].shares == "b" and q["a"].convert is None
    assert q["x"].convert == Convert("uint16", ["add"]) and q["z"].convert == Convert("uint16", ["add"])
    assert ctx.findings.as_dict()["mixed_precision_plan"]["regions"] == {"b": ["add", "relu", "sig"]}


def test_shares_link_across_types_is_dropped():
    model, ctx = prepared(MERGED_RELU, {"b": "uint16"})
    model.quant["a"].shares = "b"
    PassManager("propagate-mixed-precision{extend_through_shape_ops=false}").run(model, ctx)
    q = model.quant
    assert (q["a"].qtype, q["a"].convert, q["a"].shares) == ("uint8", Convert("uint16", ["relu"]), None)
    assert q["a"].why[-1] == ("propagate-mixed-precision: no longer shares the qparams of 'b' "
                              "(uint16, this is uint8)")
    assert all(len(types) == 1 for types in table_types(model).values())


@pytest.mark.parametrize("request_", [{"pool": "int16"}, {"relu1": "uint16"}, {"logits": "uint16"}])
def test_with_annotate_types_on_the_example_model(request_):
    from qpasses.cli.examples import example_model

    model = from_proto(example_model())
    ctx = RunContext(QuantConfig(mixed_precision=request_), [random_feed(model, seed=s) for s in range(4)])
    PassManager("fold-constants,fold-batchnorm,cleanup,calibrate,annotate-types,propagate-mixed-precision").run(model, ctx)
    name = next(iter(request_))
    assert model.quant[name].qtype == request_[name]
    assert all(len(types) <= 1 for types in table_types(model).values())
    for tensor, tq in model.quant.items():   # every shares link joins tensors of one type
        assert tq.shares is None or model.quant[tq.shares].qtype == tq.qtype, tensor


# -- an onnxruntime run of the planned table ---------------------------------------------------------
def _cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def const(name, *shape):
        return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)

    inits = [const("w", 4, 3, 3, 3), const("bias", 4), const("fw", 256, 10),
             numpy_helper.from_array(np.array([1, 256], np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["x", "w", "bias"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Reshape", ["r", "shape"], ["f"], name="reshape"),
             helper.make_node("MatMul", ["f", "fw"], ["m"], name="fc"),
             helper.make_node("Sigmoid", ["m"], ["y"], name="sig"),
             helper.make_node("Tanh", ["m"], ["z"], name="tanh")]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 10]) for n in "yz"], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _ort_overrides(model):
    """The table's type decisions as onnxruntime TensorQuantOverrides."""
    from onnxruntime.quantization import QuantType

    names = {"uint8": QuantType.QUInt8, "uint16": QuantType.QUInt16, "int16": QuantType.QInt16}
    out = {}
    for name, tq in model.quant.items():
        if tq.role == "activation" and (tq.qtype != "uint8" or tq.convert):
            entry = {"quant_type": names[tq.qtype]}
            if tq.convert:
                entry["convert"] = {"quant_type": names[tq.convert.qtype], "recv_nodes": set(tq.convert.recv_nodes)}
            out[name] = [entry]
    return out


def test_planned_table_quantizes_and_runs_in_onnxruntime(tmp_path):
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    proto = _cnn()
    model, ctx = prepared(proto, {"f": "uint16"})
    PropagateMixedPrecision().run(model, ctx)
    q = model.quant
    # reshape shares r's qparams, so relu joins the region: c converts for relu, m converts back
    assert [q[t].qtype for t in ("c", "r", "f", "m", "y")] == ["uint8", "uint16", "uint16", "uint16", "uint8"]
    assert q["c"].convert == Convert("uint16", ["relu"]) and q["m"].convert == Convert("uint8", ["sig", "tanh"])
    assert all(len(types) == 1 for types in table_types(model).values())

    class Reader:
        def __init__(self):
            self.feeds = iter([random_feed(proto, seed) for seed in range(8)])

        def get_next(self):
            return next(self.feeds, None)

    onnx.save(proto, tmp_path / "float.onnx")
    logging.getLogger().setLevel(logging.ERROR)
    quantize_static(tmp_path / "float.onnx", tmp_path / "qdq.onnx", Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QUInt8,
                    extra_options={"TensorQuantOverrides": _ort_overrides(model)})
    qdq = onnx.load(tmp_path / "qdq.onnx")
    zero_points = {i.name: i.data_type for i in qdq.graph.initializer}
    q_types = {n.input[0]: zero_points[n.input[2]] for n in qdq.graph.node if n.op_type == "QuantizeLinear"}
    assert q_types["r"] == TensorProto.UINT16 and q_types["m"] == TensorProto.UINT16
    assert TensorProto.UINT16 in q_types.values() and TensorProto.UINT8 in q_types.values()
    feed = random_feed(proto, seed=42)
    for ref, got in zip(run(proto, feed), run(qdq, feed), strict=True):
        np.testing.assert_allclose(got, ref, atol=0.05)
