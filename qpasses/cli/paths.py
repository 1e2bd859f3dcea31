"""Path safety for the command line: every path a command reads and writes, checked before any work.

A path is identified by the file it names: an existing path by its device and inode (so symlinks and
hard links to one file are the same file), a path that does not exist yet by its resolved form. A
path written that is also read, or written twice, is a clash: a one-line error naming both. Files
are read only if they are regular files (a calibration folder: the files its reader would read);
writes go only to regular files or new paths. Devices, FIFOs and sockets are refused on both sides
from their ``stat`` alone: a FIFO is never opened, so nothing hangs on it.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from ..errors import QpassesError


class PathError(QpassesError):
    """A path the command line cannot read or write safely (exit 2)."""


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def escape(text: str) -> str:
    """``text`` on one printable line: control characters become ``\\n``, ``\\x1b``, ...; bytes
    that are not UTF-8 (a path's surrogate escapes) become ``\\xNN``."""
    def one(match):
        c = match.group()
        if "\ud800" <= c <= "\udfff":
            return f"\\x{ord(c) - 0xDC00:02x}" if ord(c) >= 0xDC80 else f"\\u{ord(c):04x}"
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, f"\\x{ord(c):02x}")

    return _CONTROL.sub(one, text)


def kind_of(mode: int) -> str | None:
    """What a non-regular, non-folder file is ('a FIFO', ...), None for regular files and folders."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return None


def _stat(path: Path, what: str) -> os.stat_result | None:
    """``os.stat`` (through symlinks); None if nothing is there; other errors are a PathError."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:   # a name too long, a loop of symlinks, a file where a folder should be
        if exc.errno == 20:  # ENOTDIR: a parent is a file, so the path cannot exist
            return None
        raise PathError(f"{path}: cannot use this {what} ({exc.strerror})") from None


def identity(path: Path) -> tuple:
    """What ``path`` names: ('inode', dev, ino) when it exists, else ('path', resolved path)."""
    st = _stat(path, "path")
    if st is not None:
        return ("inode", st.st_dev, st.st_ino)
    return ("path", os.path.realpath(path))


class PathGuard:
    """Collects the files a command reads and writes (with the option that names each), refuses
    unsafe ones as they are added and clashes in ``check``."""

    def __init__(self):
        self.reads: list[tuple[str, Path, tuple]] = []
        self.writes: list[tuple[str, Path, tuple]] = []
        self.data_folders: list[tuple[str, Path]] = []   # read folders: a new file there may be read

    # -- reads -------------------------------------------------------------------------------------
    def read_file(self, role: str, path, *, missing: str | None = None) -> None:
        """A file the command reads: it must be a regular file (``missing``: the message when absent,
        else absence is left to the reader's own message)."""
        path = Path(path)
        st = _stat(path, role)
        if st is None:
            if missing:
                raise PathError(f"{path}: {missing}")
            return
        other = kind_of(st.st_mode)
        if other:
            raise PathError(f"{path}: the {role} is {other}, not a regular file (refused)")
        if stat.S_ISREG(st.st_mode):
            self.reads.append((role, path, ("inode", st.st_dev, st.st_ino)))

    def read_data(self, role: str, path) -> None:
        """Calibration/evaluation data: a file, or a folder whose data files are each checked."""
        from ..calibration.data import data_files

        path = Path(path)
        st = _stat(path, role)
        if st is None or not stat.S_ISDIR(st.st_mode):
            self.read_file(role, path)
            return
        self.data_folders.append((role, path))
        for f in data_files(path):
            self.read_file(role, f)

    # -- writes ------------------------------------------------------------------------------------
    def write_file(self, role: str, path) -> None:
        """A file the command writes: its folder exists; it is a regular file or a new path."""
        path = Path(path)
        parent = path.parent
        pst = _stat(parent, "folder")
        if pst is None or not stat.S_ISDIR(pst.st_mode):
            state = "is not a folder" if pst is not None or _exists_as_file(parent) else "does not exist"
            raise PathError(f"{path}: output folder '{parent}' {state}")
        self._target(role, path)

    def write_folder(self, role: str, folder, names) -> None:
        """Files ``names`` the command writes into ``folder`` (created with its parents if missing)."""
        folder = Path(folder)
        existing = next((p for p in (folder, *folder.parents) if _stat(p, "folder") is not None
                         or _exists_as_file(p)), None)
        if existing is not None and not existing.is_dir():   # the texts of DumpAfter's and Reproducer's own check
            why = "Not a directory" if role == "--dump-after" else f"'{existing}' is a file"
            raise PathError(f"{folder}: cannot create the {role} folder ({why})")
        for name in names:
            self._target(role, folder / name)

    def read_files(self, role: str, paths) -> None:
        for path in paths:
            self.read_file(role, path)

    def _target(self, role: str, path: Path) -> tuple:
        st = _stat(path, f"{role} path")
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise PathError(f"{path}: is a folder; give the {role} file's path")
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise PathError(f"{path}: {role} names {kind_of(st.st_mode) or 'not a regular file'}; "
                            f"qpasses writes only regular files or new paths (refused)")
        if len(os.fsencode(path.name)) > 255:
            raise PathError(f"{path}: the {role} file name is too long ({len(os.fsencode(path.name))} bytes, "
                            f"at most 255)")
        self.writes.append((role, path, identity(path)))
        return self.writes[-1][2]

    # -- clashes -------------------------------------------------------------------------------------
    def check(self) -> None:
        """Refuse a write that names a file read, or that another write names (the first clash)."""
        reads = {}
        for role, path, key in self.reads:
            reads.setdefault(key, (role, path))
        seen: dict[tuple, tuple[str, Path]] = {}
        for role, path, key in self.writes:
            if key in reads:
                read_role, read_path = reads[key]
                raise PathError(f"{path}: {role} would overwrite the {read_role} '{read_path}'"
                                f"{_same_file(path, read_path)}; choose another path")
            if key in seen:
                other_role, other = seen[key]
                raise PathError(f"{path}: {role} and {other_role} ('{other}') name the same file"
                                f"{_same_file(path, other)}; choose another path")
            seen[key] = (role, path)
            for folder_role, folder in self.data_folders:
                if _picked_up(folder, path):
                    raise PathError(f"{path}: {role} would add a file to the {folder_role} folder "
                                    f"'{folder}'; choose another path")

    def check_target(self, role: str, path: Path) -> None:
        """A file about to be committed: still a regular file or absent, and not a file read."""
        key = self._target(role, path)
        self.writes.pop()
        for read_role, read_path, read_key in self.reads:
            if key == read_key:
                raise PathError(f"{path}: {role} would overwrite the {read_role} '{read_path}'"
                                f"{_same_file(path, read_path)}; choose another path")


