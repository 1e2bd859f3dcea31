"""The public API, used the old way whatever the package's layout: ``import qpasses`` and its names,
the ``qpasses`` command (pyproject's entry point), ``python -m qpasses`` and pipeline text."""
import importlib
import subprocess
import sys
import tomllib
from typing import ClassVar

import numpy as np
import onnx.parser
import pytest

import qpasses
from tests.kits import ROOT

PUBLIC = {
    "CalibrationDataError", "ConfigError", "Convert", "ModelError", "Pass", "PassFailure", "PassManager",
    "PassResult", "PipelineError", "PreconditionError", "QModel", "QpassesError", "QuantConfig", "QuantTable",
    "RunContext", "TensorQuant", "all_passes", "load", "load_config", "parse_pipeline", "print_pipeline",
    "quantize", "quantize_static", "register", "run_pipeline", "save",
}
CONV = onnx.parser.parse_model("""
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,4,4] x) => (float[1,2,4,4] y) <float[2,2,1,1] w = {0.5, -0.25, 0.125, 1.0}, float[2] b = {0.1, -0.2}>
{
  c = Conv(x, w, b)
  y = Relu(c)
}
""")


def _feeds(n=8):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((1, 2, 4, 4)).astype(np.float32)} for _ in range(n)]


def test_the_package_exports_the_public_names():
    assert set(qpasses.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(qpasses, name) is not None, name
    assert issubclass(qpasses.ModelError, qpasses.QpassesError)


def test_quantize_save_load_and_run_pipeline(tmp_path):
    model = qpasses.quantize(CONV, _feeds(), qpasses.load_config({"per_channel": False}))
    assert isinstance(model, qpasses.QModel) and isinstance(model.quant, qpasses.QuantTable)
    assert any(n.op == "QuantizeLinear" for n in model.graph.nodes)
    qpasses.save(model, tmp_path / "q.onnx")
    again = qpasses.load(tmp_path / "q.onnx")
    assert isinstance(again.quant.get("w"), qpasses.TensorQuant)
    floats, records = qpasses.run_pipeline(CONV, "fold-constants,cleanup")
    assert [r.name for r in records] == ["fold-constants", "cleanup"]
    assert not any(n.op == "QuantizeLinear" for n in floats.graph.nodes)


def test_quantize_static_with_a_reader(tmp_path):
    class Reader:
        def __init__(self):
            self.feeds = iter(_feeds())

        def get_next(self):
            return next(self.feeds, None)

    qpasses.quantize_static(CONV, tmp_path / "q.onnx", Reader(), per_channel=False)
    assert (tmp_path / "q.onnx").exists()


def test_a_pass_registered_the_old_way_runs_from_pipeline_text():
    @qpasses.register
    class CountNodes(qpasses.Pass):
        """Counts the nodes (a pass written by a user)."""
        name: ClassVar[str] = "test-count-nodes"
        scale: int = 1

        def run(self, model, ctx):
            return qpasses.PassResult(model, False, {"nodes": self.scale * len(model.graph.nodes)})

    try:
        assert "test-count-nodes" in qpasses.all_passes()
        passes = qpasses.parse_pipeline("test-count-nodes{scale=2},cleanup")
        assert qpasses.print_pipeline(passes) == "test-count-nodes{scale=2},cleanup"
        records = qpasses.PassManager(passes).run(qpasses.run_pipeline(CONV, [])[0], qpasses.RunContext())
        assert records[0].stats == {"nodes": 4}
        with pytest.raises(qpasses.PipelineError, match="unknown pass"):
            qpasses.parse_pipeline("test-no-such-pass")
    finally:
        from qpasses.core.registry import unregister

        unregister("test-count-nodes")


def test_the_command_entry_point_and_python_m():
    script = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["qpasses"]
    assert script == "qpasses.cli:main"
    module, _, attr = script.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    done = subprocess.run([sys.executable, "-m", "qpasses", "passes"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "insert-qdq:" in done.stdout
