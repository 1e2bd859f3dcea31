"""Nothing lost (issue 14), class 2: all or nothing.

The model, the report and the dumps are committed only once every step succeeded (the output
loaded in onnxruntime at its default optimization level, the SNR measured, the report written):
until then they are staged in temporary folders beside their targets. On any failure — in a pass,
after the pipeline, while committing, on SIGINT/SIGTERM/SIGHUP — none of them is left and files
that were already there are untouched, byte for byte and mtime. A failing pass with --reproducer
commits the reproducer (its purpose) and nothing else.
"""
from __future__ import annotations

import errno
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tests.kits.nothing_lost_kit import Workspace, assert_refused, convs, run_cli, snapshot, with_initializer



def _previous(ws: Workspace) -> None:
    """Outputs of an earlier run: they must survive every failed run untouched."""
    ws.out.write_bytes(b"previous model")
    ws.report.write_bytes(b'{"previous": "report"}')
    (ws.out_dir / "dumps").mkdir()
    (ws.out_dir / "dumps" / "001_fold-constants.onnx").write_bytes(b"previous dump")


def _all_outputs(ws: Workspace, *extra) -> list:
    return ws.run("--report", ws.report, "--dump-after", ws.out_dir / "dumps", *extra)


# -- failures after the pipeline ran --------------------------------------------------------------------
def _fail_float_overflow(ws, monkeypatch):
    """1e38 in a Conv weight: finite, but the float model's output overflows: no SNR."""
    model = with_initializer(convs(), "w1", lambda a: np.concatenate([np.full((1, *a.shape[1:]), 1e38), a[1:]])
                             .astype(np.float32))
    ws.model.write_bytes(model.SerializeToString())
    np.savez(ws.calib, x=np.random.default_rng(0).standard_normal((4, 1, 3, 8, 8)).astype(np.float32))
    return 2, "the float model's output 'y' holds"


def _deny_writes(monkeypatch, match, err=errno.EACCES, text="Permission denied"):
    import builtins

    real_open = builtins.open

    def open_(file, mode="r", *a, **k):
        if any(c in mode for c in "wax") and match(Path(str(file))):
            raise OSError(err, text, str(file))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", open_)


def _fail_report_read_only(ws, monkeypatch):
    _deny_writes(monkeypatch, lambda p: p.name == "r.json")
    return 2, "r.json: write failed (Permission denied)"


def _fail_report_disk_full(ws, monkeypatch):
    _deny_writes(monkeypatch, lambda p: p.name == "r.json", errno.ENOSPC, "No space left on device")
    return 2, "r.json: write failed (No space left on device)"


def _fail_model_disk_full(ws, monkeypatch):
    _deny_writes(monkeypatch, lambda p: p.name == "q.onnx", errno.ENOSPC, "No space left on device")
    return 2, "q.onnx: write failed (No space left on device)"


def _fail_ort_refuses(ws, monkeypatch):
    import qpasses.cli.outputs as outputs

    real = outputs._ort_load

    def refuse(path, *args):
        if ".qpasses-" in str(path):
            raise RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : a kernel is missing")
        return real(path, *args)

    monkeypatch.setattr(outputs, "_ort_load", refuse)
    return 1, "onnxruntime cannot load the output model (a kernel is missing); nothing was written"


def _fail_compare_crashes(ws, monkeypatch):
    import qpasses.evaluation.evaluate

    def boom(*a, **k):
        raise RuntimeError("compare broke")

    monkeypatch.setattr(qpasses.evaluation.evaluate, "compare", boom)
    return 1, "RuntimeError: compare broke (run with --traceback for details)"


def _fail_user_metric(ws, monkeypatch):
    (ws / "nl_metric_mod.py").write_text("def bad(f, q):\n    raise ValueError('metric exploded')\n")
    monkeypatch.syspath_prepend(str(ws.root))
    sys.modules.pop("nl_metric_mod", None)
    ws.extra = ["--metric", "nl_metric_mod:bad"]
    return 2, "metric exploded"


def _fail_summary(ws, monkeypatch):
    import qpasses.cli.run

    monkeypatch.setattr(qpasses.cli.run, "_EVAL_SAMPLES", "not a number")
    return 1, "internal error"


def _fail_late_signal(ws, monkeypatch):
    import qpasses.cli.outputs as outputs

    from qpasses.cli.process import Interrupted

    def stop(*a, **k):
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(outputs, "strict_json", stop)
    return 143, "interrupted (SIGTERM); nothing was written"


def _fail_late_sigint(ws, monkeypatch):
    import qpasses.cli.outputs as outputs

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs, "check_loads", stop)
    return 130, "interrupted (SIGINT)"


