"""The cheaper trials of select-by-snr and search-precision (copies imported from one export,
checks scoring the objective alone, calibration without a second float run) give the bytes the
plain ones gave: the same decisions and the same output on models whose search promotes."""
from __future__ import annotations

import numpy as np
import pytest

from qpasses.api import run_pipeline
from qpasses.cli.examples import example_data, example_model
from qpasses.core.context import RunContext
from qpasses.core.pipeline import QUANTIZE_PIPELINE
from qpasses.evaluation.duels import Contender
from qpasses.evaluation.evaluate import Reference
from qpasses.evaluation.scored_runs import ScoredRuns
from qpasses.ir.model import QModel, from_proto
from qpasses.testing import parse

U8S8 = {"activation_type": "uint8", "weight_type": "int8", "per_channel": False, "calibration": {"method": "minmax"}}

# Two MatMuls around a Tanh, the input stretched by a few outliers (+-1000): select-by-snr scores
# symmetric against asymmetric weights, and search-precision promotes tensors over several checks.
OUTLIER_MLP = """
g (float[1, 16] x) => (float[1, 8] y) <float[16, 16] w1 = {%s}, float[16, 8] w2 = {%s}>
{
  h = MatMul(x, w1)
  t = Tanh(h)
  y = MatMul(t, w2)
}
"""


def _mlp():
    rng = np.random.default_rng(3)
    w1 = rng.normal(0.2, 0.3, 256)
    w2 = rng.normal(-0.1, 0.4, 128)
    return parse(OUTLIER_MLP % (", ".join(f"{v:.4f}" for v in w1), ", ".join(f"{v:.4f}" for v in w2)))


def _mlp_feeds(n: int = 40) -> list[dict]:
    rng = np.random.default_rng(0)
    feeds = []
    for _ in range(n):
        x = rng.normal(0.0, 1.0, (1, 16)).astype(np.float32)
        x[0, rng.integers(0, 16)] = rng.choice([-1000.0, 1000.0])
        feeds.append({"x": x})
    return feeds


def _example_feeds() -> list[dict]:
    data = example_data(32)
    return [{k: v[i] for k, v in data.items()} for i in range(32)]


CASES = {"example": (example_model, _example_feeds, U8S8),
         "outlier_mlp": (_mlp, _mlp_feeds, U8S8 | {"accuracy": {"target": 40}})}


# select-by-snr after search-precision: the search's first check cannot take its runs
SEARCH_FIRST = QUANTIZE_PIPELINE.replace("select-by-snr,search-precision", "search-precision,select-by-snr")


def _quantize(case: str, passes: str | None) -> tuple[bytes, dict]:
    make, feeds, config = CASES[case]
    ctx = RunContext(config, feeds())
    model, _ = run_pipeline(from_proto(make()), passes, ctx=ctx)
    return model.to_proto().SerializeToString(), ctx.findings.as_dict()


def _plain_copier(self: QModel):
    """What trials did before QModel.copier: export the model again for every copy."""
    return lambda: from_proto(self.to_proto())


@pytest.mark.parametrize(("passes", "reuses"), [(None, [True]), (SEARCH_FIRST, [])])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cheaper_trials_give_the_same_bytes(case, passes, reuses, monkeypatch):
    real_runs_for, reused = ScoredRuns.runs_for, []

    def runs_for(self, *args):
        runs = real_runs_for(self, *args)
        reused.append(runs is not None)
        return runs

    monkeypatch.setattr(ScoredRuns, "runs_for", runs_for)
    fast, findings = _quantize(case, passes)
    if case == "outlier_mlp":   # the paths this is about ran
        assert findings["search-precision"]["evaluations"] > 2 and findings["search-precision"]["promoted"]
    assert len(findings["select-by-snr"]["variants"]) == 2
    assert reused[:1] == reuses   # the default: search-precision's first check took select-by-snr's runs
    real_score = Reference.score
    monkeypatch.setattr(QModel, "copier", _plain_copier)
    monkeypatch.setattr(Reference, "score", lambda self, m, **kw: real_score(self, m, **(kw | {"per_output": True,
                                                                                              "reuse": None})))
    plain, _ = _quantize(case, passes)
    assert fast == plain and reused[:1] == reuses


def test_reuse_needs_the_same_model_and_feeds(monkeypatch):
    float_model = from_proto(example_model())
    feeds = _example_feeds()
    quantized, _ = run_pipeline(from_proto(example_model()), None, config=U8S8, calibration_data=feeds)
    data = quantized.to_proto(metadata=False).SerializeToString()
    reference = Reference.run(float_model, feeds, 8)
    contender = Contender(reference, data, keep=8)
    contender.advance(8)
    kept = contender.kept
    runs = kept.runs_for(data, reference)
    again = [contender.session.run(reference.names, f) for f in reference.feeds]
    assert len(runs) == 8 and all(np.array_equal(a, b) for r, g in zip(runs, again) for a, b in zip(r, g))
    taken = reference.runs_of(data, judged=True, reuse=kept)
    assert len(taken) == 8 and all(a is b for r, t in zip(runs, taken) for a, b in zip(r, t))
    assert kept.runs_for(data[:-1] + bytes([data[-1] ^ 1]), reference) is None   # other bytes
    assert kept.runs_for(data, Reference.run(float_model, feeds[1:], 8)) is None  # other feeds
    more = Reference.run(float_model, feeds, 9)   # more feeds: the first 8 taken, the 9th run
    assert len(kept.runs_for(data, more)) == 8
    longer = more.runs_of(data, judged=True, reuse=kept)
    assert len(longer) == 9 and longer[0][0] is runs[0][0]
    alone = more.runs_of(data, judged=True)
    assert all(np.array_equal(a, b) for r, g in zip(longer, alone) for a, b in zip(r, g))
    monkeypatch.setattr(ScoredRuns, "runs_for", lambda *a: pytest.fail("kept judged runs taken for a local run"))
    reference.runs_of(data, reuse=kept)   # as this CPU runs it: the judged runs are not its outputs


def test_copier_copies_as_copy_does():
    model = from_proto(example_model())
    fresh = model.copier()
    a, b = fresh(), fresh()
    assert a.to_proto().SerializeToString() == model.copy(share_weights=True).to_proto().SerializeToString()
    name = next(iter(a.tensors()))
    a.graph.nodes.pop()   # copies are independent of each other and of the model
    a.decisions["x"] = 1
    assert b.to_proto().SerializeToString() == model.to_proto().SerializeToString()
    assert name in fresh().tensors()


def test_score_per_output_false_keeps_the_objective():
    from qpasses.evaluation.objective import Objective

    float_model = from_proto(example_model())
    quantized, _ = run_pipeline(from_proto(example_model()), None, config=U8S8, calibration_data=_example_feeds())
    reference = Reference.run(float_model, _example_feeds(), 8)
    objective = Objective("snr", model=float_model.to_proto())
    full = reference.score(quantized, objective=objective)
    short = reference.score(quantized, objective=objective, per_output=False)
    assert short["objective"] == full["objective"] and "outputs" not in short
