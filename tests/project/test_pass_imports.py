"""Passes never import another pass module: what two passes share is an analysis or a helper below both.
A pass with machinery of its own is a package (passes/<name>/): its modules import each other freely."""
import ast
from pathlib import Path

import qpasses.passes

PASSES = Path(qpasses.passes.__file__).parent
PASS_MODULES = sorted({p.stem for p in PASSES.glob("*.py") if p.stem != "__init__"}
                      | {p.name for p in PASSES.iterdir() if (p / "__init__.py").exists()})


def pass_imports(path: Path, package: str = "qpasses.passes") -> list[str]:
    """The passes ``path`` (a module of ``package``) imports (``from . import X`` of qpasses.passes
    itself is allowed)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "qpasses.passes":
                targets = [a.name for a in node.names]
            elif base.startswith("qpasses.passes."):
                targets = [base.split(".")[2]]
            else:
                continue
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[2] for a in node.names if a.name.startswith("qpasses.passes.")]
        else:
            continue
        found += [t for t in targets if t in PASS_MODULES]
    return found


def _pass_files():
    """(the pass, its package, path) for every module under qpasses/passes/, a pass package's own included."""
    for path in sorted(PASSES.rglob("*.py")):
        rel = path.relative_to(PASSES)
        if "__pycache__" not in rel.parts and rel != Path("__init__.py"):
            yield rel.parts[0].removesuffix(".py"), ".".join(["qpasses", "passes", *rel.parts[:-1]]), path


def test_no_pass_module_imports_another():
    offenders = {str(path.relative_to(PASSES)): imports for own, package, path in _pass_files()
                 if (imports := [t for t in pass_imports(path, package) if t != own])}
    assert offenders == {}, f"pass modules importing other pass modules (share an analysis instead): {offenders}"


def test_pass_packages_are_seen():
    assert "search_precision" in PASS_MODULES
    assert any(path.name == "checks.py" for _, _, path in _pass_files())


def test_the_check_sees_every_import_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from .compute_qparams import x\nfrom qpasses.passes.calibrate import y\n"
                      "from ..passes.cleanup import z\nfrom . import insert_qdq, CONV_RELU_EXAMPLE\n"
                      "from ..passes import fold_constants\nimport qpasses.passes.fold_batchnorm\n"
                      "from ..analysis.ranges import entry_range\n")
    assert pass_imports(sample) == ["compute_qparams", "calibrate", "cleanup", "insert_qdq",
                                    "fold_constants", "fold_batchnorm"]
    inside = tmp_path / "inside.py"   # a module of a pass package
    inside.write_text("from .checks import Checks\nfrom ..calibrate import y\nfrom ...analysis.walks import w\n")
    assert pass_imports(inside, "qpasses.passes.search_precision") == ["search_precision", "calibrate"]
