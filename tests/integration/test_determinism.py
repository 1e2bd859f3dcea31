"""Determinism: the same model, data and config give a byte-identical output in every process.

The CLI runs in separate processes with different PYTHONHASHSEED values (set and dict iteration
of strings changes with it), on the bundled example and on a model with Concat, Add, a weight and
an input shared by two nodes, several outputs, per-channel weights, a tensor override and a
mixed-precision request. New names are readable and derived from the tensor they belong to.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses.cli.examples import write_example

SEEDS = ("0", "1", "4242")
# new names: <existing name>_<suffix>[_<k>] (suffixes from insert-qdq/insert-converts/fold passes)
SUFFIX = re.compile(r"_(q|dq|scale|zero_point|quantized|dequantized|float|convert|bn)(_\d+)?$")


def shared_model() -> onnx.ModelProto:
    """Two Convs sharing input and weight, Add, Concat, two outputs (opset 17)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(0, 0.1, 4).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.normal(0, 0.1, 4).astype(np.float32), "b2"),
             numpy_helper.from_array(rng.normal(0, 0.3, (8, 5)).astype(np.float32), "fc_w")]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b1"], ["conv_a"], name="conv_a", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "w", "b2"], ["conv_b"], name="conv_b", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["conv_a", "conv_b"], ["sum"], name="add"),
        helper.make_node("Concat", ["sum", "conv_a"], ["cat"], name="concat", axis=1),
        helper.make_node("Relu", ["cat"], ["relu"], name="relu"),
        helper.make_node("GlobalAveragePool", ["relu"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "fc_w"], ["logits"], name="fc"),
        helper.make_node("Sigmoid", ["sum"], ["gate"], name="sigmoid"),
    ]
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 5]),
                               helper.make_tensor_value_info("gate", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


CONFIG = {"per_channel": True, "mixed_precision": {"sum": "uint16"},
          "tensor_overrides": {"gate": [{"quant_type": "uint16"}]}}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    folder = tmp_path_factory.mktemp("det")
    example, calib, _ = write_example(folder / "example")
    onnx.save(shared_model(), folder / "shared.onnx")
    np.savez(folder / "shared.npz", x=np.random.default_rng(3).normal(0, 1, (6, 1, 3, 8, 8)).astype(np.float32))
    (folder / "shared.json").write_text(json.dumps(CONFIG))
    return {"example": [example, "--calib", calib],
            "shared": [folder / "shared.onnx", "--calib", folder / "shared.npz", "--config", folder / "shared.json"]}


def _run(args, out, seed):
    env = dict(os.environ, PYTHONHASHSEED=seed, QPASSES_NO_PROGRESS="1")
    report = out.with_suffix(".json")
    proc = subprocess.run([sys.executable, "-m", "qpasses", "run", *map(str, args), "-o", str(out),
                           "--report", str(report), "--quiet"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    for record in data["passes"]:
        record.pop("seconds")
    data.pop("output")
    return out.read_bytes(), data


@pytest.mark.parametrize("case", ["example", "shared"])
def test_byte_identical_across_processes(case, cases, tmp_path):
    results = [_run(cases[case], tmp_path / f"q{seed}.onnx", seed) for seed in SEEDS]
    first_bytes, first_report = results[0]
    for seed, (data, report) in zip(SEEDS[1:], results[1:]):
        assert data == first_bytes, f"output differs between PYTHONHASHSEED={SEEDS[0]} and {seed}"
        assert report == first_report
    proto = onnx.load_from_string(first_bytes)
    onnx.checker.check_model(proto)
    _assert_readable_names(onnx.load(str(cases[case][0])), proto)
    if case == "shared":
        types = {t.name: t.data_type for t in proto.graph.initializer}
        assert any(t == TensorProto.UINT16 for t in types.values()), "the mixed-precision request was lost"


def _assert_readable_names(source: onnx.ModelProto, out: onnx.ModelProto) -> None:
    """Every name in the output is an input name or <input name>_<suffix>... (no counters, no ids)."""
    known = {n.name for n in source.graph.node} | {t.name for t in source.graph.initializer}
    known |= {v.name for v in list(source.graph.input) + list(source.graph.output)}
    known |= {o for n in source.graph.node for o in list(n.output) + list(n.input)}
    names = {n.name for n in out.graph.node} | {t.name for t in out.graph.initializer}
    names |= {o for n in out.graph.node for o in list(n.output) + list(n.input) if o}
    for name in sorted(names - known):
        base = name
        while base not in known and SUFFIX.search(base):
            base = SUFFIX.sub("", base, count=1)
        assert base in known, f"'{name}' is not derived from a tensor or node of the input model"


def test_in_process_runs_are_identical(cases, tmp_path):
    """Two runs in one process (warm caches, registries already imported) give the same bytes too."""
    from qpasses.cli import main

    outs = []
    for i in range(2):
        out = tmp_path / f"q{i}.onnx"
        assert main([*map(str, ["run", *cases["shared"]]), "-o", str(out), "--quiet"]) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
