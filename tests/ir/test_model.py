"""Loading and saving: signature, metadata, IR version, quantization table, external data."""
import json
import os

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

import qpasses
from qpasses import ModelError, TensorQuant
from qpasses.core.verify import check_onnx, check_ort
from qpasses.ir.annotations import Convert
from qpasses.ir.metadata import read_saved
from qpasses.ir.model import from_proto, load, max_ort_ir_version, save
from qpasses.testing import parse, random_feed, run

WITH_INPUT_INIT = """
<ir_version: 10, opset_import: ["" : 17], producer_name: "unit", producer_version: "9">
agraph (float[2, 3] x, float[3] bias) => (float[2, 3] y) <float[3] bias = {1.0, 2.0, 3.0}> {
    y = Add(x, bias)
}
"""


def test_initializer_listed_as_input_keeps_the_signature():
    proto = parse(WITH_INPUT_INIT)
    model = load(proto)
    out = model.to_proto()
    assert [i.name for i in out.graph.input] == ["x", "bias"]
    assert out.producer_name == "unit" and out.producer_version == "9"
    feed = {"x": np.ones((2, 3), np.float32)}
    np.testing.assert_array_equal(run(out, feed)[0], run(proto, feed)[0])
    # and the user can still override the default value
    feed["bias"] = np.zeros(3, np.float32)
    np.testing.assert_array_equal(run(out, feed)[0], feed["x"])


def test_load_does_not_modify_the_proto():
    proto = parse(WITH_INPUT_INIT)
    before = proto.SerializeToString()
    model = load(proto)
    model.graph.nodes[0].op = "Sub"
    model.to_proto()
    assert proto.SerializeToString() == before


def test_metadata_opsets_and_table_survive_save_and_load(tmp_path):
    proto = parse(WITH_INPUT_INIT)
    proto.opset_import.append(helper.make_opsetid("com.example", 1))
    helper.set_model_props(proto, {"author": "me"})
    model = load(proto)
    model.quant["y"] = TensorQuant("uint16", scale=[0.5], zero_point=[3], why=["config default"],
                                   convert=Convert("uint8", ["n1"]))
    model.facts.add("types-annotated")
    model.ranges["y"] = (-1.0, 2.5)
    path = save(model, tmp_path / "m.onnx")
    again = load(path)
    assert again.quant == model.quant
    assert again.quant["y"].convert.recv_nodes == ["n1"]
    assert again.facts == {"types-annotated"}
    assert again.ranges == {"y": (-1.0, 2.5)}
    assert again.metadata == {"author": "me"}
    saved = onnx.load(path)
    assert {(o.domain, o.version) for o in saved.opset_import} >= {("", 17), ("com.example", 1)}
    table = json.loads({p.key: p.value for p in saved.metadata_props}["qpasses.quant_table"])
    assert table["y"]["why"] == ["config default"]


def test_ir_version_is_capped_to_what_onnxruntime_runs():
    proto = parse(WITH_INPUT_INIT)
    proto.ir_version = onnx.IR_VERSION
    out = load(proto).to_proto()
    assert out.ir_version <= max_ort_ir_version()
    check_ort(out)


def test_save_is_atomic_and_keeps_previous_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "out.onnx"
    path.write_bytes(b"previous")

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(ModelError, match="No space left on device.*previous file left intact"):
        save(load(parse(WITH_INPUT_INIT)), path)
    assert path.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["out.onnx"]


def test_save_into_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        save(load(parse(WITH_INPUT_INIT)), tmp_path / "missing" / "m.onnx")


