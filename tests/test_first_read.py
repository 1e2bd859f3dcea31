"""What a user reads first is the truth: the kept-float list names compute tensors, --time-passes
prints each nested pass once, check predicts what run quantizes, why-lines read in the direction
of their decision, the Python API reads a one-shot generator once and says what it did."""
from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qpasses.cli import main


def detector() -> onnx.ModelProto:
    """x -> MatMul -> Relu -> {boxes: MatMul * 320, scores: Sigmoid(MatMul + b)} -> Concat."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in (("w1", (16, 32)), ("wb", (32, 4)), ("ws", (32, 20)))]
    inits += [numpy_helper.from_array(np.array(320, np.float32), "k"),
              numpy_helper.from_array(np.full(20, -4, np.float32), "bs")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "wb"], ["b0"], name="box"),
             helper.make_node("Mul", ["b0", "k"], ["boxes"], name="boxmul"),
             helper.make_node("MatMul", ["r", "ws"], ["s0"], name="cls"),
             helper.make_node("Add", ["s0", "bs"], ["s1"], name="clsb"),
             helper.make_node("Sigmoid", ["s1"], ["scores"], name="sig"),
             helper.make_node("Concat", ["boxes", "scores"], ["output0"], name="cat", axis=2)]
    graph = helper.make_graph(nodes, "det", [helper.make_tensor_value_info("x", 1, [1, 64, 16])],
                              [helper.make_tensor_value_info("output0", 1, [1, 64, 24])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.fixture(scope="module")
def det_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("det")
    onnx.save(detector(), folder / "det.onnx")
    np.savez(folder / "calib.npz", x=np.random.default_rng(1).standard_normal((8, 1, 64, 16)).astype(np.float32))
    return folder


def _run(capsys, *args):
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_kept_float_names_compute_tensors_not_constants(det_files, tmp_path, capsys):
    report, page = tmp_path / "r.json", tmp_path / "r.html"
    code, err = _run(capsys, "run", det_files / "det.onnx", "-o", tmp_path / "q.onnx", "--calib",
                     det_files / "calib.npz", "--report", report, "--html", page)
    assert code == 0, err
    recorded = {row["tensor"] for row in json.loads(report.read_text())["unquantized"]}
    assert "k" in recorded   # the Mul's constant stays float (the JSON report keeps every reason)
    line = next(x for x in err.splitlines() if "kept float:" in x)
    count, names = re.search(r"kept float: (\d+) tensors \((.*)\)", line).groups()
    assert int(count) == len(recorded) - 1
    assert names == "b0, boxes, s0, s1, scores, ..."   # graph order, no constant
    text = page.read_text()
    assert "6 tensors left float, and why (and 1 constant: weights, biases, shapes, parameters)" in text


def test_time_passes_prints_each_nested_pass_once(det_files, tmp_path, capsys):
    code, err = _run(capsys, "run", det_files / "det.onnx", "-o", tmp_path / "q.onnx", "--calib",
                     det_files / "calib.npz", "--time-passes")
    assert code == 0, err
    table = err[err.index("  seconds"):].splitlines()[1:-2]
    rows = [re.match(r"\s*([0-9.]+)\s+[0-9.]+\s+(\s*(?:└ )?)(\S+)( x\d+)?", line).groups() for line in table]
    parents = []
    for seconds, indent, name, runs in rows:
        if not indent:
            parents.append([name, float(seconds), []])
        else:
            parents[-1][2].append((name, runs, float(seconds)))
    nested = {name: children for name, _, children in parents if children}
    assert nested["select-by-snr"], table   # two variants scored: each nested pass ran twice
    for parent, children in nested.items():
        names = [c[0] for c in children]
        assert len(names) == len(set(names)), f"{parent}: {names}"   # one row each
    assert [c[1] for c in nested["select-by-snr"]] == [" x2"] * len(nested["select-by-snr"])
    assert err.strip().splitlines()[-1].startswith("qpasses: wrote")