def _fail_pass_internal(ws, monkeypatch):
    from qpasses.passes.insert_qdq import InsertQDQ

    def broken(self, model, ctx):
        raise ValueError("boom\nsecond line")

    monkeypatch.setattr(InsertQDQ, "run", broken)
    return 1, "pass 'insert-qdq' failed: ValueError: boom\\nsecond line"


def _fail_pass_user_error(ws, monkeypatch):
    from qpasses.errors import ModelError
    from qpasses.passes.insert_converts import InsertConverts

    def refuse(self, model, ctx):
        raise ModelError("tensor 't': something the user must fix")

    monkeypatch.setattr(InsertConverts, "run", refuse)
    return 2, "something the user must fix"


def _fail_pass_interrupted(ws, monkeypatch):
    from qpasses.passes.calibrate import Calibrate

    def stop(self, model, ctx):
        raise KeyboardInterrupt

    monkeypatch.setattr(Calibrate, "run", stop)
    return 130, "interrupted (SIGINT)"


LATE = {"float model overflows": _fail_float_overflow, "report folder read-only": _fail_report_read_only,
        "report disk full": _fail_report_disk_full, "model disk full": _fail_model_disk_full,
        "onnxruntime refuses the output": _fail_ort_refuses, "compare crashes": _fail_compare_crashes,
        "user metric fails": _fail_user_metric, "report step crashes": _fail_summary,
        "SIGTERM while writing the report": _fail_late_signal, "SIGINT while loading the output": _fail_late_sigint,
        "internal error in a pass": _fail_pass_internal, "user error in a late pass": _fail_pass_user_error,
        "interrupted in calibrate": _fail_pass_interrupted}


@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "previous outputs"])
@pytest.mark.parametrize("case", LATE)
def test_a_failure_leaves_no_output_and_the_previous_ones_untouched(case, previous, tmp_path, capsys, monkeypatch):
    ws = Workspace(tmp_path, convs() if case != "float model overflows" else None)
    ws.extra = []
    if previous:
        _previous(ws)
    code, fragment = LATE[case](ws, monkeypatch)
    before = snapshot(tmp_path)
    assert_refused(capsys, tmp_path, _all_outputs(ws, *ws.extra), fragment, code, before=before)


# -- the commit itself fails ------------------------------------------------------------------------------
@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "previous outputs"])
@pytest.mark.parametrize("failing", [1, 2, 3, 4])
def test_a_commit_that_fails_midway_is_undone(failing, previous, tmp_path, capsys, monkeypatch):
    """The failing-th rename into place fails: the ones before it are undone."""
    import qpasses.cli.outputs as outputs

    ws = Workspace(tmp_path)
    if previous:
        _previous(ws)
    real, calls = outputs.os.replace, []

    def replace(src, dst):
        if ".qpasses-" in str(src) and ".qpasses-" not in str(dst) and "backup" not in str(src):   # not an undo
            calls.append(dst)
            if len(calls) == failing:
                raise OSError(errno.EIO, "Input/output error", str(src), None, str(dst))
        return real(src, dst)

    monkeypatch.setattr(outputs.os, "replace", replace)
    assert_refused(capsys, tmp_path, _all_outputs(ws, "--passes", "fold-constants,cleanup"),
                   "write failed (Input/output error); nothing was written")
    assert len(calls) == failing


def test_an_undo_that_fails_keeps_the_previous_files_and_says_where(tmp_path, capsys, monkeypatch):
    import qpasses.cli.outputs as outputs

    ws = Workspace(tmp_path)
    _previous(ws)
    real, state = outputs.os.replace, {"commits": 0}

    def replace(src, dst):
        if ".qpasses-" in str(src) and "backup" in str(src):   # the undo
            raise OSError(errno.EIO, "Input/output error", str(src))
        if ".qpasses-" in str(src) and ".qpasses-" not in str(dst):
            state["commits"] += 1
            if state["commits"] == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(src))
        return real(src, dst)

    monkeypatch.setattr(outputs.os, "replace", replace)
    code, lines, _ = run_cli(capsys, _all_outputs(ws, "--passes", "fold-constants,cleanup"))
    assert code == 2 and len(lines) == 1 and "the previous files are kept in" in lines[0], lines
    kept = [p for p in tmp_path.rglob("*backup*")]
    assert kept and {p.read_bytes() for p in kept} & {b"previous model", b'{"previous": "report"}', b"previous dump"}