def _big_weight_model(n=256):
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_external_data_round_trip(tmp_path):
    proto = _big_weight_model()
    path = save(load(proto), tmp_path / "ext.onnx", external_data=True)
    assert (tmp_path / "ext.onnx.data").stat().st_size >= 256 * 256 * 4
    model = load(path)
    feed = random_feed(proto)
    np.testing.assert_array_equal(run(model, feed)[0], run(proto, feed)[0])
    check_onnx(model)


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    proto = _big_weight_model(64)
    (tmp_path / "secret.bin").write_bytes(np.zeros(64 * 64, np.float32).tobytes())
    sub = tmp_path / "models"
    sub.mkdir()
    onnx.external_data_helper.set_external_data(proto.graph.initializer[0], "../secret.bin")
    proto.graph.initializer[0].ClearField("raw_data")
    proto.graph.initializer[0].data_location = TensorProto.EXTERNAL
    (sub / "evil.onnx").write_bytes(proto.SerializeToString())
    with pytest.raises(ModelError, match="outside the model's folder"):
        load(sub / "evil.onnx")


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"hello, not a model", "not a readable ONNX model"),
    (b"", "has no graph"),
])
def test_bad_model_files(tmp_path, content, message):
    path = tmp_path / "bad.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelError, match=message):
        load(path)


def test_truncated_model_is_refused(tmp_path):
    data = _big_weight_model(32).SerializeToString()
    path = tmp_path / "trunc.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError):
        load(path)


def test_opset_older_than_onnxruntime_runs_is_refused():
    with pytest.raises(ModelError, match="opset 6 is too old: onnxruntime runs opset 7 or newer"):
        from_proto(parse("agraph (float[2] x) => (float[2] y) { y = Relu(x) }", opset=6))
    assert from_proto(parse("agraph (float[2] x) => (float[2] y) { y = Relu(x) }", opset=9)).opset == 9


def test_copy_is_deep():
    model = load(_big_weight_model(8))
    model.quant["y"] = TensorQuant("uint8")
    clone = model.copy()
    clone.graph.nodes[0].name = "changed"
    clone.quant["y"].qtype = "int8"
    assert model.graph.nodes[0].name == "mm" and model.quant["y"].qtype == "uint8"


def test_copy_can_share_weight_arrays():
    model = load(_big_weight_model(32))
    clone = model.copy(share_weights=True)
    big = [t for t in model.tensors().values() if isinstance(t, gs.Constant) and t.values.nbytes >= 1024]
    assert big and all(clone.tensors()[t.name].values is t.values for t in big)
    exported = clone.to_proto()   # a weight no pass replaced exports as ordinary data, not as a stub
    onnx.checker.check_model(exported)
    assert all(i.data_location == onnx.TensorProto.DEFAULT for i in exported.graph.initializer)
    clone.graph.nodes[0].name = "changed"
    clone.tensors()[big[0].name].values = np.zeros(0, np.float32)   # passes replace arrays, never edit them
    assert model.graph.nodes[0].name == "mm" and big[0].values.size > 0


def test_public_api_exports():
    for name in qpasses.__all__:
        assert hasattr(qpasses, name)


def test_long_metadata_is_packed_and_reads_back(tmp_path):
    from qpasses.ir import metadata

    text = json.dumps({f"t{i}": "why " * 20 for i in range(400)})
    stored = metadata.pack(text)
    assert stored.startswith(metadata.PACKED) and len(stored) < len(text) / 3
    assert metadata.unpack(stored) == text
    assert metadata.pack("{}") == "{}"
    with pytest.raises(ValueError, match="does not decode"):
        metadata.unpack(metadata.PACKED + "not base64!")


def test_many_metadata_problems_make_one_short_line():
    meta = {"qpasses.decisions": json.dumps({"float": {f"t{i}": "just text" for i in range(500)}})}
    with pytest.raises(ModelError, match=r"\(and 497 more\)$") as info:
        read_saved(meta)
    assert len(str(info.value)) < 600


def test_a_bad_packed_entry_is_one_line():
    meta = {"qpasses.decisions": "zlib:AAAA"}
    with pytest.raises(ModelError, match="metadata 'qpasses.decisions' is not JSON .packed but does not decode"):
        read_saved(meta)


def test_a_model_with_long_decisions_saves_them_packed_and_loads_them(tmp_path):
    model = from_proto(parse(WITH_INPUT_INIT))
    model.decisions["float"] = {f"tensor_{i}": {"reason": f"kept float because of reason {i}", "pass": "unit"}
                                for i in range(2000)}
    path = tmp_path / "m.onnx"
    save(model, path)
    stored = {p.key: p.value for p in onnx.load(str(path)).metadata_props}["qpasses.decisions"]
    assert stored.startswith("zlib:")
    assert load(path).decisions["float"] == model.decisions["float"]
