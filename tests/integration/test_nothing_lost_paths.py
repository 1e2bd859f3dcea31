"""Nothing lost (issue 14), class 1: inputs overwritten. Path safety of the command line.

Every path `qpasses run` writes (-o, --report, --dump-after files, --reproducer files) and every
`example` target is compared with every path it reads (the model, its external data, --calib files
and folder contents, --config, --eval) and with each other, as files: through symlinks, hard links
and other spellings. A clash is exit 2 naming both; devices, FIFOs (never opened) and sockets are
refused on both sides. Each case checks the exit code, one stderr line, and that nothing in the
workspace changed (nothing_lost_kit.assert_refused).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.kits.nothing_lost_kit import (Workspace, assert_refused, char_device, external, make_fifo, mlp, run_cli, snapshot,
                              write_npz)


# -- what is read: (name, prepare(ws) -> (extra args, path read)) -----------------------------------
def _model(ws):
    return [], ws.model


def _external_data(ws):
    (ws / "ext").mkdir()
    model = external(mlp(), ws / "ext")
    return ["--model", model], ws / "ext" / "weights.bin"


def _calib_file(ws):
    return [], ws.calib


def _calib_folder(ws):
    folder = ws / "calib_dir"
    folder.mkdir()
    data = np.load(ws.calib)
    write_npz(folder / "a.npz", {"x": data["x"][:4]})
    write_npz(folder / "b.npz", {"x": data["x"][4:]})
    return ["--calib", folder], folder / "b.npz"


def _test_data(ws):
    folder = ws / "td" / "test_data_set_0"
    folder.mkdir(parents=True)
    tensor = numpy_helper.from_array(np.load(ws.calib)["x"][0], "x")
    (folder / "input_0.pb").write_bytes(tensor.SerializeToString())
    return ["--calib", ws / "td"], folder / "input_0.pb"


def _config_json(ws):
    return ["--config", ws.config], ws.config


def _config_yaml(ws):
    path = ws / "cfg.yaml"
    path.write_text("per_channel: true\n")
    return ["--config", path], path


def _eval_file(ws):
    return ["--eval", ws.eval], ws.eval


def _eval_folder(ws):
    folder = ws / "eval_dir"
    folder.mkdir()
    write_npz(folder / "e.npz", dict(np.load(ws.eval)))
    return ["--eval", folder], folder / "e.npz"


READS = {"model": _model, "external data": _external_data, "calib file": _calib_file,
         "calib folder member": _calib_folder, "test-data member": _test_data, "config json": _config_json,
         "config yaml": _config_yaml, "eval file": _eval_file, "eval folder member": _eval_folder}
ROLE_TEXT = {"model": "input model", "external data": "model's external data", "calib file": "calibration data",
             "calib folder member": "calibration data", "test-data member": "calibration data",
             "config json": "--config file", "config yaml": "--config file", "eval file": "--eval data",
             "eval folder member": "--eval data"}


# -- how the written path names it --------------------------------------------------------------------
def _same(ws, read: Path) -> str:
    return str(read)


def _symlink(ws, read: Path) -> str:
    link = ws / "link.out"
    link.symlink_to(read)
    return str(link)


def _hardlink(ws, read: Path) -> str:
    link = ws / "hard.out"
    os.link(read, link)
    return str(link)


def _spelled(ws, read: Path) -> str:
    return f"{read.parent}/../{read.parent.name}/./{read.name}"


LINKS = {"same path": _same, "symlink": _symlink, "hard link": _hardlink, "other spelling": _spelled}


def _args(ws, extra: list) -> list:
    """ws.run() with the read's extra arguments ('--model' replaces the model)."""
    extra = list(extra)
    model = None
    if "--model" in extra:
        i = extra.index("--model")
        model = extra[i + 1]
        del extra[i:i + 2]
    calib = "--calib" not in extra
    return ws.run(*extra, model=model, calib=calib)


@pytest.mark.parametrize("link", LINKS)
@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("write", ["-o", "--report"])
def test_a_written_path_never_names_a_file_read(write, read, link, tmp_path, capsys):
    ws = Workspace(tmp_path)
    extra, read_path = READS[read](ws)
    target = LINKS[link](ws, read_path)
    args = _args(ws, extra)
    if write == "-o":
        args[args.index("-o") + 1] = target
    else:
        args += ["--report", target]
    line = assert_refused(capsys, tmp_path, args, f"{write} would overwrite the {ROLE_TEXT[read]}")
    assert str(read_path.name) in line


