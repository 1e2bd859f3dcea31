"""`qpasses quantize` is `qpasses run` under the name onnxruntime users look for."""
import pytest

from qpasses.cli import main
from qpasses.cli.examples import write_example


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_example(tmp_path_factory.mktemp("example"))


def test_quantize_writes_the_same_model_as_run(example, tmp_path, capsys):
    model, calib, _ = example
    outs = {}
    for command in ("run", "quantize"):
        outs[command] = tmp_path / f"{command}.onnx"
        code = main([command, str(model), "-o", str(outs[command]), "--calib", str(calib), "--quiet"])
        assert code == 0, capsys.readouterr().err
    assert outs["run"].read_bytes() == outs["quantize"].read_bytes()
    assert b"QuantizeLinear" in outs["quantize"].read_bytes()


def test_quantize_is_listed_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "quantize" in capsys.readouterr().out
