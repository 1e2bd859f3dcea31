"""The pass contract, checked for every registered pass on its own documented example:
it rewrites the example, does nothing on a graph it has nothing to do with, a second run changes
nothing, its output survives a save/load round trip unchanged with its facts holding, passes
onnx.checker, and leaves no cached analysis stale."""
from __future__ import annotations

import importlib
import pkgutil
import textwrap

import onnx
import pytest

from qpasses.core.context import RunContext
from qpasses.core.facts import check_facts
from qpasses.core.pipeline import PassManager, make_pass
from qpasses.core.registry import all_passes
from qpasses.ir.analyses import ANALYSES, stale_analyses
from qpasses.ir.model import from_proto
from qpasses.testing import parse, random_feed

# Passes whose documented example is not a rewrite (they choose or measure; the example shows that)
NOT_A_REWRITE = {"select-by-snr"}
# Passes that record decisions on any graph (the table, the ranges): a first run always writes them
RECORD_ON_ANY_GRAPH = {"annotate-types", "calibrate"}
NOTHING_TO_DO = """
<ir_version: 10, opset_import: ["" : 17]>
g (float[1, 4] x) => (float[1, 4] y) { y = Identity(x) }
"""


def _prepared(cls, text: str, config=None):
    model = from_proto(parse(textwrap.dedent(text).strip()))
    feeds = [random_feed(model, seed=s) for s in range(8)]
    ctx = RunContext(config, feeds)
    prelude = (getattr(cls, "example_prelude", "") or "").strip()
    if prelude:
        PassManager(prelude).run(model, ctx)
    return model, ctx


def _run(name: str, model, ctx):
    return PassManager([make_pass(name)]).run(model, ctx)[0]


@pytest.mark.parametrize("name", sorted(all_passes()))
def test_rewrites_its_example_idempotently_and_round_trips(name):
    cls = all_passes()[name]
    assert getattr(cls, "example", None), f"pass {name} documents no example"
    model, ctx = _prepared(cls, cls.example, getattr(cls, "example_config", None))
    first = _run(name, model, ctx)
    assert first.modified or name in NOT_A_REWRITE, f"{name} did not change its own example"
    proto = model.to_proto()
    onnx.checker.check_model(proto, full_check=True)
    check_facts(model)
    again = _run(name, model, ctx)
    assert not again.modified, f"{name} changed the model on a second run: {again.stats}"
    reloaded = from_proto(proto)
    check_facts(reloaded)
    assert reloaded.to_proto().SerializeToString() == proto.SerializeToString()
    assert reloaded.facts == model.facts


@pytest.mark.parametrize("name", sorted(all_passes()))
def test_leaves_alone_a_graph_it_has_nothing_to_do_with(name):
    cls = all_passes()[name]
    if name in RECORD_ON_ANY_GRAPH:
        pytest.skip(f"{name} records its decisions on any graph (its idempotence is tested above)")
    model, ctx = _prepared(cls, NOTHING_TO_DO)
    before = _without_facts(model)
    result = _run(name, model, ctx)
    assert not result.modified, f"{name} changed an Identity graph: {result.stats}"
    assert _without_facts(model) == before   # facts it establishes may be added


def _without_facts(model) -> bytes:
    proto = model.to_proto()
    kept = [p for p in proto.metadata_props if p.key != "qpasses.facts"]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    return proto.SerializeToString()


@pytest.mark.parametrize("name", sorted(all_passes()))
def test_keeps_only_the_analyses_that_still_hold(name):
    """Every analysis is cached before the pass; after it, those the pass's ``unchanged`` kept are
    what a fresh build gives."""
    import qpasses.analysis
    import qpasses.ir.dataflow  # noqa: F401  (declares an analysis)

    for info in pkgutil.iter_modules(qpasses.analysis.__path__):
        importlib.import_module(f"qpasses.analysis.{info.name}")
    cls = all_passes()[name]
    model, ctx = _prepared(cls, cls.example, getattr(cls, "example_config", None))
    for key in ANALYSES:
        key(model)
    _run(name, model, ctx)
    parts = sorted(getattr(x, "name", str(x)) for x in cls.unchanged)
    assert not stale_analyses(model), f"{name} changed a part of the model it declares unchanged ({parts})"
