"""Calibration data: every source, and one-line errors for every kind of bad input."""
import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnxruntime.quantization import CalibrationDataReader

from qpasses.calibration.data import InputSpec, model_inputs, open_data, validate
from qpasses.calibration.runner import collect_stats
from qpasses.cli import main
from qpasses.errors import CalibrationDataError
from qpasses.testing import model_from_text, parse

TEXT = """
g (float[N, 3] x, int64[2] k) => (float[N, 3] y) {
    y = Relu(x)
}
"""
SPECS = [InputSpec("x", np.dtype(np.float32), ("N", 3)), InputSpec("k", np.dtype(np.int64), (2,))]
XSPEC = [InputSpec("x", np.dtype(np.float32), (1, 3))]


def _samples(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 1, 3)).astype(np.float32)


def _as_list(data):
    return [feed["x"].tolist() for feed in data]


# -- sources ------------------------------------------------------------------------------------
def test_npz_file(tmp_path):
    xs = _samples(4)
    np.savez(tmp_path / "d.npz", x=xs)
    data = open_data(tmp_path / "d.npz")
    assert data.count == 4
    assert _as_list(data) == xs.tolist()
    assert _as_list(data) == xs.tolist()  # re-iterable


@pytest.mark.parametrize("keep_bytes, loads", [(2**20, 1), (0, 3)])
def test_npz_decompressed_once_per_run_when_small(tmp_path, monkeypatch, keep_bytes, loads):
    from qpasses.calibration import data as data_module
    path = tmp_path / "c.npz"
    np.savez_compressed(path, x=_samples(4))
    monkeypatch.setattr(data_module, "KEEP_NPZ_BYTES", keep_bytes)
    reads = []
    real = data_module._npz_arrays
    monkeypatch.setattr(data_module, "_npz_arrays", lambda p: reads.append(p) or real(p))
    data = open_data(path)
    readings = [_as_list(data) for _ in range(3)]
    assert readings[0] == readings[1] == readings[2] == _samples(4).tolist()
    assert len(reads) == loads


def test_npz_folder_sorted_by_name(tmp_path):
    xs = _samples(5)
    np.savez(tmp_path / "b.npz", x=xs[2:])
    np.savez_compressed(tmp_path / "a.npz", x=xs[:2])
    (tmp_path / "notes.txt").write_text("ignored")
    data = open_data(str(tmp_path))
    assert data.count == 5 and _as_list(data) == xs.tolist()


def _write_test_sets(root, xs, named=True):
    for i, x in enumerate(xs):
        folder = root / f"test_data_set_{i}"
        folder.mkdir()
        tensor = numpy_helper.from_array(x, "x" if named else "")
        (folder / "input_0.pb").write_bytes(tensor.SerializeToString())
        (folder / "output_0.pb").write_bytes(tensor.SerializeToString())


def test_onnx_test_data_layout_numeric_order(tmp_path):
    xs = _samples(12)
    _write_test_sets(tmp_path, xs)
    data = open_data(tmp_path)
    assert data.count == 12 and _as_list(data) == xs.tolist()  # test_data_set_10 after _9


def test_onnx_test_data_unnamed_tensor_matches_input_position(tmp_path):
    _write_test_sets(tmp_path, _samples(2), named=False)
    feeds = [validate(f, XSPEC, i) for i, f in enumerate(open_data(tmp_path))]
    assert list(feeds[0]) == ["x"] and feeds[1]["x"].shape == (1, 3)


def test_single_test_data_set_folder(tmp_path):
    _write_test_sets(tmp_path, _samples(1))
    assert open_data(tmp_path / "test_data_set_0").count == 1


def test_list_mapping_and_iterables():
    xs = _samples(3)
    feeds = [{"x": x} for x in xs]
    assert _as_list(open_data(feeds)) == _as_list(open_data(feeds)) == xs.tolist()
    assert _as_list(open_data({"x": xs})) == xs.tolist()
    assert _as_list(open_data(tuple(feeds))) == xs.tolist()


def test_generator_reads_once():
    data = open_data({"x": x} for x in _samples(3))
    assert len(list(data)) == 3
    with pytest.raises(CalibrationDataError, match="one-shot iterator was already read"):
        iter(data)


class Reader(CalibrationDataReader):
    def __init__(self, xs, rewindable=True):
        self.xs, self.i = xs, 0
        if rewindable:
            self.rewind = self._rewind

    def get_next(self):
        if self.i >= len(self.xs):
            return None
        self.i += 1
        return {"x": self.xs[self.i - 1]}

    def _rewind(self):
        self.i = 0


def test_calibration_data_reader_rewinds():
    xs = _samples(3)
    data = open_data(Reader(xs))
    assert _as_list(data) == _as_list(data) == xs.tolist()


def test_reader_without_rewind_reads_once():
    data = open_data(Reader(_samples(2), rewindable=False))
    assert len(list(data)) == 2
    with pytest.raises(CalibrationDataError, match="no rewind"):
        list(data)


# -- accepted conversions -------------------------------------------------------------------------
def test_validate_normalises():
    feed = validate({"k": np.array([1, 2], np.int32), "x": np.ones((2, 3))}, SPECS, 0)
    assert list(feed) == ["x", "k"]
    assert feed["x"].dtype == np.float32 and feed["x"].shape == (2, 3)  # float64 -> float32, N=2
    assert feed["k"].dtype == np.int64
    assert validate({"x": [0.5, 1, 2]}, XSPEC)["x"].shape == (1, 3)  # batch dim of 1 added


def test_validated_iteration(tmp_path):
    _write_test_sets(tmp_path, _samples(3).astype(np.float64), named=False)
    feeds = list(open_data(tmp_path).validated(XSPEC, max_samples=2))
    assert len(feeds) == 2 and feeds[0]["x"].dtype == np.float32


