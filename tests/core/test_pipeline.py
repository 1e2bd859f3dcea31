"""Pass manager, pipeline text and registry."""
from typing import ClassVar

import pytest

from qpasses import Pass, PassManager, PassResult, parse_pipeline, print_pipeline, register
from qpasses.core.instruments import DumpAfter, Reproducer, TimePasses, VerifyEach
from qpasses.core.pipeline import Pipeline, make_pass
from qpasses.core.registry import all_passes, unregister
from qpasses.errors import PassFailure, PipelineError, PreconditionError
from qpasses.ir.model import load
from qpasses.testing import model_from_text

TINY = """
agraph (float[2, 3] x) => (float[2, 3] y) {
    r = Relu(x)
    y = Neg(r)
}
"""


@pytest.fixture
def toy_passes():
    @register
    class Mark(Pass):
        """Adds a fact and counts."""
        name = "test-mark"
        establishes: ClassVar = frozenset({"marked"})
        level: int = 1
        ratio: float = 0.5
        label: str = "x"
        flag: bool = False

        def run(self, model, ctx):
            return PassResult(model, False, {"level": self.level})

    @register
    class NeedsMark(Pass):
        """Requires the mark."""
        name = "test-needs-mark"
        requires: ClassVar = frozenset({"marked"})

        def run(self, model, ctx):
            return PassResult(model, False)

    @register
    class Boom(Pass):
        """Always fails."""
        name = "test-boom"

        def run(self, model, ctx):
            model.graph.nodes[0].op = "Broken"
            raise ZeroDivisionError("boom")

    yield
    for name in ("test-mark", "test-needs-mark", "test-boom"):
        unregister(name)


@pytest.mark.parametrize("text", [
    "test-mark",
    "test-mark{level=3,ratio=99.99}",
    "test-mark{ratio=0.25,level=1},test-needs-mark",
    "test-mark{flag=true,label=abc}",
])
def test_pipeline_text_round_trips(toy_passes, text):
    assert print_pipeline(parse_pipeline(text)) == text


def test_option_values_are_typed(toy_passes):
    (p,) = parse_pipeline("test-mark{level=3,ratio=1e-3,flag=yes}")
    assert (p.level, p.ratio, p.flag) == (3, 0.001, True)


@pytest.mark.parametrize("text, message", [
    ("no-such-pass", "unknown pass 'no-such-pass'"),
    ("test-mrk", "did you mean 'test-mark'"),
    ("test-mark{level=abc}", "'abc' is not a valid int"),
    ("test-mark{levl=3}", "did you mean 'level'"),
    ("test-mark{level}", "needs key=value"),
    ("test-mark{level=3", "unclosed"),
    ("", "empty pipeline"),
    ("test-mark,,test-mark", "missing pass name"),
])
def test_bad_pipeline_text(toy_passes, text, message):
    with pytest.raises(PipelineError, match=message.replace("(", r"\(")):
        parse_pipeline(text)


@pytest.mark.parametrize("text", [
    'select-by-snr{then="compute-qparams,fix-bias-scales{enabled=false},insert-qdq"}',
    'select-by-snr{then="round-weights{then=\\"fix-bias-scales,insert-qdq\\"},insert-qdq"}',
    "select-by-snr{then=insert-qdq}",
])
def test_a_nested_pipeline_is_an_object_printed_as_its_text(text):
    (p,) = parse_pipeline(text)
    assert isinstance(p.then, Pipeline) and all(isinstance(q, Pass) for q in p.then)
    assert print_pipeline([p]) == text
    assert Pipeline.parse(str(p.then)) == p.then


def test_a_nested_pipeline_splits_after_a_pass():
    (p,) = parse_pipeline('select-by-snr{then="compute-qparams,fix-bias-scales{enabled=false},insert-qdq"}')
    first, rest = p.then.split_after("fix-bias-scales")
    assert (str(first), str(rest)) == ("compute-qparams,fix-bias-scales{enabled=false}", "insert-qdq")
    assert rest.passes[0] is p.then.passes[2]
    first, rest = p.then.split_after("calibrate")   # absent: everything runs after the cut
    assert not first and rest == p.then
    assert str(first + rest + [make_pass("cleanup")]) == str(p.then) + ",cleanup"


