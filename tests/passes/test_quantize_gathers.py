"""quantize-gathers: embedding tables as int8 rows (static, dynamic) or GatherBlockQuantized blocks (weight-only)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qpasses
from qpasses.ir.model import from_proto
from qpasses.passes.quantize_gathers import QuantizeGathers
from qpasses.testing import run, run_pass

V, D, S = 300, 64, 6


def _model(table=None, tied=False, dtype=np.float32, opset=17) -> onnx.ModelProto:
    """ids -> Gather(table) -> LayerNormalization -> MatMul (-> plus MatMul(x, table^T) when tied)."""
    rng = np.random.default_rng(0)
    table = rng.normal(0, 1, (V, D)) * rng.uniform(0.1, 3, (V, 1)) if table is None else table
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="emb"),
             helper.make_node("LayerNormalization", ["e", "g", "b"], ["n"], axis=-1),
             helper.make_node("MatMul", ["n", "w"], ["y"], name="mm")]
    inits = [numpy_helper.from_array(np.asarray(table, dtype), "table"),
             numpy_helper.from_array(np.ones(D, dtype), "g"), numpy_helper.from_array(np.zeros(D, dtype), "b"),
             numpy_helper.from_array(rng.normal(0, 0.2, (D, 8)).astype(dtype), "w")]
    outputs = [helper.make_tensor_value_info("y", elem, [1, S, 8])]
    if tied:
        nodes += [helper.make_node("Transpose", ["table"], ["tt"], perm=[1, 0]), helper.make_node("MatMul", ["n", "tt"], ["logits"])]
        outputs.append(helper.make_tensor_value_info("logits", elem, [1, S, V]))
    g = helper.make_graph(nodes, "emb", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, S])], outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _feeds(n=8, seed=1):
    rng = np.random.default_rng(seed)
    return [{"ids": rng.integers(0, V, (1, S)).astype(np.int64)} for _ in range(n)]


def _lookup_only(dtype=np.float32) -> onnx.ModelProto:
    """ids -> Gather(table) as the graph output: the lookup's own numerics."""
    m = _model(dtype=dtype)
    del m.graph.node[1:]
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("e", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), [1, S, D]))
    return m


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_static_lookup_is_within_half_a_row_step(dtype):
    m = _lookup_only(dtype)
    model = from_proto(m)
    result = run_pass(QuantizeGathers(), model)
    assert result.modified and result.stats == {"tables": 1, "gathers": 1}
    proto = model.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    assert [n.op_type for n in proto.graph.node] == ["Gather", "Cast", "Gather", "Mul"]
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert "table" not in inits and any(a.dtype == np.int8 and a.shape == (V, D) for a in inits.values())
    table = numpy_helper.to_array(m.graph.initializer[0]).astype(np.float32)
    step = np.abs(table).max(1) / 127
    for feed in _feeds(4):
        ref, got = run(m, feed)[0].astype(np.float32), run(proto, feed)[0].astype(np.float32)
        assert got.dtype == np.float32 and ref.shape == got.shape
        bound = step[feed["ids"]][..., None] * 0.5 * (1.01 if dtype == np.float32 else 1.2) + (1e-3 if dtype == np.float16 else 0)
        assert np.all(np.abs(got - ref) <= bound)
    assert "quantize-gathers: int8, one scale per row (300 rows)" in model.decisions["gathers"]["table"]
    assert not run_pass(QuantizeGathers(), model).modified   # nothing left to quantize


def test_default_pipeline_shrinks_the_table_and_keeps_the_output():
    m = _model()
    feeds = _feeds()
    q = qpasses.quantize(m, feeds)
    proto = q.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    assert "table" not in {t.name for t in proto.graph.initializer}
    assert "table" not in q.decisions.get("float", {}) and "table" in q.decisions["gathers"]
    weighted = qpasses.quantize(m, feeds, config={"op_types_to_quantize": ["MatMul"]})   # Gather not selected
    assert "table" in {t.name for t in weighted.to_proto().graph.initializer}
    assert len(proto.SerializeToString()) < 0.4 * len(weighted.to_proto().SerializeToString())
    errors = []   # over the feeds: one feed's largest error moves with where its rows fall on the grids
    for feed in feeds[:4]:
        ref, got, old = run(m, feed)[0], run(proto, feed)[0], run(weighted.to_proto(), feed)[0]
        errors.append((np.abs(got - ref).max(), np.abs(old - ref).max()))
    err, err_old = np.max(errors, axis=0)
    assert err <= 1.5 * err_old + 1e-3   # the int8 rows add little to the 8-bit MatMul's own error