def test_model_inputs_from_qmodel_and_proto():
    proto = parse(TEXT)
    assert model_inputs(proto) == model_inputs(model_from_text(TEXT)) == SPECS


# -- bad inputs: one line each ------------------------------------------------------------------------
def _bad_sources(tmp_path):
    obj = tmp_path / "obj.npz"
    np.savez(obj, x=np.array([{"a": 1}, None], dtype=object))
    uneven = tmp_path / "uneven.npz"
    np.savez(uneven, x=np.zeros((3, 3)), k=np.zeros((2, 2)))
    scalar = tmp_path / "scalar.npz"
    np.savez(scalar, x=np.float32(1))
    rows0 = tmp_path / "rows0.npz"
    np.savez(rows0, x=np.zeros((0, 3)))
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 garbage")
    text = tmp_path / "data.txt"
    text.write_text("1 2 3")
    empty = tmp_path / "empty"
    empty.mkdir()
    return {
        "missing path": (tmp_path / "nope.npz", "no such file"),
        "not npz": (text, "expected an .npz"),
        "empty folder": (empty, "no .npz files"),
        "pickled npz": (obj, r"pickle.*refused"),
        "uneven sample counts": (uneven, "disagree on the number of samples"),
        "scalar array": (scalar, "is a scalar"),
        "zero rows": (rows0, "no samples"),
        "corrupt npz": (corrupt, "not a readable .npz"),
        "empty list": ([], "no samples"),
        "not iterable": (42, "unsupported source"),
    }


BAD_SOURCES = ["missing path", "not npz", "empty folder", "pickled npz", "uneven sample counts",
               "scalar array", "zero rows", "corrupt npz", "empty list", "not iterable"]


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_bad_source(tmp_path, case):
    source, message = _bad_sources(tmp_path)[case]
    with pytest.raises(CalibrationDataError, match=message) as info:
        open_data(source)
    assert "\n" not in str(info.value)


ONE = np.zeros((1, 3), np.float32)
K = np.array([1, 2], np.int64)
BAD_FEEDS = [
    ("missing input", {"x": ONE}, "sample 7: input 'k' is missing"),
    ("extra input", {"x": ONE, "k": K, "z": ONE}, "sample 7: 'z' is not an input of the model"),
    ("wrong rank", {"x": np.zeros((1, 1, 1, 3), np.float32), "k": K}, r"input 'x' has shape \(1, 1, 1, 3\).*\(N, 3\)"),
    ("wrong dim", {"x": np.zeros((1, 4), np.float32), "k": K}, r"input 'x' has shape \(1, 4\)"),
    ("wrong fixed dim", {"x": ONE, "k": np.array([1, 2, 3])}, r"input 'k' has shape \(3,\) but the model expects \(2,\)"),
    ("int to float", {"x": np.zeros((1, 3), np.int64), "k": K}, "input 'x' has dtype int64.*never cast to floats"),
    ("float to int", {"x": ONE, "k": np.array([1.0, 2.0])}, "input 'k' has dtype float64, the model expects int64"),
    ("int out of range", {"x": ONE, "k": np.array([1, 2], np.uint64) + np.uint64(2**63)}, "outside the range"),
    ("nan", {"x": np.array([[0, np.nan, 1]], np.float32), "k": K}, "input 'x' contains NaN"),
    ("inf", {"x": np.array([[0, np.inf, 1]], np.float32), "k": K}, "input 'x' contains Inf"),
    ("overflow in cast", {"x": np.array([[1e300, 0, 0]]), "k": K}, "values too large"),
    ("not a dict", [ONE, K], "expected a dict"),
    ("strings", {"x": np.array([["a", "b", "c"]]), "k": K}, "not a numeric array"),
    ("unnamed index too large", {5: ONE}, "unnamed tensor #5"),
]


@pytest.mark.parametrize("case,feed,message", BAD_FEEDS, ids=[c[0] for c in BAD_FEEDS])
def test_bad_feed(case, feed, message):
    with pytest.raises(CalibrationDataError, match=message) as info:
        validate(feed, SPECS, 7, "calib.npz")
    assert str(info.value).startswith("calib.npz: sample 7")
    assert "\n" not in str(info.value)


def test_zero_samples_from_generator():
    model = model_from_text(TEXT)
    with pytest.raises(CalibrationDataError, match="no samples"):
        collect_stats(model, (f for f in []))


def test_bad_sample_deep_in_the_stream_names_its_index():
    model = model_from_text(TEXT)
    feeds = [{"x": ONE, "k": K}] * 3 + [{"x": ONE}]
    with pytest.raises(CalibrationDataError, match="sample 3: input 'k' is missing"):
        collect_stats(model, feeds)


def test_cli_reports_bad_data_in_one_line(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    onnx.save(parse(TEXT), model)
    np.savez(tmp_path / "bad.npz", x=np.array([[[0, np.nan, 1]]], np.float32), k=np.array([[1, 2]]))
    code = main(["run", str(model), "-o", str(tmp_path / "o.onnx"), "--calib", str(tmp_path / "bad.npz"),
                 "--passes", "calibrate"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0 and "sample 0: input 'x' contains NaN" in err
    assert "Traceback" not in err


def test_negative_dim_value_is_dynamic():
    """Some exporters write dim_value -1 for a dynamic batch (ppocr_v2_cls): any size is accepted."""
    from onnx import TensorProto, helper

    from qpasses.calibration.data import model_inputs, validate

    vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, 0, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [vi],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    specs = model_inputs(helper.make_model(graph))
    feed = validate({"x": np.zeros((2, 3, 5, 4), np.float32)}, specs)
    assert feed["x"].shape == (2, 3, 5, 4)
