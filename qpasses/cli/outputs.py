"""All or nothing: the files a command writes are staged and committed together at the end.

Each target folder gets a temporary folder beside its files (``.qpasses-XXXXXX``, in the target
folder, or in its nearest existing parent when the folder is still to be created), so that a file
is committed by a rename within one file system. ``commit`` first checks every target again (a
regular file or a new path, not a file the command read), then renames the staged files into place,
each existing target first hard-linked (else renamed) into the staging folder; if any step fails,
the targets committed so far are put back and the folders it created removed. ``discard`` removes
the staging folders. Signals are handled by ``qpasses.cli.process``: while a commit or its undoing
runs they are only recorded, so a commit is never cut in half.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path

from ..errors import QpassesError
from .paths import PathError, PathGuard

PREFIX = ".qpasses-"


class Staging:
    """Temporary folders beside the targets: ``folder(target)`` gives the staging folder whose files
    are committed into ``target``; ``file(path)`` the staged path of one target file."""

    def __init__(self, guard: PathGuard | None = None):
        self.guard = guard or PathGuard()
        self._folders: dict[str, tuple[Path, Path, str]] = {}   # target folder -> (target, staging, role)
        self.cleanup_error: str | None = None
        _OPEN.append(self)

    def folder(self, target, role: str = "output", *, display=None) -> Path:
        target = Path(target)
        key = os.path.realpath(target)
        if key not in self._folders:
            base = next((p for p in (target, *target.parents) if p.is_dir()), Path("."))
            try:
                staging = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
            except OSError as exc:   # the text ir.save gives for an unwritable folder
                raise PathError(f"{display or target}: cannot write to '{base}' ({exc.strerror or exc})") from None
            self._folders[key] = (target, staging, role)
        return self._folders[key][1]

    def file(self, path, role: str = "output") -> Path:
        path = Path(path)
        return self.folder(path.parent, role, display=path) / path.name

    def staged(self) -> list[tuple[Path, Path, str]]:
        """(staged file, target, role) of every staged file, in a stable order."""
        out = []
        for target, staging, role in self._folders.values():
            for f in sorted(staging.rglob("*")):
                if f.is_file() and not f.name.startswith(PREFIX):
                    out.append((f, target / f.relative_to(staging), role))
        return out

    def commit(self, roles: set[str] | None = None) -> list[Path]:
        """Rename the staged files (of ``roles`` only, if given) into place; all of them or none."""
        from .process import deferred_signals

        plan = [row for row in self.staged() if roles is None or row[2] in roles]
        for _, target, role in plan:   # still a regular file or a new path, and not a file read
            self.guard.check_target(role, target)
        done: list[tuple[Path, Path | None]] = []
        made: list[Path] = []
        with deferred_signals():
            try:
                target = None
                for i, (staged, target, _) in enumerate(plan):
                    made += _make_parents(target.parent)
                    backup = None
                    if _lexists(target):
                        backup = self.folder(target.parent) / f"{PREFIX}backup-{i}"
                        _keep(target, backup)
                    done.append((target, backup))
                    os.replace(staged, target)
            except BaseException as exc:
                undo_error = _undo(done, made)
                if undo_error:   # the previous files are still in the staging folders: keep them
                    kept = ", ".join(f"'{staging}'" for _, staging, _ in self._folders.values())
                    self._folders.clear()
                    undo_error += f" (the previous files are kept in {kept})"
                else:
                    self.discard()
                if isinstance(exc, OSError):
                    where = target if target is not None else exc.filename or ""
                    extra = f"; {undo_error}" if undo_error else "; nothing was written"
                    raise QpassesError(f"{where}: write failed ({exc.strerror or exc}){extra}") from None
                raise
        self.discard()
        return [target for _, target, _ in plan]

    def discard(self) -> None:
        """Remove every staging folder (what cannot be removed is noted in ``cleanup_error``)."""
        for _, staging, _ in self._folders.values():
            problem = remove_tree(staging)
            if problem and not self.cleanup_error:
                self.cleanup_error = f"the temporary folder '{staging}' could not be removed ({problem})"
        self._folders.clear()
        if self in _OPEN:
            _OPEN.remove(self)

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc) -> None:
        from .process import deferred_signals

        with deferred_signals():
            self.discard()


_OPEN: list[Staging] = []   # stagings not yet committed or discarded


def discard_open() -> str | None:
    """Discard every staging still open (a command ended early: an error, a signal); returns what
    could not be removed, if anything."""
    from .process import deferred_signals

    problems = []
    with deferred_signals():
        for staging in list(_OPEN):
            staging.discard()
            if staging.cleanup_error:
                problems.append(staging.cleanup_error)
    return "; ".join(problems) or None


def _lexists(path: Path) -> bool:
    return os.path.lexists(path)


def _keep(target: Path, backup: Path) -> None:
    """Keep what ``target`` is (a file or a symlink) at ``backup``, leaving it in place if possible."""
    try:
        os.link(target, backup, follow_symlinks=False)
    except OSError:
        os.rename(target, backup)


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; returns those created, outermost first."""
    missing = []
    for p in (folder, *folder.parents):
        if _lexists(p):
            break
        missing.append(p)
    for p in reversed(missing):
        os.mkdir(p)
    return list(reversed(missing))


