"""Shared fixtures of the report and per-layer comparison tests: two Convs, the bundled example quantized."""
import numpy as np

from qpasses.api import run_pipeline
from qpasses.cli import main
from qpasses.cli.examples import write_example
from qpasses.testing import model_from_text

CONVS = """
g (float[1, 4, 8, 8] x) => (float[1, 4, 8, 8] y)
  <float[4, 4, 3, 3] w1 = {%s}, float[4, 4, 3, 3] w2 = {%s}> {
  c1 = Conv <pads = [1, 1, 1, 1]> (x, w1)
  r1 = Relu (c1)
  y = Conv <pads = [1, 1, 1, 1]> (r1, w2)
}"""


def convs(samples: int):
    """(float model, its default QDQ model, feeds): Conv -> Relu -> Conv with seeded weights."""
    rng = np.random.default_rng(0)
    text = CONVS % tuple(", ".join(f"{v:.4f}" for v in rng.normal(0, 0.3, 144)) for _ in range(2))
    feeds = [{"x": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)} for _ in range(samples)]
    qdq, _ = run_pipeline(model_from_text(text), None, calibration_data=feeds)
    return model_from_text(text), qdq, feeds


def quantized_example(folder, *extra):
    """(float model path, `qpasses run` output path, eval data path) of the bundled example in
    ``folder``; ``extra``: more ``run`` arguments."""
    model, calib, evals = write_example(folder)
    q = folder / "q.onnx"
    assert main(["run", str(model), "-o", str(q), "--calib", str(calib), "--quiet", *extra]) == 0
    return model, q, evals
