"""A reader that closes stdout early (`qpasses passes | head -1`) ends the command quietly."""
import subprocess
import sys

import pytest

from qpasses.cli import main
from tests.kits import ROOT


def _closed_early(*args) -> tuple[int, str]:
    """Run ``python -m qpasses ARGS`` with its stdout pipe closed before it writes anything."""
    proc = subprocess.Popen([sys.executable, "-m", "qpasses", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the child is still importing: its first write meets a closed pipe
    err = proc.stderr.read()
    return proc.wait(timeout=120), err


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipe")
    assert main(["example", str(folder)]) == 0
    out = folder / "model.qdq.onnx"
    assert main(["run", str(folder / "model.onnx"), "-o", str(out), "--calib", str(folder / "calib.npz"),
                 "--quiet"]) == 0
    return out


@pytest.mark.parametrize("args", [("passes",), ("--help",), ("explain", "QDQ")])
def test_closed_stdout_exits_quietly(args, quantized):
    args = [quantized if a == "QDQ" else a for a in args]
    code, err = _closed_early(*args)
    assert (code, err) == (0, "")


def test_head_reads_the_first_line(quantized):
    shell = f"set -o pipefail; '{sys.executable}' -m qpasses explain '{quantized}' | head -1"
    done = subprocess.run(["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    assert len(done.stdout.splitlines()) == 1