def test_a_nested_pipeline_option_keeps_its_default_text_and_takes_text_from_python():
    p = make_pass("select-by-snr")
    assert p.text() == "select-by-snr"
    assert str(p.then) == "compute-qparams,fix-bias-scales,insert-qdq,insert-converts"
    assert type(p)(then="insert-qdq").then == Pipeline.parse("insert-qdq")
    assert make_pass("select-by-snr", then="insert-qdq").text() == "select-by-snr{then=insert-qdq}"


def test_requires_names_missing_fact_and_establisher(toy_passes):
    model = model_from_text(TINY)
    with pytest.raises(PreconditionError, match="requires fact 'marked': run 'test-mark' before it"):
        PassManager("test-needs-mark").run(model)
    records = PassManager("test-mark,test-needs-mark").run(model)
    assert [r.name for r in records] == ["test-mark", "test-needs-mark"]
    assert "marked" in model.facts


def test_duplicate_registration_is_an_error(toy_passes):
    class Other(Pass):
        """Another pass with a taken name."""
        name = "test-mark"

    with pytest.raises(ValueError, match="registered twice"):
        register(Other)


def test_registry_rejects_bad_names():
    class Bad(Pass):
        """Snake case name."""
        name = "bad_name"

    with pytest.raises(ValueError, match="kebab-case"):
        register(Bad)


def test_internal_failure_names_pass_and_writes_reproducer(toy_passes, tmp_path):
    model = model_from_text(TINY)
    repro = tmp_path / "repro"
    with pytest.raises(PassFailure, match="pass 'test-boom' failed: ZeroDivisionError: boom .*before it: test-mark"):
        PassManager("test-mark,test-boom,test-mark{level=2}", [Reproducer(repro)]).run(model)
    assert (repro / "pipeline.txt").read_text().strip() == "test-boom,test-mark{level=2}"
    saved = load(repro / "input.onnx")
    assert [n.op for n in saved.graph.nodes] == ["Relu", "Neg"]  # the model before the failing pass


def test_instruments_time_verify_dump(toy_passes, tmp_path):
    model = model_from_text(TINY)
    timer = TimePasses()
    PassManager("test-mark,test-mark{level=2}", [timer, VerifyEach("ort"), DumpAfter(tmp_path)]).run(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["001_test-mark.onnx", "002_test-mark.onnx"]
    table = timer.table()
    assert "test-mark{level=2}" in table and "total" in table


def test_builtin_passes_are_registered():
    names = set(all_passes())
    assert {"fold-constants", "cleanup"} <= names
    for cls in all_passes().values():
        assert cls.summary() and cls.name


@pytest.mark.parametrize("bound", ["0", "-1"])
def test_option_below_its_bound_is_refused(bound):
    with pytest.raises(PipelineError, match="'bound' of pass 'protect-pair-sums': .* is not above 0"):
        parse_pipeline(f"protect-pair-sums{{bound={bound}}}")
    with pytest.raises(PipelineError, match="is not above 0"):
        make_pass("protect-pair-sums", bound=float(bound))
    assert make_pass("protect-pair-sums", bound=0.5).bound == 0.5


def test_passes_run_numpy_blas_on_one_thread():
    """A second BLAS thread only waits on busy cores (executors.threads.serial_blas): run_pipeline
    limits it for the whole run and gives the limit back after."""
    from threadpoolctl import threadpool_info

    from qpasses.api import run_pipeline

    def blas_threads():
        return {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}

    seen = []

    @register
    class Probe(Pass):
        """Records the BLAS threads it runs with."""
        name = "test-blas-probe"

        def run(self, model, ctx):
            seen.append(blas_threads())
            return PassResult(model, False)

    before = blas_threads()
    try:
        run_pipeline(model_from_text(TINY), "test-blas-probe")
    finally:
        unregister("test-blas-probe")
    assert seen == [{1}] or not before   # no BLAS numpy build: nothing to limit
    assert blas_threads() == before