def test_tables_that_stay_float_say_why():
    ints = np.arange(V * D, dtype=np.float32).reshape(V, D) % 97
    for model, why in ((from_proto(_model(tied=True)), "also read by Transpose"),
                       (from_proto(_model(table=ints)), "whole numbers only")):
        result = run_pass(QuantizeGathers(), model)
        assert "table" in {t.name for t in model.to_proto().graph.initializer}
        assert why in model.decisions["float"]["table"]["reason"] and result.stats["tables"] == 0
    excluded = from_proto(_model())
    run_pass(QuantizeGathers(), excluded, {"nodes_to_exclude": ["emb"]})
    assert "nodes_to_exclude" in excluded.decisions["float"]["table"]["reason"]
    small = from_proto(_model())
    assert not run_pass(QuantizeGathers(min_values=V * D + 1), small).modified
    for config in ({"op_types_to_quantize": ["Conv", "MatMul"]}, {"weight_type": "int16"}):
        assert not run_pass(QuantizeGathers(), from_proto(_model()), config).modified


def test_dynamic_mode_quantizes_the_table_too():
    model, records = qpasses.run_pipeline(_model(), config={"mode": "dynamic"})
    assert any(r.name == "quantize-gathers" and r.modified for r in records)
    proto = model.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    assert "table" not in {t.name for t in proto.graph.initializer}


@pytest.mark.parametrize("bits,block,symmetric", [(4, 32, True), (4, 16, False), (8, 64, True)])
def test_weight_only_gathers_blocks(bits, block, symmetric):
    m = _lookup_only()
    config = {"mode": "weight_only", "weight_only": {"bits": bits, "block_size": block, "symmetric": symmetric}}
    model, records = qpasses.run_pipeline(m, config=config)
    proto = model.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    node = proto.graph.node[0]
    assert [n.op_type for n in proto.graph.node] == ["GatherBlockQuantized"] and node.domain == "com.microsoft"
    assert len(node.input) == (3 if symmetric else 4)
    arrays = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    data, scales = arrays[node.input[0]], arrays[node.input[2]]
    codes = np.stack([data & 15, data >> 4], -1).reshape(V, D) if bits == 4 else data
    if symmetric:
        zps = np.full(scales.shape, 2 ** (bits - 1))
    else:
        packed = arrays[node.input[3]]
        zps = np.stack([packed & 15, packed >> 4], -1).reshape(V, -1)[:, :D // block] if bits == 4 else packed
    deq = ((codes.reshape(V, D // block, block).astype(np.float32) - zps[..., None]) * scales[..., None]).reshape(V, D)
    table = numpy_helper.to_array(m.graph.initializer[0])
    snr = 10 * np.log10(np.sum(table ** 2) / np.sum((table - deq) ** 2))
    assert snr > 6.02 * bits - 9, snr     # round-to-nearest codes of a Gaussian table
    for feed in _feeds(3):
        np.testing.assert_allclose(run(proto, feed)[0], deq[feed["ids"]], rtol=1e-6, atol=1e-6)
    assert f"int{bits} block {block}" in model.decisions["gathers"]["table"]
    assert sum(t.ByteSize() for t in proto.graph.initializer) < table.nbytes * (bits / 32 + 0.15)


def test_weight_only_leaves_tables_it_cannot_block_float():
    model, _ = qpasses.run_pipeline(_lookup_only(), config={"mode": "weight_only", "weight_only": {"block_size": 128}})
    assert "not a whole number of blocks of 128" in model.decisions["float"]["table"]["reason"]
    model, _ = qpasses.run_pipeline(_lookup_only(), config={"mode": "weight_only", "weight_only": {"exclude": ["em*"]}})
    assert "weight_only.exclude" in model.decisions["float"]["table"]["reason"]
