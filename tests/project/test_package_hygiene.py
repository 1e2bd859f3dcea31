"""Package hygiene: every module imports, none imports a test dependency, and a module stays
readable in one sitting.

Hypothesis strategies and fuzz generators live under tests/ (tests/kits/fuzzgen). The size guard is
soft: where code belongs is decided by the layers (test_layering.py), and a module over MAX_LINES
stays whole only with the reason ALLOWED_LONG gives.
"""
import ast
import importlib
from pathlib import Path

import pytest

from tests.kits import ROOT

PACKAGE = ROOT / "qpasses"
TEST_ONLY = frozenset({"hypothesis", "pytest"})
MAX_LINES = 600

# module (relative to qpasses/) -> why it may be longer than MAX_LINES (one line)
ALLOWED_LONG = {
    "ir/model.py": "the gs seam: QModel with load/save/copy/export must stay in one module (DESIGN.md section 1)",
}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _imported(tree: ast.AST) -> set[str]:
    """Top-level package names imported anywhere in the module (also inside functions)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", [p for p in _modules() if p.name != "__main__.py"],   # __main__ runs the CLI
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_imports(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_test_dependency_is_imported(path):
    found = _imported(ast.parse(path.read_text(), filename=str(path))) & TEST_ONLY
    assert not found, (f"qpasses/{path.relative_to(PACKAGE)} imports {', '.join(sorted(found))}: "
                       f"test-only code belongs under tests/")


def test_modules_stay_under_the_line_limit():
    lines = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in _modules()}
    long = {name: n for name, n in lines.items() if n > MAX_LINES and name not in ALLOWED_LONG}
    assert not long, (f"modules over {MAX_LINES} lines (split them by concern, or list them in "
                      f"ALLOWED_LONG with a reason): {long}")
    stale = {name: lines.get(name) for name in ALLOWED_LONG if lines.get(name, 0) <= MAX_LINES}
    assert not stale, f"ALLOWED_LONG entries now missing or within {MAX_LINES} lines (remove them): {stale}"


def test_allowed_long_modules_give_a_one_line_reason():
    for name, reason in ALLOWED_LONG.items():
        assert reason.strip() and "\n" not in reason, name


def test_the_checks_catch_what_they_look_for():
    assert _imported(ast.parse("def f():\n    from hypothesis import strategies as st\n")) == {"hypothesis"}
    assert _imported(ast.parse("import pytest, numpy\nfrom . import x\n")) == {"pytest", "numpy"}
