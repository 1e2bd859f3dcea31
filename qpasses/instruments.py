"""Instruments run around every pass: timing, verification, dumps and a reproducer on failure."""
from __future__ import annotations

import sys
from pathlib import Path

from .errors import ModelError
from .ir import QModel, save
from .verify import verify


class Instrument:
    def before(self, index, p, model: QModel) -> None: ...
    def after(self, index, p, model: QModel, record) -> None: ...
    def failed(self, index, p, model: QModel, remaining) -> None: ...


class TimePasses(Instrument):
    """Collects per-pass wall time; ``table()`` formats it."""

    def __init__(self):
        self.rows: list[tuple[str, float, bool, dict]] = []

    def after(self, index, p, model, record):
        self.rows.append((record.text, record.seconds, record.modified, record.stats))

    def table(self) -> str:
        total = sum(r[1] for r in self.rows) or 1e-9
        lines = [f"{'seconds':>9} {'%':>5}  pass"]
        for text, sec, modified, stats in self.rows:
            extra = " ".join(f"{k}={v}" for k, v in stats.items() if not isinstance(v, (dict, list)))
            lines.append(f"{sec:9.3f} {100 * sec / total:5.1f}  {text}{'' if modified else ' (no change)'}"
                         f"{'  ' + extra if extra else ''}")
        lines.append(f"{total:9.3f} 100.0  total")
        return "\n".join(lines)


class VerifyEach(Instrument):
    """Checks the IR after every pass at the given level (structure, checker or ort)."""

    def __init__(self, level: str):
        self.level = level

    def after(self, index, p, model, record):
        try:
            verify(model, self.level)
        except ModelError as exc:
            raise ModelError(f"after pass '{p.name}': {exc}") from None


class DumpAfter(Instrument):
    """Saves the model after every pass as ``DIR/NNN_<pass>.onnx``."""

    def __init__(self, directory):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ModelError(f"{self.directory}: cannot create the --dump-after folder ({exc.strerror})") from None

    def after(self, index, p, model, record):
        save(model, self.directory / f"{index + 1:03d}_{p.name}.onnx")


class Reproducer(Instrument):
    """On failure, writes the failing pass's input model and the rest of the pipeline to DIR."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self._snapshot = None
        existing = next(p for p in (self.directory, *self.directory.parents) if p.exists())
        if not existing.is_dir():  # refuse now: failing while reporting a failure would hide it
            raise ModelError(f"{self.directory}: cannot create the --reproducer folder ('{existing}' is a file)")

    def before(self, index, p, model):
        self._snapshot = model.to_proto()

    def failed(self, index, p, model, remaining):
        from .pipeline import print_pipeline

        self.directory.mkdir(parents=True, exist_ok=True)
        save(self._snapshot, self.directory / "input.onnx")
        (self.directory / "pipeline.txt").write_text(print_pipeline(remaining) + "\n")
        print(f"qpasses: reproducer written to {self.directory} "
              f"(qpasses run {self.directory / 'input.onnx'} --passes \"$(cat {self.directory / 'pipeline.txt'})\")",
              file=sys.stderr)
