"""A rewrite a pass reports is in the graph it returns: each claim has a checker that --verify-each
and the end of every run apply; a claim the graph does not hold is an internal error (exit 1)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from qpasses import Pass, PassResult, register
from qpasses.cli import main
from qpasses.core.pipeline import PassManager
from qpasses.core.registry import unregister
from qpasses.errors import ModelError, PassFailure
from qpasses.ir.model import from_proto

D, F, S, VOCAB = 64, 128, 16, 100
WEIGHT_ONLY = {"mode": "weight_only", "weight_only": {"bits": 4, "block_size": 32, "symmetric": True,
                                                      "algorithm": "rtn", "format": "qdq"}}


def encoder(layers: int = 2) -> onnx.ModelProto:
    """A MiniLM-class encoder as exporters write it at opset 17: MatMul weights as initializers
    ([K, N], or [N, K] behind a Transpose), one weight shared by two MatMuls per layer, the
    embedding table read by Gather and (transposed) by the tied output MatMul, ReduceMean with
    an ``axes`` attribute (it becomes an input at opset 18: raising the opset rewrites the graph)."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []

    def init(name, shape, scale=0.1):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def node(op, inputs, out=None, **attrs):
        out = out or f"t{len(nodes)}"
        nodes.append(helper.make_node(op, inputs, [out], name=f"/{op}_{len(nodes)}", **attrs))
        return out

    x = node("Gather", [init("emb", (VOCAB, D), 1.0), "input_ids"])
    for i in range(layers):
        inits += [numpy_helper.from_array(np.ones(D, np.float32), f"g{i}"),
                  numpy_helper.from_array(np.zeros(D, np.float32), f"b{i}")]
        h = node("LayerNormalization", [x, f"g{i}", f"b{i}"], axis=-1)
        q = node("MatMul", [h, init(f"wq{i}", (D, D))])
        k = node("MatMul", [h, init(f"wk{i}", (D, D))])
        v = node("MatMul", [h, node("Transpose", [init(f"wv{i}_nk", (D, D))], perm=[1, 0])])
        p = node("Softmax", [node("MatMul", [q, node("Transpose", [k], perm=[0, 2, 1])])], axis=-1)
        x = node("Add", [x, node("MatMul", [node("MatMul", [p, v]), init(f"wo{i}", (D, D))])])
        shared = init(f"wf{i}", (D, F))
        f = node("Add", [node("Relu", [node("MatMul", [x, shared])]), node("MatMul", [x, shared])])
        x = node("Add", [x, node("MatMul", [f, init(f"wd{i}", (F, D))])])
    node("MatMul", [x, node("Transpose", ["emb"], perm=[1, 0])], "logits")
    node("ReduceMean", [x], "pooled", axes=[1], keepdims=0)
    graph = helper.make_graph(nodes, "encoder", [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, [1, S])],
                              [helper.make_tensor_value_info("pooled", 1, [1, D]),
                               helper.make_tensor_value_info("logits", 1, [1, S, VOCAB])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.fixture(scope="module")
def encoder_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("encoder")
    onnx.save(encoder(), folder / "enc.onnx")
    ids = np.random.default_rng(1).integers(0, VOCAB, (8, 1, S)).astype(np.int64)
    np.savez(folder / "calib.npz", input_ids=ids)
    return folder


def _outputs(path, ids):
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, {"input_ids": ids})


@pytest.mark.parametrize("fmt", ["qdq", "matmulnbits"])
def test_weight_only_writes_every_weight_it_reports(encoder_files, tmp_path, capsys, fmt):
    config = tmp_path / "wo.json"
    config.write_text(json.dumps({**WEIGHT_ONLY, "weight_only": {**WEIGHT_ONLY["weight_only"], "format": fmt}}))
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    code = main(["run", str(encoder_files / "enc.onnx"), "-o", str(out), "--config", str(config),
                 "--calib", str(encoder_files / "calib.npz"), "--report", str(report), "--verify-each", "checker"])
    err = capsys.readouterr().err
    assert code == 0, err
    data = json.loads(report.read_text())
    claimed = data["decisions"]["weight_only"]
    stats = next(p["stats"] for p in data["passes"] if p["pass"] == "quantize-weights")
    # 2 layers x (q, k, v behind a Transpose, o, down) + the tied output projection; the shared
    # weights stay float, with the reason
    assert stats["quantized"] == len(claimed) == 11
    assert {"wf0", "wf1"} <= set(data["decisions"]["float"])
    model = onnx.load(out)
    if fmt == "qdq":
        dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        assert len(dqs) == 11 and all(any(a.name == "block_size" for a in n.attribute) for n in dqs)
        assert model.opset_import[0].version == 21
    else:
        assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 11
    assert not {init.name for init in model.graph.initializer} & set(claimed)   # no float copy left
    ids = np.load(encoder_files / "calib.npz")["input_ids"][0]
    ref, got = _outputs(encoder_files / "enc.onnx", ids), _outputs(out, ids)
    err_db = 10 * np.log10(np.sum(ref[1] ** 2) / np.sum((ref[1] - got[1]) ** 2))
    assert 5 < err_db < 40   # int4 weights: quantized, not the float model


