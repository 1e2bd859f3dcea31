"""ir/analyses: typed keys cached per model, dropped by what a pass declares it changes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import onnx_graphsurgeon as gs
import pytest

from qpasses.core.instruments import VerifyEach
from qpasses.core.pipeline import Pass, PassManager, PassResult
from qpasses.errors import PassFailure
from qpasses.ir import analyses
from qpasses.ir.analyses import GRAPH, QUANT, WEIGHTS, analysis, stale_analyses
from qpasses.ir.annotations import TensorQuant
from qpasses.ir.dataflow import dataflow
from qpasses.testing import model_from_text

MODEL = """
agraph (float[2, 3] x) => (float[2, 3] y) <float[3] c = {1.0, 2.0, 3.0}> {
    a = Add(x, c)
    y = Relu(a)
}
"""


@pytest.fixture
def declared(monkeypatch):
    """Analyses declared by a test stay out of the package's list."""
    monkeypatch.setattr(analyses, "ANALYSES", [])


@dataclass
class EditTable(Pass):
    """Test pass: edits the table only."""
    name: ClassVar[str] = "edit-table"
    unchanged: ClassVar[frozenset] = frozenset({GRAPH, WEIGHTS})

    def run(self, model, ctx):
        model.quant["a"] = TensorQuant("uint8", "activation")
        return PassResult(model, True)


@dataclass
class AddNode(Pass):
    """Test pass: appends an Identity to the graph; ``unchanged`` set per test."""
    name: ClassVar[str] = "add-node"
    touch: bool = False

    def run(self, model, ctx):
        y = model.graph.outputs[0]
        out = gs.Variable("z", dtype=y.dtype, shape=y.shape)
        model.graph.nodes.append(gs.Node("Identity", "extra", inputs=[y], outputs=[out]))
        model.graph.outputs = [out]
        if self.touch:
            model.touch()
        return PassResult(model, True)


def test_a_table_only_pass_keeps_the_graph_analyses():
    model = model_from_text(MODEL)
    flow, tensors = dataflow(model), model.tensors()
    PassManager([EditTable()]).run(model)
    assert dataflow(model) is flow and model.tensors() is tensors
    assert not stale_analyses(model)


def test_a_pass_that_declares_nothing_drops_every_analysis():
    model = model_from_text(MODEL)
    flow = dataflow(model)
    PassManager([AddNode()]).run(model)
    assert dataflow(model) is not flow
    assert dataflow(model).writer("z") == "extra"


def test_an_analysis_reading_the_table_is_dropped_when_the_table_changes(declared):
    @analysis(GRAPH, QUANT)
    def entries(model):
        return sorted(name for name, _ in model.quant.items())

    model = model_from_text(MODEL)
    assert entries(model) == []
    PassManager([EditTable()]).run(model)
    assert entries(model) == ["a"]


def test_results_built_from_a_dropped_one_are_dropped_with_it(declared):
    @analysis(QUANT)
    def entries(model):
        return sorted(name for name, _ in model.quant.items())

    @analysis(GRAPH)   # reads the table too, through ``entries``
    def described(model):
        return [(n.name, entries(model)) for n in model.graph.nodes]

    model = model_from_text(MODEL)
    assert described(model)[0][1] == []
    PassManager([EditTable()]).run(model)
    assert described(model)[0][1] == ["a"]


def test_a_pass_that_changes_what_it_declares_unchanged_fails_verify_each(monkeypatch):
    model = model_from_text(MODEL)
    dataflow(model)
    monkeypatch.setattr(AddNode, "unchanged", frozenset({GRAPH}))
    with pytest.raises(PassFailure, match=r"after pass 'add-node': cached analyses no longer match .*dataflow"):
        PassManager([AddNode()], [VerifyEach("structure")]).run(model)


def test_touch_drops_what_a_mid_pass_rewrite_made_stale(monkeypatch):
    model = model_from_text(MODEL)
    dataflow(model)
    monkeypatch.setattr(AddNode, "unchanged", frozenset({GRAPH}))
    PassManager([AddNode(touch=True)], [VerifyEach("structure")]).run(model)
    assert dataflow(model).writer("z") == "extra"


def test_an_analysis_declares_what_it_reads():
    with pytest.raises(TypeError, match="parts of the model"):
        analysis()(lambda model: None)