# -- written twice ------------------------------------------------------------------------------------
def _twice(ws, how):
    q, r = ws.out, ws.report
    if how == "report is -o":
        return ws.run("--report", q), "--report and -o"
    if how == "report is -o spelled otherwise":
        return ws.run("--report", f"{q.parent}/../out/{q.name}"), "--report and -o"
    if how == "report symlinks to -o":
        (ws.out_dir / "r.link").symlink_to(q)
        return ws.run("--report", ws.out_dir / "r.link"), "--report and -o"
    if how == "report hard-links -o":
        q.write_bytes(b"previous output")
        os.link(q, ws.out_dir / "r.hard")
        return ws.run("--report", ws.out_dir / "r.hard"), "--report and -o"
    if how == "report is a dump":
        (ws.out_dir / "d").mkdir()
        return ws.run("--dump-after", ws.out_dir / "d", "--report", ws.out_dir / "d" / "001_fold-constants.onnx"), \
            "--dump-after and --report"
    if how == "-o is a dump":
        return ws.run("--dump-after", ws.out_dir, out=ws.out_dir / "003_cleanup.onnx"), "--dump-after and -o"
    if how == "-o is the last dump of the quantizing pipeline":
        return ws.run("--dump-after", ws.out_dir, out=ws.out_dir / "001_fold-constants.onnx"), "--dump-after and -o"
    if how == "report is the reproducer's command":
        (ws.out_dir / "rep").mkdir()
        return ws.run("--reproducer", ws.out_dir / "rep", "--report", ws.out_dir / "rep" / "command.txt"), \
            "--reproducer and --report"
    if how == "-o is the reproducer's input":
        (ws.out_dir / "rep").mkdir()
        return ws.run("--reproducer", ws.out_dir / "rep", out=ws.out_dir / "rep" / "input.onnx"), "--reproducer and -o"
    if how == "dumps and reproducer in one folder, report on its config":
        return ws.run("--reproducer", ws.out_dir, "--report", ws.out_dir / "config.json"), "--reproducer and --report"
    raise AssertionError(how)


TWICE = ["report is -o", "report is -o spelled otherwise", "report symlinks to -o", "report hard-links -o",
         "report is a dump", "-o is a dump", "-o is the last dump of the quantizing pipeline",
         "report is the reproducer's command", "-o is the reproducer's input",
         "dumps and reproducer in one folder, report on its config"]


@pytest.mark.parametrize("how", TWICE)
def test_two_outputs_never_name_one_file(how, tmp_path, capsys):
    ws = Workspace(tmp_path)
    args, fragment = _twice(ws, how)
    assert_refused(capsys, tmp_path, args, fragment)


# -- dumps and reproducer files onto inputs -------------------------------------------------------------
def _dump_onto(ws, what):
    d = ws / "dd"
    d.mkdir()
    if what == "model is a dump":
        model = d / "001_fold-constants.onnx"
        model.write_bytes(ws.model.read_bytes())
        return ws.run("--dump-after", d, model=model, calib=False), "--dump-after would overwrite the input model"
    if what == "config is a dump":
        cfg = d / "003_cleanup.onnx"
        cfg.write_text("{}")
        return ws.run("--dump-after", d, "--config", cfg), "--dump-after would overwrite the --config file"
    if what == "a dump symlinks to the calibration data":
        (d / "002_fold-batchnorm.onnx").symlink_to(ws.calib)
        return ws.run("--dump-after", d), "--dump-after would overwrite the calibration data"
    if what == "a dump hard-links the model":
        from qpasses.core.pipeline import default_pipeline

        last = default_pipeline(quantize=True).split(",")
        os.link(ws.model, d / f"{len(last):03d}_{last[-1]}.onnx")   # the last pass's dump
        return ws.run("--dump-after", d), "--dump-after would overwrite the input model"
    if what == "a dump's external data is the model":
        model = d / "001_fold-constants.onnx.data"
        model.write_bytes(ws.model.read_bytes())
        return ws.run("--dump-after", d, model=model), "--dump-after would overwrite the input model"
    if what == "model is the reproducer's input":
        model = d / "input.onnx"
        model.write_bytes(ws.model.read_bytes())
        return ws.run("--reproducer", d, model=model), "--reproducer would overwrite the input model"
    if what == "config is the reproducer's config":
        cfg = d / "config.json"
        cfg.write_text("{}")
        return ws.run("--reproducer", d, "--config", cfg), "--reproducer would overwrite the --config file"
    if what == "external data is the reproducer's":
        model = external(mlp(), d, name="input.onnx", location="input.onnx.data")
        return ws.run("--reproducer", d, model=model), "--reproducer would overwrite the input model"
    if what == "pipeline.txt symlinks to the model":
        (d / "pipeline.txt").symlink_to(ws.model)
        return ws.run("--reproducer", d), "--reproducer would overwrite the input model"
    raise AssertionError(what)


