"""qpasses.evaluation.integer_kernels: the weighted ops onnxruntime runs as integer kernels, in the run's summary."""
import json

import pytest

from qpasses.cli import main
from qpasses.cli.examples import write_example


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_example(tmp_path_factory.mktemp("ex"))


def _run(example, tmp_path, capsys, config=None):
    model, calib, _ = example
    args = ["run", str(model), "-o", str(tmp_path / "q.onnx"), "--calib", str(calib), "--report", str(tmp_path / "r.json")]
    if config:
        (tmp_path / "c.json").write_text(json.dumps(config))
        args += ["--config", str(tmp_path / "c.json")]
    assert main(args) == 0
    return capsys.readouterr().err, json.loads((tmp_path / "r.json").read_text())


def test_every_8_bit_weighted_op_runs_as_an_integer_kernel(example, tmp_path, capsys):
    err, report = _run(example, tmp_path, capsys)
    assert report["integer_kernels"] == 3
    assert "qpasses: 8-bit: 100 % of weighted ops (3 of 3); " in err and "integer kernels" not in err


def test_a_conv_without_a_q_after_it_is_said_to_run_in_float(example, tmp_path, capsys):
    """8-bit DQ inputs, no Q on the output: onnxruntime's CPU provider has no integer Conv for it."""
    err, report = _run(example, tmp_path, capsys, {"op_types_to_exclude_output_quantization": ["Conv"]})
    assert report["integer_kernels"] < 3
    assert f"(3 of 3; onnxruntime runs {report['integer_kernels']} as integer kernels)" in err
