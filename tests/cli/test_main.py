"""The command line: exit codes, one-line errors, no partial outputs, the input never modified."""
import hashlib
import json
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest

from qpasses.cli import main
from qpasses.cli.examples import write_example


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    folder = tmp_path_factory.mktemp("example")
    return write_example(folder)


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_run_default_pipeline_without_calibration(example, tmp_path, capsys):
    model, _, _ = example
    before = _digest(model)
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    code, _, err = _run(capsys, "run", model, "-o", out, "--report", report, "--time-passes")
    assert code == 0, err
    assert _digest(model) == before
    onnx.checker.check_model(onnx.load(out))
    data = json.loads(report.read_text())
    assert data["pipeline"].startswith("fold-constants,fold-batchnorm,cleanup")
    assert "total" in err
    assert not any(n.op_type == "BatchNormalization" for n in onnx.load(out).graph.node)


def _bad_inputs(tmp_path, example):
    model = example[0]
    notonnx = tmp_path / "notonnx.onnx"
    notonnx.write_text("this is text")
    trunc = tmp_path / "trunc.onnx"
    trunc.write_bytes(model.read_bytes()[:200])
    badcfg = tmp_path / "bad.json"
    badcfg.write_text("{not json")
    unknown_key = tmp_path / "unknown.json"
    unknown_key.write_text('{"activaton_type": "uint8"}')
    out = tmp_path / "out.onnx"
    return {
        "missing file": (["run", tmp_path / "nope.onnx", "-o", out], "no such file"),
        "not onnx": (["run", notonnx, "-o", out], "not a readable ONNX model"),
        "truncated": (["run", trunc, "-o", out], "ONNX"),
        "unknown pass": (["run", model, "-o", out, "--passes", "fold-constant"], "did you mean 'fold-constants'"),
        "bad option value": (["run", model, "-o", out, "--passes", "cleanup{bogus=1}"], "has no option 'bogus'"),
        "missing output folder": (["run", model, "-o", tmp_path / "no" / "out.onnx"], "does not exist"),
        "output is input": (["run", model, "-o", model], "overwrite the input"),
        "config not json": (["run", model, "-o", out, "--config", badcfg], "not valid JSON"),
        "config unknown key": (["run", model, "-o", out, "--config", unknown_key], "did you mean 'activation_type'"),
        "missing calib": (["run", model, "-o", out, "--calib", tmp_path / "nope.npz"], "nope.npz"),
    }


CASES = ["missing file", "not onnx", "truncated", "unknown pass", "bad option value",
         "missing output folder", "output is input", "config not json", "config unknown key", "missing calib"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_one_line(case, example, tmp_path, capsys):
    args, message = _bad_inputs(tmp_path, example)[case]
    before = _digest(example[0])
    code, out, err = _run(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qpasses: error:"), err
    assert message in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "out.onnx").exists()
    assert _digest(example[0]) == before


def test_passes_lists_every_registered_pass(capsys):
    from qpasses.core.registry import all_passes

    code, out, _ = _run(capsys, "passes")
    assert code == 0
    for name, cls in all_passes().items():
        assert f"{name}: {cls.summary()}" in out


def test_console_script_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "qpasses", "run", str(tmp_path / "x.onnx"), "-o",
                           str(tmp_path / "y.onnx")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"qpasses: error: {tmp_path / 'x.onnx'}: no such file"


def test_run_quantizes_and_reports_the_selection_and_the_snr(example, tmp_path, capsys):
    model, calib, evals = example
    out, report = tmp_path / "q.onnx", tmp_path / "report.json"
    code, _, err = _run(capsys, "run", model, "-o", out, "--calib", calib, "--eval", evals, "--report", report)
    assert code == 0, err
    onnx.checker.check_model(onnx.load(out))
    data = json.loads(report.read_text())
    chosen = data["findings"]["select-by-snr"]
    assert "select-by-snr" in data["pipeline"] and chosen["samples"] == 32
    assert f"select-by-snr chose {chosen['chosen']}" in err
    assert data["accuracy"]["snr_db"] > 30 and "output SNR vs float" in err
    # the eval samples' own spread: the worst component one jackknife standard error down
    low = re.search(r"one standard error down, as they spread: SNR (-?[0-9.]+) dB", err)
    assert low and 0 < data["objective"]["overall"] - float(low.group(1)) < 3, err


def test_run_says_which_variants_stopped_early(tmp_path, capsys):
    """Sigmoid of N(0, 1) values with one outlier: min/max ranges are far behind the default (mse) ones.
    (Sigmoid stays float by default: the config selects every op, the pipeline is the default one.)"""
    from qpasses.testing import model_from_text

    model = model_from_text("g (float[1, 4096] x) => (float[1, 4096] y) { y = Sigmoid(x) }")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 1, 4096)).astype(np.float32)
    x[0, 0, 0] = 100.0
    path, calib, config = tmp_path / "sigmoid.onnx", tmp_path / "calib.npz", tmp_path / "config.json"
    onnx.save(model.to_proto(), path)
    np.savez(calib, x=x)
    config.write_text(json.dumps({"op_types_to_quantize": "all"}))
    code, _, err = _run(capsys, "run", path, "-o", tmp_path / "q.onnx", "--calib", calib, "--config", config)
    assert code == 0, err
    assert "select-by-snr chose ranges mse" in err
    assert "[clearly ahead after 8], ranges minmax" in err   # the race is decided: the winner stops too
    assert "[clearly behind: stopped after 8]; 32 calibration samples)" in err