class ClaimsWithoutRewrite(Pass):
    """Test pass: reports a quantized weight and leaves the graph as it was."""
    name = "claims-without-rewrite"
    establishes = frozenset({"weights-quantized"})

    def run(self, model, ctx):
        weight = next(t for n in model.graph.nodes if n.op == "MatMul" for t in n.inputs[1:])
        model.decisions["weight_only"] = {weight.name: "quantize-weights: rtn int4 block 32 along K -> qdq"}
        return PassResult(model, True, {"quantized": 1})


@pytest.fixture
def claims_without_rewrite():
    register(ClaimsWithoutRewrite)
    yield
    unregister(ClaimsWithoutRewrite.name)


@pytest.mark.parametrize("verify", [[], ["--verify-each", "structure"]])
def test_a_reported_rewrite_missing_from_the_graph_is_an_internal_error(encoder_files, tmp_path, capsys, verify,
                                                                          claims_without_rewrite):
    out = tmp_path / "out.onnx"
    code = main(["run", str(encoder_files / "enc.onnx"), "-o", str(out), "--passes", "claims-without-rewrite",
                 *verify])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("qpasses: internal error: ")
    assert "fact 'weights-quantized' does not hold: weight 'wq0' is reported quantized but node" in lines[0]
    assert "claims-without-rewrite" in lines[0]
    assert not out.exists()


def test_the_final_check_names_the_pass_and_an_untouched_input_is_a_model_error(claims_without_rewrite):
    model = from_proto(encoder(1))
    with pytest.raises(PassFailure, match="pass 'claims-without-rewrite' reported what the graph does not hold"):
        PassManager("claims-without-rewrite").run(model)
    with pytest.raises(ModelError, match="saved decisions do not match its graph"):
        PassManager("fold-batchnorm").run(model)   # changes nothing: the claim came with the model



def test_dynamic_quantization_claims_the_nodes_it_rewrote(encoder_files):
    from qpasses.api import run_pipeline
    from qpasses.core.facts import fact_problems

    model, records = run_pipeline(str(encoder_files / "enc.onnx"),
                                  config={"mode": "dynamic", "nodes_to_exclude": ["/MatMul_2"]})
    claimed = model.decisions["dynamic"]
    assert len(claimed) == 14 and "/MatMul_2" not in claimed   # every weighted MatMul but the excluded one
    # quantize-gathers, after it, changes the model (the embedding table) without declaring the
    # claim: a claim outlives it (it is checked at the end, not dropped)
    assert "quantize-gathers" in [r.name for r in records if r.modified]
    assert "dynamic-quantized" in model.facts and fact_problems(model) is None
    claimed["/MatMul_2"] = "quantize-dynamic: MatMul weight 'wq0' int8, input quantized at run time (integer)"
    fact, text = fact_problems(model)
    assert fact == "dynamic-quantized"
    assert "node '/MatMul_2' (MatMul) is reported quantized but still reads its float weight 'wq0'" in text


def test_a_conv_whose_weight_stays_float_may_read_the_float_input():
    """insert-qdq leaves a Conv with a float weight the float value of its input (onnxruntime would
    give the weight a coarser grid otherwise): the Q/DQ claim allows that reader, and only it."""
    from qpasses.api import run_pipeline
    from qpasses.core.facts import fact_problems
    from qpasses.testing import parse

    text = """
    g (float[1, 3, 8, 8] x) => (float[1, 4, 8, 8] y, float[1, 4, 8, 8] z)
      <float[4, 3, 1, 1] wa = {1,2,3,4,5,6,7,8,9,10,11,12}, float[4, 3, 1, 1] wb = {1,-2,3,-4,5,-6,7,-8,9,-10,11,-12}> {
      [a] y = Conv (x, wa)
      [b] z = Conv (x, wb)
    }"""
    feeds = [{"x": np.random.default_rng(s).standard_normal((1, 3, 8, 8)).astype(np.float32)} for s in range(4)]
    model, _ = run_pipeline(parse(text), config={"nodes_to_exclude": ["b"], "accuracy": {"target": -100}},
                            calibration_data=feeds)   # the end of the run checks the claim
    conv_b = next(n for n in model.graph.nodes if n.name == "b")
    assert "x" in model.quant and conv_b.inputs[0].name == "x" and fact_problems(model) is None
    conv_a = next(n for n in model.graph.nodes if n.name == "a")   # the other reader: back on the float input
    conv_a.inputs[0] = conv_b.inputs[0]
    fact, text = fact_problems(model)
    assert fact == "qdq-inserted" and "node 'a' (Conv) reads it without Q/DQ" in text