DUMP_ONTO = ["model is a dump", "config is a dump", "a dump symlinks to the calibration data", "a dump hard-links the model",
             "a dump's external data is the model", "model is the reproducer's input",
             "config is the reproducer's config", "external data is the reproducer's", "pipeline.txt symlinks to the model"]


@pytest.mark.parametrize("what", DUMP_ONTO)
def test_dumps_and_reproducer_never_overwrite_an_input(what, tmp_path, capsys):
    ws = Workspace(tmp_path)
    args, fragment = _dump_onto(ws, what)
    assert_refused(capsys, tmp_path, args, fragment)


def test_a_new_data_file_would_change_the_calibration_folder(tmp_path, capsys):
    ws = Workspace(tmp_path)
    extra, _ = _calib_folder(ws)
    assert_refused(capsys, tmp_path, ws.run(*extra, out=ws / "calib_dir" / "q.npz", calib=False),
                   "-o would add a file to the calibration data folder")


def test_a_new_test_data_file_would_change_the_calibration_folder(tmp_path, capsys):
    ws = Workspace(tmp_path)
    extra, pb = _test_data(ws)
    assert_refused(capsys, tmp_path, ws.run(*extra, "--report", pb.parent / "input_1.pb", calib=False),
                   "--report would add a file to the calibration data folder")


# -- devices, FIFOs, sockets ------------------------------------------------------------------------------
class Watchdog:
    """Opens the FIFOs after ``seconds`` if the test still runs: a blocked reader or writer returns
    (and the test fails) instead of hanging the suite."""

    def __init__(self, fifos, seconds: float = 20.0):
        self.fifos, self.done = list(fifos), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(seconds,), daemon=True)

    def _run(self, seconds):
        if self.done.wait(seconds):
            return
        for fifo in self.fifos:
            for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
                try:
                    os.close(os.open(fifo, flags))
                except OSError:
                    pass

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()


def _special(ws, what):
    """(args, fragment, fifos) for a device/FIFO/socket on either side."""
    fifo = ws / "fifo"
    if what == "-o is a character device":
        return ws.run(out=char_device(ws / "dev")), "-o names a character device", []
    if what == "-o is a FIFO":
        return ws.run(out=make_fifo(fifo)), "-o names a FIFO", [fifo]
    if what == "-o symlinks to a FIFO":
        make_fifo(fifo)
        (ws.out_dir / "q.onnx").symlink_to(fifo)
        return ws.run(), "-o names a FIFO", [fifo]
    if what == "-o is a socket":
        import socket

        path = ws / "sock"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
        return ws.run(out=path), "-o names a socket", []
    if what == "--report is a character device":
        return ws.run("--report", char_device(ws / "dev")), "--report names a character device", []
    if what == "--report is a FIFO":
        return ws.run("--report", make_fifo(fifo)), "--report names a FIFO", [fifo]
    if what == "a dump is a FIFO":
        (ws / "dd").mkdir()
        return ws.run("--dump-after", ws / "dd"), "--dump-after names a FIFO", [make_fifo(ws / "dd" / "002_fold-batchnorm.onnx")]
    if what == "a reproducer file is a FIFO":
        (ws / "rep").mkdir()
        return ws.run("--reproducer", ws / "rep"), "--reproducer names a FIFO", [make_fifo(ws / "rep" / "pipeline.txt")]
    if what == "model is a FIFO":
        return ws.run(model=make_fifo(fifo)), "input model is a FIFO", [fifo]
    if what == "model is a character device":
        return ws.run(model=char_device(ws / "dev")), "input model is a character device", []
    if what == "model symlinks to a FIFO":
        make_fifo(fifo)
        (ws / "m.onnx").symlink_to(fifo)
        return ws.run(model=ws / "m.onnx"), "input model is a FIFO", [fifo]
    if what == "calib is a FIFO":
        return ws.run("--calib", make_fifo(fifo), calib=False), "calibration data is a FIFO", [fifo]
    if what == "calib folder holds a FIFO":
        (ws / "cd").mkdir()
        write_npz(ws / "cd" / "a.npz", dict(np.load(ws.calib)))
        return ws.run("--calib", ws / "cd", calib=False), "calibration data is a FIFO", [make_fifo(ws / "cd" / "b.npz")]
    if what == "test-data input is a FIFO":
        (ws / "td" / "test_data_set_0").mkdir(parents=True)
        pb = make_fifo(ws / "td" / "test_data_set_0" / "input_0.pb")
        return ws.run("--calib", ws / "td", calib=False), "calibration data is a FIFO", [pb]
    if what == "config is a FIFO":
        return ws.run("--config", make_fifo(fifo)), "--config file is a FIFO", [fifo]
    if what == "eval is a FIFO":
        return ws.run("--eval", make_fifo(fifo)), "--eval data is a FIFO", [fifo]
    if what == "external data is a FIFO":
        (ws / "ext").mkdir()
        model = external(mlp(), ws / "ext")
        (ws / "ext" / "weights.bin").unlink()
        make_fifo(ws / "ext" / "weights.bin")
        return ws.run(model=model), "external data file 'weights.bin' is not a regular file", [ws / "ext" / "weights.bin"]
    if what == "compare data is a FIFO":
        return ["compare", ws.model, ws.model, "--data", make_fifo(fifo)], "not a regular file or folder", [fifo]
    if what == "explain a FIFO":
        return ["explain", make_fifo(fifo)], "not a regular file", [fifo]
    raise AssertionError(what)


