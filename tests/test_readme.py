"""Every README code block runs as written.

- ```python blocks run, each in its own subprocess (a block may register a pass), in a fresh folder
  holding the bundled example as `qpasses example` writes it: model.onnx, calib.npz, eval.npz. So a
  README example names those files and nothing else.
- ```bash blocks: every `qpasses ...` command in them parses with the CLI's argparse parser
  (synopsis notation is read as written: `[...]` optional, `a|b` the first choice); the first
  block is exactly the two setup lines (install and run the example; run the tests).
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qpasses.cli import _parser
from qpasses.examples import write_example

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SETUP = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && qpasses example demo"
    " && qpasses run demo/model.onnx -o demo/model.qdq.onnx --calib demo/calib.npz --eval demo/eval.npz"
    " --time-passes",
    ". .venv/bin/activate && python -m pytest",
]


def blocks(lang: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer((ROOT / "README.md").read_text()) if m.group(1) == lang]


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


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs(index, example_folder, tmp_path):
    code = blocks("python")[index]
    for path in example_folder.iterdir():
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / "readme_block.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT), QPASSES_NO_PROGRESS="1")
    done = subprocess.run([sys.executable, "readme_block.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"README python block {index} failed:\n{code}\n{done.stderr[-3000:]}"


def test_readme_has_python_and_bash_blocks():
    assert blocks("python") and blocks("bash")


def test_first_block_is_the_setup():
    first = FENCE.search((ROOT / "README.md").read_text())
    assert first.group(1) == "bash" and first.group(2).splitlines() == SETUP


@pytest.mark.parametrize("argv", [c for block in blocks("bash") for c in qpasses_commands(block)], ids=" ".join)
def test_bash_qpasses_command_parses(argv, capsys):
    try:
        args = _parser().parse_args(_synopsis_to_argv(argv))
    except SystemExit:
        pytest.fail(f"README command does not parse: qpasses {shlex.join(argv)}\n{capsys.readouterr().err}")
    assert args.command


def test_synopsis_reading():
    block = "qpasses run m.onnx -o o.onnx [--verify-each a|b]\n    [--quiet]  # note\nqpasses passes | head -1\n"
    assert qpasses_commands(block) == [["run", "m.onnx", "-o", "o.onnx", "[--verify-each", "a|b]", "[--quiet]"],
                                       ["passes"]]
    assert _synopsis_to_argv(["[--verify-each", "a|b]"]) == ["--verify-each", "a"]
