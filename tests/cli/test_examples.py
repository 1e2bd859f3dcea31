"""`qpasses example DIR`: writes the bundled example, never overwrites, one-line errors."""
import os

import pytest

from qpasses.cli import examples
from qpasses.cli import main

NAMES = ("model.onnx", "calib.npz", "eval.npz")


def _example(capsys, folder):
    code = main(["example", str(folder)])
    out, err = capsys.readouterr()
    return code, out, err.strip()


def test_writes_the_three_files(tmp_path, capsys):
    code, out, err = _example(capsys, tmp_path / "new" / "demo")
    assert code == 0 and err == "" and "next: qpasses run" in out
    assert sorted(p.name for p in (tmp_path / "new" / "demo").iterdir()) == sorted(NAMES)


def test_refuses_to_overwrite(tmp_path, capsys):
    assert _example(capsys, tmp_path)[0] == 0
    before = {name: (tmp_path / name).read_bytes() for name in NAMES}
    code, out, err = _example(capsys, tmp_path)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "model.onnx, calib.npz, eval.npz already there" in err
    assert {name: (tmp_path / name).read_bytes() for name in NAMES} == before


def test_one_existing_file_is_enough_to_refuse(tmp_path, capsys):
    (tmp_path / "calib.npz").write_text("mine")
    code, _, err = _example(capsys, tmp_path)
    assert code == 2 and "calib.npz already there" in err and "model.onnx" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.npz"]
    assert (tmp_path / "calib.npz").read_text() == "mine"


def test_a_file_is_not_a_folder(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code, _, err = _example(capsys, tmp_path / "f")
    assert code == 2 and err == f"qpasses: error: {tmp_path / 'f'}: is not a folder"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder(tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        code, _, err = _example(capsys, folder)
    finally:
        folder.chmod(0o755)
    assert code == 2 and len(err.splitlines()) == 1 and "cannot write the example" in err
    assert list(folder.iterdir()) == []


def test_a_failed_write_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    def denied(path, **arrays):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(examples.np, "savez", denied)
    code, _, err = _example(capsys, tmp_path)
    assert code == 2 and len(err.splitlines()) == 1
    assert err == f"qpasses: error: {tmp_path / 'calib.npz'}: cannot write the example (Permission denied)"
    assert list(tmp_path.iterdir()) == []