def test_a_cleanup_that_fails_is_said_on_the_same_line(tmp_path, capsys, monkeypatch):
    import qpasses.cli.outputs as outputs

    ws = Workspace(tmp_path)
    _previous(ws)
    before = snapshot(tmp_path)
    from qpasses.passes.insert_qdq import InsertQDQ

    def broken(self, model, ctx):
        raise ValueError("boom")

    monkeypatch.setattr(InsertQDQ, "run", broken)
    real_rmdir = outputs.os.rmdir
    def rmdir(p, *a, **k):
        if Path(p).name.startswith(".qpasses-"):
            raise OSError(errno.EBUSY, "Device or resource busy", str(p))
        return real_rmdir(p, *a, **k)

    monkeypatch.setattr(outputs.os, "rmdir", rmdir)
    code, lines, _ = run_cli(capsys, _all_outputs(ws))
    assert code == 1 and len(lines) == 1, lines
    assert "pass 'insert-qdq' failed: ValueError: boom" in lines[0] and "could not be removed" in lines[0]
    after = snapshot(tmp_path)
    assert {p: after.get(p) for p in before} == before                     # the previous outputs untouched
    left = [p for p in set(after) - set(before)]
    assert left and all(".qpasses-" in str(p) for p in left) and not any(after[p][0] == "file" for p in left)


def test_success_replaces_the_previous_outputs_and_leaves_no_temporary_folder(tmp_path, capsys):
    import json

    ws = Workspace(tmp_path)
    _previous(ws)
    code, lines, _ = run_cli(capsys, _all_outputs(ws))
    assert code == 0, lines
    assert ws.out.read_bytes() != b"previous model" and json.loads(ws.report.read_text())["output"] == str(ws.out)
    assert (ws.out_dir / "dumps" / "001_fold-constants.onnx").read_bytes() != b"previous dump"
    assert not list(tmp_path.rglob(".qpasses-*"))
    assert lines[-1] == f"qpasses: wrote {ws.out}"


# -- the reproducer: the one thing a failure writes ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["internal", "config"])
def test_a_failing_pass_commits_the_reproducer_and_nothing_else(kind, tmp_path, capsys, monkeypatch):
    ws = Workspace(tmp_path)
    _previous(ws)
    rep = ws.out_dir / "rep"
    if kind == "internal":
        from qpasses.passes.compute_qparams import ComputeQParams

        def broken(self, model, ctx):
            raise ValueError("boom")

        monkeypatch.setattr(ComputeQParams, "run", broken)
        extra, code = [], 1
    else:
        ws.config.write_text('{"mixed_precision": {"no_such_tensor": "uint16"}}')
        extra, code = ["--config", ws.config], 2
    before = snapshot(tmp_path)
    got, lines, _ = run_cli(capsys, _all_outputs(ws, "--reproducer", rep, *extra))
    assert got == code and len(lines) == 1, lines
    assert f"reproducer written to {rep}" in lines[0]
    after = snapshot(tmp_path)
    assert {p: after.get(p) for p in before} == before
    assert sorted(str(p.relative_to(rep)) for p in set(after) - set(before) if p != rep) == \
        ["command.txt", "config.json", "input.onnx", "pipeline.txt"]


def test_a_reproducer_that_cannot_be_written_leaves_nothing(tmp_path, capsys, monkeypatch):
    ws = Workspace(tmp_path)
    from qpasses.passes.compute_qparams import ComputeQParams

    def broken(self, model, ctx):
        raise ValueError("boom")

    monkeypatch.setattr(ComputeQParams, "run", broken)
    real = Path.write_text

    def write_text(self, *a, **k):
        if self.name == "pipeline.txt":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", write_text)
    line = assert_refused(capsys, tmp_path, _all_outputs(ws, "--reproducer", ws.out_dir / "rep"),
                          "the reproducer could not be written (No space left on device)", 1)
    assert "ValueError: boom" in line and "reproducer written" not in line


# -- signals, in a real process --------------------------------------------------------------------------------
_SLOW = """
import os, sys, time
import qpasses.cli.outputs as outputs
from qpasses.passes.calibrate import Calibrate
where, marker = sys.argv[1], sys.argv[2]
def wait(*a, **k):
    open(marker, "w").close()
    time.sleep(60)
if where == "pass":
    Calibrate.run = wait
else:
    outputs.check_loads = wait
from qpasses.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("sig, where", [(signal.SIGTERM, "pass"), (signal.SIGTERM, "staged"),
                                        (signal.SIGHUP, "staged"), (signal.SIGINT, "staged")],
                         ids=["SIGTERM in a pass", "SIGTERM with outputs staged", "SIGHUP with outputs staged",
                              "SIGINT with outputs staged"])
def test_signals_stop_the_run_like_sigint_and_leave_nothing(sig, where, tmp_path, tmp_path_factory):
    ws = Workspace(tmp_path)
    _previous(ws)
    marker = tmp_path_factory.mktemp("marker") / "ready"
    before = snapshot(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_SLOW), where, str(marker),
                             *map(str, _all_outputs(ws))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()
    if where == "staged":
        assert list(ws.out_dir.glob(".qpasses-*")), "the outputs should be staged by now"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert proc.returncode == 128 + sig, err
    assert lines == [f"qpasses: interrupted ({signal.Signals(sig).name}); nothing was written"], err
    assert snapshot(tmp_path) == before