def _undo(done: list[tuple[Path, Path | None]], made: list[Path]) -> str | None:
    """Put back the targets a failed commit replaced and remove the folders it made; returns what
    could not be undone (None when all was)."""
    failed = []
    for target, backup in reversed(done):
        try:
            if backup is not None and _lexists(backup):
                os.replace(backup, target)
            elif backup is None and _lexists(target):
                os.unlink(target)
        except OSError as exc:
            failed.append(f"{target} ({exc.strerror or exc})")
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    return f"could not restore {', '.join(failed)}" if failed else None


def remove_tree(folder: Path) -> str | None:
    """Remove a staging folder, file by file (no shutil.rmtree: it is the part most often patched
    or interrupted); returns the first problem, None when all is gone."""
    problem = None
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            try:
                os.unlink(os.path.join(root, name))
            except FileNotFoundError:
                pass
            except OSError as exc:
                problem = problem or (exc.strerror or str(exc))
        for name in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, name))
    try:
        os.rmdir(folder)
    except FileNotFoundError:
        pass
    except OSError as exc:
        problem = problem or (exc.strerror or str(exc))
    return problem


def save_staged(model, staged: Path, target: Path) -> None:
    """``ir.save`` to the staged path (in place: the staging folder is committed whole); its
    one-line errors name the target."""
    from ..errors import ModelError
    from ..ir.model import save

    try:
        save(model, staged, atomic=False)
    except ModelError as exc:
        raise ModelError(str(exc).replace(str(staged), str(target)).replace(str(staged.parent), str(target.parent))) from None


# -- the report --------------------------------------------------------------------------------------
def strict_json(data) -> str:
    """JSON that strict parsers accept: NaN becomes null, +-Infinity the strings "inf" / "-inf"."""
    return json.dumps(_finite(data), indent=2, sort_keys=True, allow_nan=False) + "\n"


def _finite(value):
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_finite(v) for v in (sorted(value, key=str) if isinstance(value, (set, frozenset)) else value)]
    if hasattr(value, "tolist"):   # numpy scalars and arrays
        return _finite(value.tolist())
    return str(value)


def write_text(path: Path, text: str, target: Path) -> None:
    """Write a staged text file (a one-line error naming the target if it fails)."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise QpassesError(f"{target}: write failed ({exc.strerror or exc})") from None


# -- the output model loads in onnxruntime -------------------------------------------------------------
def check_loads(path: Path, target: Path, source: Path | None = None, *, optimized_to: Path | None = None):
    """Load the staged model ``path`` in onnxruntime at its default optimization level; a model it
    refuses is an internal error (exit 1) naming the ``target`` and onnxruntime's reason, unless
    onnxruntime cannot load the ``source`` model either (custom ops, types without a CPU kernel:
    a folding pipeline's output is then as loadable as its input was). Returns the session (to run
    the output model in), None when neither loads. ``optimized_to``: where onnxruntime writes the
    graph it optimized (qpasses.evaluation.integer_kernels.optimized_kernels reads it)."""
    from ..errors import first_line

    try:
        return _ort_load(path, optimized_to)
    except Exception as exc:   # onnxruntime raises its own exception types
        reason = first_line(exc).split(" : ")[-1]
        if source is not None:
            try:
                _ort_load(source)
            except Exception:
                return None
        raise OutputRefused(f"{target}: onnxruntime cannot load the output model ({reason}); "
                            f"nothing was written") from None


def _ort_load(path: Path, optimized_to: Path | None = None):
    from ..calibration.sessions import ort_session

    return ort_session(ort_source(path), log=4, optimized_to=optimized_to)


class OutputRefused(Exception):
    """onnxruntime refuses the model a pipeline produced: an internal error (exit 1)."""


def ort_source(path: Path):
    """What onnxruntime can open: the path, or the model's bytes when the path is not UTF-8 (its
    C++ API takes UTF-8 paths only)."""
    try:
        str(path).encode("utf-8")
        return str(path)
    except UnicodeEncodeError:
        import onnx

        return onnx.load(str(path)).SerializeToString()