def _same_file(a: Path, b: Path) -> str:
    """' (the same file through a link)' when the two spellings differ, else ''."""
    return "" if os.path.abspath(a) == os.path.abspath(b) else " (the same file, through a link)"


def _exists_as_file(path: Path) -> bool:
    try:
        os.lstat(path)
        return True
    except OSError:
        return False


def _picked_up(folder: Path, path: Path) -> bool:
    """Would a new file at ``path`` be read as part of the data folder ``folder`` (an .npz file in
    it, an ``input_N.pb`` in it or in one of its ``test_data_set_*`` folders)?"""
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    if not real.is_relative_to(root):
        return False
    rel = real.relative_to(root)
    if len(rel.parts) == 1 and rel.suffix.lower() == ".npz":
        return True
    return len(rel.parts) <= 2 and re.fullmatch(r"input_\d+\.pb", rel.name) is not None and (
        len(rel.parts) == 1 or rel.parts[0].startswith("test_data_set_"))


def guard_run(args, pass_names: list[str]) -> PathGuard:
    """The paths ``qpasses run`` reads and writes (``args``: its parsed options), checked for
    safety and clashes, except the model's external data files (known once it is loaded:
    ``read_files`` then ``check`` again)."""
    guard = PathGuard()
    guard.read_file("input model", args.model)
    if args.config:
        guard.read_file("--config file", args.config)
    if args.calib:
        guard.read_data("calibration data", args.calib)
    if args.eval:
        guard.read_data("--eval data", args.eval)
    guard.write_file("-o", args.output)
    if args.report:
        guard.write_file("--report", args.report)
    if getattr(args, "html", None):
        guard.write_file("--html", args.html)
    if args.dump_after:
        dumps = [f"{i + 1:03d}_{name}.onnx" for i, name in enumerate(pass_names)]
        guard.write_folder("--dump-after", args.dump_after, dumps + [f"{d}.data" for d in dumps])
    if args.reproducer:
        guard.write_folder("--reproducer", args.reproducer, REPRODUCER_FILES)
    guard.check()
    return guard


REPRODUCER_FILES = ("input.onnx", "input.onnx.data", "pipeline.txt", "config.json", "command.txt")
