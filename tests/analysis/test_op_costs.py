"""qpasses.analysis.op_costs: what keeping a weighted op float costs, by op pattern."""
import json

import numpy as np
import onnx_graphsurgeon as gs
from qpasses.analysis import op_costs


def _node(op, w_shape, out_shape, in_shape=None, **attrs):
    x = gs.Variable("x", np.float32, in_shape)
    w = gs.Constant("w", np.zeros(w_shape, np.float32))
    return gs.Node(op, inputs=[x, w], outputs=[gs.Variable("y", np.float32, out_shape)], attrs=attrs)


def test_patterns_by_kind_channels_and_positions():
    assert op_costs.pattern(_node("Conv", (24, 12, 3, 3), [1, 24, 208, 208])) == "conv3x3|0|1|2"
    assert op_costs.pattern(_node("Conv", (256, 128, 1, 1), [1, 256, 20, 20])) == "conv1x1|2|2|0"
    assert op_costs.pattern(_node("Conv", (64, 1, 5, 5), [1, 64, 40, 40], group=64)) == "depthwisekxk|0|1|1"
    assert op_costs.pattern(_node("Conv", (8, 4, 7, 7), ["n", 8, 9, 9])) == "convkxk|0|0|1"   # unknown: middle
    assert op_costs.pattern(_node("ConvTranspose", (64, 32, 2, 2), [1, 32, 80, 80], in_shape=[1, 64, 40, 40])) \
        == "convtranspose|1|1|1"
    assert op_costs.pattern(_node("MatMul", (384, 1536), [1, 128, 1536])) == "matmul|1|2|1"
    assert op_costs.pattern(_node("Gemm", (10, 600), [1, 10], transB=1)) == "matmul|2|0|0"
    assert op_costs.pattern(_node("Relu", (3,), [3])) is None
    assert op_costs.pattern(_node("Conv", (4, 4, 3, 3), [1, 4, 8, 8])) in op_costs.grid()


def test_lookup_exact_nearest_and_never_negative():
    table = {"conv3x3|0|1|2": 53.0, "conv3x3|1|1|1": 30.0, "depthwise3x3|0|1|1": -4.0, "conv1x1|1|1|1": 12.0}
    assert op_costs.ps_per_mac(table, "conv3x3|0|1|2") == 53.0
    assert op_costs.ps_per_mac(table, "conv3x3|0|1|1") == 53.0   # one step from both: ties by name
    assert op_costs.ps_per_mac(table, "conv3x3|2|2|1") == 30.0   # nearest of its kind
    assert op_costs.ps_per_mac(table, "depthwise3x3|0|1|1") == 0.0   # int8 slower: costs nothing
    assert op_costs.ps_per_mac(table, "matmul|1|1|1") == 21.0   # no MatMul measured: the median
    assert op_costs.ps_per_mac({}, "matmul|1|1|1") == 0.0


def test_the_shipped_table_covers_every_pattern():
    table = op_costs.shipped()
    assert set(table) == set(op_costs.grid())
    assert all(np.isfinite(v) for v in table.values())
    about = json.loads(op_costs.SHIPPED.read_text())["machine"]
    assert {"cpu", "onnxruntime", "date"} <= set(about)


def test_one_op_models_run_float_against_int8_kernels(tmp_path):
    """The int8 form is what onnxruntime fuses into its integer kernel; the float form reads a float
    tensor, so onnxruntime does not requantize its weight."""
    import onnx

    from qpasses.calibration.sessions import ort_session

    for name, kernel in (("conv3x3|0|1|0", "QLinearConv"), ("matmul|0|0|0", "MatMulIntegerToFloat")):
        floated, quantized, feeds, macs = op_costs.one_op_models(name)
        fused = []
        for model, feed, path in ((floated, feeds[0], tmp_path / "f.onnx"), (quantized, feeds[1], tmp_path / "q.onnx")):
            sess = ort_session(model, optimization="all", threads=1, optimized_to=path)
            assert sess.run(None, feed)[0].shape == tuple(sess.get_outputs()[0].shape)
            fused.append({n.op_type for n in onnx.load(path).graph.node})
        assert kernel in fused[1] and kernel not in fused[0] and macs > 0


def test_measured_costs_are_cached_and_a_corrupt_cache_is_measured_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(op_costs, "measure", lambda name: calls.append(name) or 7.0)
    path = tmp_path / "op-costs" / "this.json"
    path.parent.mkdir()
    path.write_text('{"ps_per_mac": {"conv1x1|1|1|1": ')   # cut short
    assert op_costs.measured(["conv1x1|1|1|1", "matmul|0|0|0", "conv1x1|1|1|1"], path) == {
        "conv1x1|1|1|1": 7.0, "matmul|0|0|0": 7.0}
    assert sorted(calls) == ["conv1x1|1|1|1", "matmul|0|0|0"]
    assert json.loads(path.read_text())["ps_per_mac"] == {"conv1x1|1|1|1": 7.0, "matmul|0|0|0": 7.0}
    assert op_costs.measured(["matmul|0|0|0"], path) == {"matmul|0|0|0": 7.0} and len(calls) == 2
    for bad in ("[1, 2]", '{"ps_per_mac": {"matmul|0|0|0": "x"}}', '{"ps_per_mac": {"matmul|0|0|0": NaN}}'):
        path.write_text(bad)
        assert op_costs.measured(["matmul|0|0|0"], path) == {"matmul|0|0|0": 7.0}
    assert len(calls) == 5


def test_an_unwritable_cache_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(op_costs, "measure", lambda name: 3.0)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert op_costs.measured(["matmul|0|0|0"], blocker / "sub" / "c.json") == {"matmul|0|0|0": 3.0}
    assert blocker.read_text() == "not a folder"


def test_the_cache_is_per_cpu_and_onnxruntime_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = op_costs.cache_path()
    assert path.parent == tmp_path / "qpasses" / "op-costs" and path.suffix == ".json"
