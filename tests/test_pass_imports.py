"""Passes never import another pass module: what two passes share is an analysis or a helper below both."""
import ast
from pathlib import Path

import qpasses.passes

PASSES = Path(qpasses.passes.__file__).parent
PASS_MODULES = sorted(p.stem for p in PASSES.glob("*.py") if p.stem != "__init__")


def pass_imports(path: Path) -> list[str]:
    """The pass modules ``path`` imports (``from . import X`` of the package itself is allowed)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:            # from .x import ... / from . import x
                targets = [module] if module else [a.name for a in node.names]
            elif node.level == 2 and module.startswith("passes"):   # from ..passes.x import ...
                rest = module[len("passes"):].lstrip(".")
                targets = [rest.split(".")[0]] if rest else [a.name for a in node.names]
            elif node.level == 0 and module.startswith("qpasses.passes"):
                rest = module[len("qpasses.passes"):].lstrip(".")
                targets = [rest.split(".")[0]] if rest else [a.name for a in node.names]
            else:
                continue
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[2] for a in node.names
                       if a.name.startswith("qpasses.passes.") and a.name.count(".") >= 2]
        else:
            continue
        found += [t for t in targets if t in PASS_MODULES]
    return found


def test_no_pass_module_imports_another():
    offenders = {p.stem: imports for p in sorted(PASSES.glob("*.py")) if (imports := pass_imports(p))}
    assert offenders == {}, f"pass modules importing other pass modules (share an analysis instead): {offenders}"


def test_the_check_sees_every_import_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from .compute_qparams import x\nfrom qpasses.passes.calibrate import y\n"
                      "from ..passes.cleanup import z\nfrom . import insert_qdq, CONV_RELU_EXAMPLE\n"
                      "from ..passes import fold_constants\nimport qpasses.passes.fold_batchnorm\n"
                      "from ..analysis.ranges import entry_range\n")
    assert pass_imports(sample) == ["compute_qparams", "calibrate", "cleanup", "insert_qdq",
                                    "fold_constants", "fold_batchnorm"]
