"""The package's layers import in one direction: no import cycle between modules (imports inside
functions count: a lazy import is still a dependency), the framework imports no pass, command or
report, the IR imports nothing built on it, and analyses import nothing from reporting. The top of
qpasses/ holds the public entry points only; the rest sits in the sub-package of its layer."""
import ast
from pathlib import Path

import networkx as nx
import pytest

from tests.kits import ROOT

PACKAGE = ROOT / "qpasses"

FRAMEWORK = ("qpasses.core", "qpasses.errors")
COMMANDS_AND_REPORTS = ("qpasses.passes", "qpasses.cli", "qpasses.report", "qpasses.evaluation.summary")
REPORTING = ("qpasses.report", "qpasses.evaluation.summary", "qpasses.cli")
IR = ("qpasses.ir",)
# the IR is read by every layer; it needs only the quantized types the table it stores names (quant.qtypes)
ABOVE_THE_IR = ("qpasses.core", "qpasses.passes", "qpasses.cli", "qpasses.report", "qpasses.evaluation",
                "qpasses.config", "qpasses.calibration", "qpasses.analysis", "qpasses.executors", "qpasses.api",
                "qpasses.weightonly", "qpasses.qoperator")
MAX_TOP_MODULES = 10   # __init__, __main__, api, errors, testing: the public entry points
# the registry finds the built-in passes by importing their package (discovery, not a dependency on one)
ALLOWED = {("qpasses.core.registry", "qpasses.passes")}


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Module -> qpasses modules it imports (anywhere in its text)."""
    paths = {_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    graph = nx.DiGraph()
    for name, path in paths.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    graph.add_edge(name, full if full in paths else target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    graph.add_edge(name, alias.name)
    graph.remove_nodes_from([n for n in list(graph) if n not in paths])
    graph.remove_edges_from(nx.selfloop_edges(graph))
    return graph


GRAPH = import_graph()


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_graph_sees_known_imports():
    assert GRAPH.has_edge("qpasses.core.pipeline", "qpasses.core.registry")
    assert GRAPH.has_edge("qpasses.passes.calibrate", "qpasses.calibration.ranges")


def test_no_import_cycle():
    cycles = [sorted(c) for c in nx.strongly_connected_components(GRAPH) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("module", [m for m in sorted(GRAPH) if _under(m, FRAMEWORK)])
def test_framework_imports_no_pass_command_or_report(module):
    bad = sorted(t for t in GRAPH.successors(module)
                 if _under(t, COMMANDS_AND_REPORTS) and (module, t) not in ALLOWED)
    assert not bad, f"{module} (framework) imports {bad}"


@pytest.mark.parametrize("module", [m for m in sorted(GRAPH) if _under(m, IR)])
def test_the_ir_imports_nothing_built_on_it(module):
    bad = sorted(t for t in GRAPH.successors(module) if _under(t, ABOVE_THE_IR))
    assert not bad, f"{module} (IR) imports {bad}"


@pytest.mark.parametrize("module", [m for m in sorted(GRAPH) if _under(m, ("qpasses.analysis",))])
def test_analyses_import_no_reporting_and_no_pass(module):
    bad = sorted(t for t in GRAPH.successors(module) if _under(t, REPORTING + ("qpasses.passes",)))
    assert not bad, f"{module} (analysis) imports {bad}"


def test_a_cycle_would_be_found():
    graph = GRAPH.copy()
    graph.add_edge("qpasses.ir.model", "qpasses.core.pipeline")
    assert any(len(c) > 1 for c in nx.strongly_connected_components(graph))


def test_the_top_level_holds_few_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert {"__init__.py", "api.py", "errors.py"} <= set(top)
    assert len(top) <= MAX_TOP_MODULES, (f"{len(top)} modules at the top of qpasses/ (at most {MAX_TOP_MODULES}): "
                                         f"move each into the sub-package of its layer: {top}")
