"""The run's SNR line: float outputs calibrate kept are its reference (no second float run), the
output's load-check session runs it, and a bounded evaluation says on how many samples."""
import re
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest

from qpasses.calibration.data import open_data
from qpasses.calibration.kept import KeptSamples
from qpasses.cli import main
from qpasses.cli.examples import example_data, write_example
from qpasses.cli.run import _kept_float_outputs
from qpasses.evaluation.evaluate import compare


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_example(tmp_path_factory.mktemp("example"))


@pytest.fixture
def sessions(monkeypatch):
    """What every onnxruntime session of the run was opened on (a path, or 'bytes')."""
    opened = []
    real = ort.InferenceSession

    def counting(model, *args, **kwargs):
        opened.append(model if isinstance(model, str) else "bytes")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", counting)
    return opened


def _run(capsys, *args):
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def _snr(err):
    return float(re.search(r"output SNR vs float: ([-\d.]+) dB", err).group(1))


def test_the_float_model_runs_once_and_the_output_is_opened_once(example, tmp_path, capsys, sessions):
    model, calib, _ = example
    out = tmp_path / "q.onnx"
    code, err = _run(capsys, "run", model, "-o", out, "--calib", calib)
    assert code == 0, err
    assert str(model) not in sessions   # calibrate's own run gave the float outputs
    staged = [s for s in sessions if isinstance(s, str) and ".qpasses-" in s]
    assert len(staged) == 1, sessions   # the load check's session ran the evaluation too
    again = compare(str(model), str(out), open_data(calib), max_samples=32)
    assert _snr(err) == pytest.approx(again["snr_db"], abs=0.01)
    assert "over 32 samples" in err


def test_with_eval_data_each_model_gets_one_session(example, tmp_path, capsys, sessions):
    model, calib, evald = example
    code, err = _run(capsys, "run", model, "-o", tmp_path / "q.onnx", "--calib", calib, "--eval", evald)
    assert code == 0, err
    assert sessions.count(str(model)) == 1
    assert len([s for s in sessions if isinstance(s, str) and ".qpasses-" in s]) == 1


def test_a_bounded_evaluation_says_on_how_many(example, tmp_path, capsys):
    model, _, _ = example
    many = tmp_path / "many.npz"
    np.savez(many, **example_data(40))
    code, err = _run(capsys, "run", model, "-o", tmp_path / "q.onnx", "--calib", many)
    assert code == 0, err
    assert "over 32 of 40 samples" in err


def test_kept_outputs_serve_only_after_passes_that_keep_the_float_outputs():
    data = object()
    kept = KeptSamples(4, source=data)
    kept.feeds, kept.outputs = [{"x": np.zeros(1)}], [[np.zeros(1)]]
    ctx = SimpleNamespace(cache={"kept_samples": kept}, calibration_data=data)
    records = lambda *names: [SimpleNamespace(name=n) for n in names]  # noqa: E731
    assert _kept_float_outputs(ctx, records("fold-constants", "smooth-quant", "calibrate", "insert-qdq")) is kept
    assert _kept_float_outputs(ctx, records("quantize-weights", "calibrate", "insert-qdq")) is None
    assert _kept_float_outputs(SimpleNamespace(cache={"kept_samples": kept}, calibration_data=object()),
                               records("calibrate")) is None   # kept from other data
