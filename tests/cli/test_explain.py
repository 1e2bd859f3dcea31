"""`qpasses explain`: a tensor's qparams and the chain of reasons, read from the saved model."""
import json

import pytest

from qpasses.cli import main
from qpasses.cli.examples import write_example


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("explain")
    model, calib, _ = write_example(folder)
    config = folder / "mp.json"
    config.write_text(json.dumps({"mixed_precision": {"pool": "uint16"}}))
    out, report = folder / "q.onnx", folder / "r.json"
    assert main(["run", str(model), "-o", str(out), "--calib", str(calib), "--config", str(config),
                 "--report", str(report), "--quiet"]) == 0
    return out, json.loads(report.read_text())


def test_explain_shows_type_qparams_and_reasons(mixed_model, capsys):
    out, _ = mixed_model
    assert main(["explain", str(out), "--tensor", "flat"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("flat: uint16 activation, asymmetric, per-tensor")
    assert "shares qparams with 'gap'" in text
    assert "converted to uint8 for fc: scale" in text
    assert "pulled into the uint16 region of 'pool'" in text
    assert "1. same type as 'gap'" in text


def test_explain_everything_lists_each_tensor(mixed_model, capsys):
    out, _ = mixed_model
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    for name in ("input:", "conv1_w", "fc_b:", "pool:"):
        assert name in text
    assert "int32 bias" in text


def test_report_lists_plan_and_accuracy(mixed_model):
    _, report = mixed_model
    plan = report["findings"]["mixed_precision_plan"]
    assert "pool" in json.dumps(plan)
    assert report["accuracy"]["samples"] > 0 and report["accuracy"]["snr_db"] > 20


def test_explain_unknown_tensor_is_a_user_error(mixed_model, capsys):
    out, _ = mixed_model
    assert main(["explain", str(out), "--tensor", "flatt"]) == 2
    err = capsys.readouterr().err.strip()
    # explain also answers for tensors a pass left float (model.decisions["float"])
    assert err == "qpasses: error: tensor 'flatt' is neither quantized nor left float by a pass (did you mean 'flat'?)"
