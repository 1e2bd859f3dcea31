"""passes.md is generated from the registry (tools/gen_passes_md.py) and must be current."""
import importlib.util
from typing import ClassVar

import pytest

from qpasses import Pass, PassResult, register
from qpasses.core.registry import unregister
from tests.kits import ROOT


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_passes_md", ROOT / "tools" / "gen_passes_md.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_passes_md_is_current(gen):
    path = ROOT / "passes.md"
    current = path.read_text() if path.exists() else ""
    assert gen.render() == current, "passes.md is stale: run python tools/gen_passes_md.py"


def test_order_follows_default_pipeline(gen):
    names = [cls.name for cls in gen.ordered_passes()]
    assert names[:3] == ["fold-constants", "fold-batchnorm", "cleanup"]
    assert len(names) == len(set(names))


def test_pass_without_example_or_with_broken_example(gen):
    @register
    class NoExample(Pass):
        """A pass without an example.

        Reads: nothing. Writes: nothing.
        """
        name: ClassVar[str] = "test-no-example"
        level: int = 3

        def run(self, model, ctx):
            return PassResult(model, False)

    @register
    class BrokenExample(Pass):
        """A pass whose example fails."""
        name: ClassVar[str] = "test-broken-example"
        example: ClassVar[str] = "g (float[2] x) => (float[2] y) { y = Relu (x) }"

        def run(self, model, ctx):
            raise RuntimeError("boom")

    try:
        text = gen.section(NoExample)
        assert "## `test-no-example`" in text and "| `level` | `3` |" in text
        assert "**Reads:**" in text and "### Example" not in text
        broken = gen.section(BrokenExample)
        assert "The example did not run" in broken and "boom" in broken
    finally:
        unregister("test-no-example")
        unregister("test-broken-example")
