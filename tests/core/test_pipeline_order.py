"""`qpasses passes` and passes.md list passes in pipeline order: the default quantize pipeline's, then the rest."""
import importlib.util
from typing import ClassVar

from qpasses import Pass, PassResult, register
from qpasses.cli import main
from qpasses.core.pipeline import default_pipeline, in_pipeline_order, parse_pipeline
from qpasses.core.registry import all_passes, unregister
from tests.kits import ROOT


def _default_names() -> list[str]:
    return list(dict.fromkeys(p.name for p in parse_pipeline(default_pipeline(True))))


def test_default_pipeline_first_then_the_rest_by_name():
    @register
    class AaaOrderProbe(Pass):
        """A pass outside the default pipeline whose name sorts first."""
        name: ClassVar[str] = "aaa-order-probe"

        def run(self, model, ctx=None):
            return PassResult(model, False)

    try:
        names = [cls.name for cls in in_pipeline_order()]
        default = _default_names()
        assert names[:len(default)] == default
        rest = names[len(default):]
        assert "aaa-order-probe" in rest and rest == sorted(rest)
        assert sorted(names) == list(all_passes()) == sorted(all_passes())  # all_passes stays by name
    finally:
        unregister("aaa-order-probe")


def test_cli_lists_passes_in_pipeline_order(capsys):
    assert main(["passes"]) == 0
    headers = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert headers == [cls.name for cls in in_pipeline_order()]
    assert headers[:3] == ["fold-constants", "fold-batchnorm", "cleanup"]


def test_passes_md_uses_the_same_order():
    spec = importlib.util.spec_from_file_location("gen_passes_md", ROOT / "tools" / "gen_passes_md.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.ordered_passes() == in_pipeline_order()
