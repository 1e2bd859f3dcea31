"""Shared pieces of the 'nothing lost' suites (tests/integration/test_nothing_lost_*.py, issue 14).

Every failure case runs the CLI in-process (``qpasses.cli.main``) in a workspace folder and checks
the README's promises at once (``assert_refused``):

- the exit code (2 user error, 1 internal error);
- exactly one stderr line, ``qpasses: error: ...`` / ``qpasses: internal error: ...``, naming the
  problem (a fragment of it);
- the workspace is as it was: no output, report, dump or reproducer file, no temporary folder,
  and every file byte-identical with the same mtime (symlinks and FIFOs unchanged, never opened).

Inputs are tiny: an MLP or a two-Conv model from ONNX text, 8 calibration samples.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qpasses.cli import main
from qpasses.testing import parse

MLP = """
mlp (float[1,4] x) => (float[1,4] y) <float[4,4] w = {0.5,-0.25,0.125,1,-1,0.75,0.5,-0.5,0.25,0.5,-0.75,1,
      -0.125,0.25,0.5,-1}, float[4] b = {0.1,-0.2,0.3,-0.1}> {
    mm = MatMul (x, w)
    add = Add (mm, b)
    y = Relu (add)
}"""

CONVS = """
convs (float[1,3,8,8] x) => (float[1,4,4,4] y) <float[4,3,3,3] w1 = {W1}, float[4] b1 = {B}, float[4,4,3,3] w2 = {W2},
      float[4] b2 = {B}> {
    c1 = Conv <pads = [1,1,1,1]> (x, w1, b1)
    r1 = Relu (c1)
    c2 = Conv <pads = [1,1,1,1]> (r1, w2, b2)
    r2 = Relu (c2)
    y = MaxPool <kernel_shape = [2,2], strides = [2,2]> (r2)
}"""


def _numbers(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return ",".join(f"{v:.4f}" for v in rng.normal(0, 0.3, n))


def mlp(opset: int = 17) -> onnx.ModelProto:
    return parse(MLP, opset=opset)


def convs(opset: int = 17) -> onnx.ModelProto:
    text = CONVS.replace("{W1}", "{" + _numbers(108, 1) + "}").replace("{W2}", "{" + _numbers(144, 2) + "}")
    return parse(text.replace("{B}", "{0.1,-0.1,0.05,0.2}"), opset=opset)


def feeds(model: onnx.ModelProto, n: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` samples per graph input (arrays of shape (n, *input shape); bool inputs alternate)."""
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        dims = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == TensorProto.BOOL:
            out[vi.name] = (np.arange(n) % 2 == 0).reshape((n,) + (1,) * len(dims)) & np.ones(dims, bool)
        else:
            out[vi.name] = rng.standard_normal((n, *dims)).astype(np.float32)
    return out


def write_model(path: Path, model: onnx.ModelProto | bytes) -> Path:
    path.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    return path


def write_npz(path: Path, arrays: dict) -> Path:
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def with_initializer(model: onnx.ModelProto, name: str, fn) -> onnx.ModelProto:
    """A copy of ``model`` whose initializer ``name`` is ``fn(array)`` (or ``fn(tensor)`` edits it)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i, t in enumerate(out.graph.initializer):
        if t.name == name:
            new = fn(numpy_helper.to_array(t).copy())
            if isinstance(new, np.ndarray):
                out.graph.initializer[i].CopyFrom(numpy_helper.from_array(new, name))
    return out


class Workspace:
    """A folder with the usual inputs: ``model.onnx``, ``calib.npz``, ``eval.npz``, ``cfg.json``;
    outputs go to ``out/`` (``q.onnx``, ``r.json``)."""

    def __init__(self, root: Path, model: onnx.ModelProto | None = None, *, n: int = 8):
        self.root = root
        self.model_proto = model if model is not None else mlp()
        self.model = write_model(root / "model.onnx", self.model_proto)
        self.calib = write_npz(root / "calib.npz", feeds(self.model_proto, n))
        self.eval = write_npz(root / "eval.npz", feeds(self.model_proto, n, seed=1))
        self.config = root / "cfg.json"
        self.config.write_text("{}\n")
        self.out_dir = root / "out"
        self.out_dir.mkdir()
        self.out = self.out_dir / "q.onnx"
        self.report = self.out_dir / "r.json"

    def run(self, *extra, model=None, out=None, calib=True) -> list[str]:
        args = ["run", str(model or self.model), "-o", str(out or self.out)]
        if calib:
            args += ["--calib", str(self.calib)]
        return args + [str(a) for a in extra]

    def __truediv__(self, name) -> Path:
        return self.root / name


def snapshot(root: Path) -> dict:
    """Everything under ``root`` (not following symlinks, never opening FIFOs): per path its type,
    and for files their bytes' digest and mtime; folders by type only (their mtime changes when a
    temporary entry comes and goes)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[p] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[p] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns)
            elif stat.S_ISDIR(st.st_mode):
                out[p] = ("dir",)
            else:
                out[p] = ("other", stat.S_IFMT(st.st_mode))
    return out


def run_cli(capsys, args) -> tuple[int, list[str], str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines(), captured.out


def assert_refused(capsys, root: Path, args, fragment: str, code: int = 2, *, before: dict | None = None):
    """Run ``args``: exit ``code``, one stderr line containing ``fragment``, ``root`` unchanged."""
    before = snapshot(root) if before is None else before
    got, lines, _ = run_cli(capsys, args)
    prefix = "qpasses: error: " if code == 2 else "qpasses: internal error: " if code == 1 else "qpasses: "
    assert got == code, (got, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith(prefix), lines
    assert fragment in lines[0], (fragment, lines[0])
    after = snapshot(root)
    added = sorted(str(p) for p in set(after) - set(before))
    changed = sorted(str(p) for p in before if after.get(p) != before[p])
    assert not added, f"left behind: {added}"
    assert not changed, f"changed or removed: {changed}"
    return lines[0]


def strict_loads(text: str):
    """json.loads that refuses NaN and Infinity (as strict parsers do)."""
    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def make_fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def char_device(path: Path) -> Path:
    """A character device at ``path`` that reads as empty: a node like /dev/null where mknod is
    allowed (root), else a symlink to /dev/null. Tests never name /dev/null itself: if a
    regression wrote to it, only this node or link would be replaced, never the system's device."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError):
        path.symlink_to("/dev/null")
    return path


def external(model: onnx.ModelProto, folder: Path, name: str = "model.onnx", location: str = "weights.bin") -> Path:
    """Save ``model`` in ``folder`` with every initializer in one external data file."""
    model = with_raw_data(model)
    onnx.save_model(model, str(folder / name), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0)
    return folder / name


def with_raw_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose initializers hold raw bytes (what external data is made from)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t), t.name))
    return out


def set_external(model: onnx.ModelProto, name: str, **entries) -> onnx.ModelProto:
    """A copy whose initializer ``name`` points at external data with the given entries."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if t.name == name:
            t.ClearField("raw_data")
            t.ClearField("float_data")
            t.data_location = TensorProto.EXTERNAL
            del t.external_data[:]
            for key, value in entries.items():
                e = t.external_data.add()
                e.key, e.value = key, str(value)
    return out


__all__ = ["MLP", "CONVS", "Workspace", "assert_refused", "convs", "external", "feeds", "helper",
           "char_device", "make_fifo", "mlp", "run_cli", "set_external", "snapshot", "strict_loads", "with_initializer",
           "write_model", "write_npz"]