SPECIAL = ["-o is a character device", "-o is a FIFO", "-o symlinks to a FIFO", "-o is a socket",
           "--report is a character device",
           "--report is a FIFO", "a dump is a FIFO", "a reproducer file is a FIFO", "model is a FIFO",
           "model is a character device", "model symlinks to a FIFO", "calib is a FIFO", "calib folder holds a FIFO",
           "test-data input is a FIFO", "config is a FIFO", "eval is a FIFO", "external data is a FIFO",
           "compare data is a FIFO", "explain a FIFO"]


@pytest.mark.parametrize("what", SPECIAL)
def test_devices_fifos_and_sockets_are_refused_without_opening_them(what, tmp_path, capsys):
    ws = Workspace(tmp_path)
    args, fragment, fifos = _special(ws, what)
    with Watchdog(fifos):
        assert_refused(capsys, tmp_path, args, fragment)


# -- example targets ------------------------------------------------------------------------------------
def _example_case(tmp_path, what):
    from qpasses.cli.examples import write_example

    d = tmp_path / "ex"
    if what.startswith("present: "):
        d.mkdir()
        (d / what.removeprefix("present: ")).write_bytes(b"mine")
        return ["example", d], "already there", []
    write_example(d)
    if what == "--force onto a FIFO":
        (d / "model.onnx").unlink()
        return ["example", d, "--force"], "example names a FIFO", [make_fifo(d / "model.onnx")]
    if what == "--force onto a folder":
        (d / "calib.npz").unlink()
        (d / "calib.npz").mkdir()
        return ["example", d, "--force"], "calib.npz: is a folder", []
    if what == "--force onto /dev/null":
        (d / "eval.npz").unlink()
        (d / "eval.npz").symlink_to("/dev/null")
        return ["example", d, "--force"], "example names a character device", []
    if what == "without --force":
        return ["example", d], "model.onnx, calib.npz, eval.npz already there", []
    raise AssertionError(what)


EXAMPLE = ["present: model.onnx", "present: calib.npz", "present: eval.npz", "--force onto a FIFO",
           "--force onto a folder", "--force onto /dev/null", "without --force"]


@pytest.mark.parametrize("what", EXAMPLE)
def test_example_writes_only_new_paths_or_regular_files_it_may_replace(what, tmp_path, capsys):
    args, fragment, fifos = _example_case(tmp_path, what)
    with Watchdog(fifos):
        assert_refused(capsys, tmp_path, args, fragment)


def test_example_force_replaces_regular_files_and_keeps_the_rest(tmp_path, capsys):
    d = tmp_path / "ex"
    d.mkdir()
    (d / "model.onnx").write_bytes(b"old")
    (d / "notes.txt").write_text("mine")
    code, lines, _ = run_cli(capsys, ["example", d, "--force"])
    assert code == 0, lines
    onnx.checker.check_model(onnx.load(d / "model.onnx"))
    assert (d / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in d.iterdir()) == ["calib.npz", "eval.npz", "model.onnx", "notes.txt"]


def test_a_clean_run_writes_every_output_and_nothing_else(tmp_path, capsys):
    ws = Workspace(tmp_path)
    before = snapshot(tmp_path)
    code, lines, _ = run_cli(capsys, ws.run("--report", ws.report, "--dump-after", ws.out_dir / "dumps", "--quiet"))
    assert code == 0, lines
    after = snapshot(tmp_path)
    assert {p: v for p, v in after.items() if p in before} == before
    added = sorted(str(p.relative_to(tmp_path)) for p in set(after) - set(before))
    assert added[:2] == ["out/dumps", "out/dumps/001_fold-constants.onnx"] and added[-2:] == ["out/q.onnx", "out/r.json"]
    assert not any(".qpasses-" in p for p in added)
