"""Weight-only fast paths give the same numbers as the plain ones: the einsum code sums, RTN in
chunks of blocks, weights read without gs's copies (and the source proto left as it was)."""
import copy

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import helper, numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from qpasses.api import run_pipeline
from qpasses.core.context import RunContext
from qpasses.ir.model import constant_dtype, from_proto, read_values
from qpasses.weightonly import rtn
from qpasses.weightonly.blocks import columns_of, minmax_params
from qpasses.weightonly.matmulnbits import pack_b, pack_codes


def _plain_refit(blocks, scales, zps, bits, axis):
    q = rtn.centered_codes(blocks, scales, zps, bits, axis)
    num, den = (blocks * q).sum(axis=axis), (q * q).sum(axis=axis)
    return np.where(den > 0, num / np.where(den > 0, den, 1), scales).astype(np.float32)


@pytest.mark.parametrize("bits,block,symmetric", [(4, 32, True), (4, 32, False), (8, 64, False), (8, 512, True)])
def test_refit_equals_plain_sums(bits, block, symmetric):
    w = (np.random.default_rng(bits + block).standard_normal((4 * block, 24)) * 0.1).astype(np.float32)
    blocks = columns_of(w, block)
    s, z = minmax_params(blocks, bits, symmetric, axis=1)
    assert np.array_equal(rtn.refit_scales(blocks, s, z, bits, axis=1), _plain_refit(blocks, s, z, bits, 1))


@pytest.mark.parametrize("kwargs", [{}, {"symmetric": False}, {"weighted": True}, {"weighted": True, "clip_search": True}])
def test_rtn_in_chunks_equals_one_chunk(monkeypatch, kwargs):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((200, 48)) * 0.05).astype(np.float32)   # K padded: 7 blocks of 32
    weights = rng.random(200).astype(np.float32) if kwargs.get("weighted") else None
    sym, clip = kwargs.get("symmetric", True), kwargs.get("clip_search", False)
    runs = []
    for chunk in (1, 3 * 32 * 48, 1 << 30):
        monkeypatch.setattr(rtn, "CHUNK", chunk)
        runs.append(rtn.quantize_rtn(w, 4, 32, sym, channel_weights=weights, clip_search=clip))
    for other in runs[1:]:
        for field in ("codes", "scales", "zero_points"):
            assert np.array_equal(getattr(runs[0], field), getattr(other, field))
    assert runs[0].codes.max() <= 15


def _model(dtype=np.float32):
    w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8).astype(dtype) / 100
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, [2, 64])],
                              [helper.make_tensor_value_info("y", elem, [2, 8])], [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), w


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_read_values_is_one_read_only_copy(dtype):
    proto, w = _model(dtype)
    model = from_proto(proto)
    const = next(t for t in model.graph.nodes[0].inputs if isinstance(t, gs.Constant))
    assert isinstance(const._values, LazyValues)
    assert constant_dtype(const) == np.dtype(dtype).name and isinstance(const._values, LazyValues)   # not loaded
    array = read_values(const)
    assert array.dtype == dtype and np.array_equal(array, w) and not array.flags.writeable
    assert isinstance(const._values, LazyValues)                      # the graph keeps the lazy tensor
    assert np.array_equal(array, const.values)


@pytest.mark.parametrize("algorithm,fmt", [("rtn", "matmulnbits"), ("rtn", "qdq"), ("hqq", "matmulnbits")])
def test_quantizing_leaves_the_source_proto_alone(algorithm, fmt):
    proto, _ = _model()
    before = copy.deepcopy(proto)
    cfg = {"mode": "weight_only", "weight_only": {"algorithm": algorithm, "format": fmt, "block_size": 32}}
    model, _ = run_pipeline(proto, None, ctx=RunContext(cfg))
    assert proto == before
    assert model.decisions["weight_only"]["w"].startswith(f"quantize-weights: {algorithm}")


@pytest.mark.parametrize("bits,block", [(4, 32), (4, 16), (8, 64)])
def test_pack_b_from_columns_equals_packing_rows(bits, block):
    w = (np.random.default_rng(bits).standard_normal((3 * block + 5, 12))).astype(np.float32)
    blocked = rtn.quantize_rtn(w, bits, block, symmetric=False)
    assert blocked.columns and blocked.codes.max() > 2 ** (bits - 1)
    assert np.array_equal(pack_b(blocked), pack_codes(blocked.rows(), bits))
