"""Every code block of README.md and docs/ runs or is checked as written.

- ```python blocks run, each in its own subprocess (a block may register a pass), in a fresh folder
  holding the bundled example as `qpasses example` writes it: model.onnx, calib.npz, eval.npz. So an
  example names those files and nothing else.
- ```bash blocks: every `qpasses ...` command in them parses with the CLI's argparse parser
  (synopsis notation is read as written: `[...]` optional, `a|b` the first choice); README's first
  block is exactly the two setup lines (install and run the example; run the tests).
- ```json and ```yaml blocks are configs: each loads with qpasses.load_config.
- ```text blocks show output or layouts and are not run; a block without one of these tags fails.
- Relative links point at files that exist, and docs/architecture.md's package layout names every
  top-level module and sub-package of qpasses/ and nothing else.
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qpasses.cli import _parser
from qpasses.cli.examples import write_example
from qpasses.config.quant_config import load_config
from tests.kits import ROOT

README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LANGUAGES = ("python", "bash", "json", "yaml", "text")
SETUP = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && qpasses example demo"
    " && qpasses run demo/model.onnx -o demo/model.qdq.onnx --calib demo/calib.npz --eval demo/eval.npz"
    " --time-passes",
    ". .venv/bin/activate && python -m pytest",
]


def fenced(path: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of a markdown file."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def blocks(lang: str, paths=DOCS) -> list[tuple[str, str]]:
    """(where, text) of every ``lang`` block of ``paths``; where is 'file:n' (n counts that file's blocks)."""
    out = []
    for path in paths:
        found = [text for kind, text in fenced(path) if kind == lang]
        out += [(f"{path.relative_to(ROOT)}:{i}", text) for i, text in enumerate(found)]
    return out


def qpasses_commands(block: str) -> list[list[str]]:
    """The `qpasses` commands of a bash block (continuation lines joined, comments dropped)."""
    lines: list[str] = []
    for line in block.splitlines():
        if lines and (line[:1].isspace() or lines[-1].endswith("\\")):
            lines[-1] = lines[-1].rstrip("\\") + " " + line.strip()
        else:
            lines.append(line)
    commands = []
    for line in lines:
        command: list[str] = []
        for token in shlex.split(line, comments=True) + [";"]:
            if token in ("&&", "||", "|", ";"):
                if command[:1] == ["qpasses"]:
                    commands.append(command[1:])
                command = []
            else:
                command.append(token)
    return commands


def _synopsis_to_argv(args: list[str]) -> list[str]:
    out = []
    for token in args:
        token = token.removeprefix("[").removesuffix("]")
        if "|" in token and not token.startswith("-"):
            token = token.split("|")[0]
        out.append(token)
    return out


@pytest.fixture(scope="module")
def example_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme_example")
    write_example(folder)
    return folder


PYTHON = blocks("python")


@pytest.mark.parametrize("where,code", PYTHON, ids=[w for w, _ in PYTHON])
def test_python_block_runs(where, code, example_folder, tmp_path):
    for path in example_folder.iterdir():
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / "doc_block.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT), QPASSES_NO_PROGRESS="1")
    done = subprocess.run([sys.executable, "doc_block.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"python block {where} failed:\n{code}\n{done.stderr[-3000:]}"


def test_readme_has_python_and_bash_blocks():
    assert blocks("python", [README]) and blocks("bash", [README])


def test_readme_stays_short():
    """What it is, the set-up, the commands and pointers; the reference lives in docs/."""
    assert len(README.read_text().splitlines()) <= 200


def test_first_block_is_the_setup():
    first = FENCE.search(README.read_text())
    assert first.group(1) == "bash" and first.group(2).splitlines() == SETUP


COMMANDS = [(where, c) for where, block in blocks("bash") for c in qpasses_commands(block)]


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w} {' '.join(c)}" for w, c in COMMANDS])
def test_bash_qpasses_command_parses(where, argv, capsys):
    try:
        args = _parser().parse_args(_synopsis_to_argv(argv))
    except SystemExit:
        pytest.fail(f"{where}: command does not parse: qpasses {shlex.join(argv)}\n{capsys.readouterr().err}")
    assert args.command


CONFIGS = [(w, "json", t) for w, t in blocks("json")] + [(w, "yaml", t) for w, t in blocks("yaml")]


@pytest.mark.parametrize("where,kind,text", CONFIGS, ids=[w for w, _, _ in CONFIGS])
def test_config_block_loads(where, kind, text):
    data = json.loads(text) if kind == "json" else yaml.safe_load(text)
    assert isinstance(data, dict) and data, where
    load_config(data)   # a ConfigError names every problem


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_block_has_a_known_language(path):
    unknown = [kind or "(none)" for kind, _ in fenced(path) if kind not in LANGUAGES]
    assert not unknown, f"{path.name}: blocks tagged {unknown}; use one of {LANGUAGES}"


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_exist(path):
    text = FENCE.sub("", path.read_text())
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (path.parent / t).exists()]
    assert not missing, f"{path.name} links to missing files: {missing}"


def test_architecture_layout_matches_the_tree():
    layout = next(text for kind, text in fenced(ROOT / "docs" / "architecture.md")
                  if kind == "text" and "qpasses/__init__.py" in text)
    listed = {line.split()[0].rstrip("/") for line in layout.splitlines() if line.startswith("qpasses/")}
    package = ROOT / "qpasses"
    on_disk = {f"qpasses/{p.name}" for p in package.glob("*.py")} | {
        f"qpasses/{p.name}" for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert not on_disk - listed, f"add a line for each to docs/architecture.md's layout: {sorted(on_disk - listed)}"
    assert not listed - on_disk, f"docs/architecture.md's layout names what is gone: {sorted(listed - on_disk)}"


def test_synopsis_reading():
    block = "qpasses run m.onnx -o o.onnx [--verify-each a|b]\n    [--quiet]  # note\nqpasses passes | head -1\n"
    assert qpasses_commands(block) == [["run", "m.onnx", "-o", "o.onnx", "[--verify-each", "a|b]", "[--quiet]"],
                                       ["passes"]]
    assert _synopsis_to_argv(["[--verify-each", "a|b]"]) == ["--verify-each", "a"]
