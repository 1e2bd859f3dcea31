"""Instruments run around every pass: timing, verification, dumps and a reproducer on failure.

They see nested pipelines too (a pass running passes on a copy, e.g. select-by-snr's ``then``):
``ctx.depth`` is 0 for the user's pipeline and more inside a pass.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import ModelError, PassFailure
from ..ir.analyses import stale_analyses
from ..ir.model import QModel, save
from .verify import verify


class Instrument:
    def before(self, index, p, model: QModel, ctx) -> None: ...
    def after(self, index, p, model: QModel, record, ctx) -> None: ...
    def failed(self, index, p, model: QModel, remaining, ctx) -> None: ...


class TimePasses(Instrument):
    """Collects per-pass wall time; ``table()`` formats it (nested passes indented, not in the total;
    a pass a parent ran several times is one row: its runs counted, their seconds added)."""

    def __init__(self):
        self.rows: list[tuple[str, float, bool, dict, int, int]] = []   # text, seconds, modified, stats, depth, runs
        self._pending: list[tuple] = []   # nested rows wait for their parent's row

    def after(self, index, p, model, record, ctx):
        row = (record.text, record.seconds, record.modified, record.stats, ctx.depth)
        if ctx.depth:
            self._pending.append(row)
            return
        self.rows.append(row + (1,))
        self.rows.extend(_aggregated(self._pending))
        self._pending = []

    def table(self) -> str:
        total = sum(r[1] for r in self.rows if not r[4]) or 1e-9
        lines = [f"{'seconds':>9} {'%':>5}  pass"]
        for text, sec, modified, stats, depth, runs in self.rows:
            extra = " ".join(f"{k}={v}" for k, v in stats.items() if not isinstance(v, (dict, list)))
            lines.append(f"{sec:9.3f} {100 * sec / total:5.1f}  {'  ' * depth}{'└ ' if depth else ''}{text}"
                         f"{f' x{runs}' if runs > 1 else ''}{'' if modified else ' (no change)'}"
                         f"{'  ' + extra if extra else ''}")
        lines.append(f"{total:9.3f} 100.0  total")
        return "\n".join(lines)


def _aggregated(rows: list[tuple]) -> list[tuple]:
    """One row per nested pass (text and depth), in the order first run: seconds added, modified if
    any run was, the stats all runs agree on."""
    merged: dict[tuple, list] = {}
    for text, sec, modified, stats, depth in rows:
        row = merged.get((text, depth))
        if row is None:
            merged[(text, depth)] = [text, sec, modified, dict(stats), depth, 1]
            continue
        row[1] += sec
        row[2] = row[2] or modified
        row[3] = {k: v for k, v in row[3].items() if stats.get(k) == v}
        row[5] += 1
    return [tuple(r) for r in merged.values()]


class VerifyEach(Instrument):
    """Checks the IR after every pass at the given level (structure, checker, ort or reload), the
    model's facts and its cached analyses (each as a fresh build gives it); ``reload`` also replaces the model by its saved form reloaded, so each
    pass starts from what a saved model holds."""

    def __init__(self, level: str):
        self.level = level

    def after(self, index, p, model, record, ctx):
        from .facts import fact_problems

        try:
            verify(model, "structure" if self.level == "reload" else self.level)
        except ModelError as exc:
            raise ModelError(f"after pass '{p.name}': {exc}") from None
        failed = fact_problems(model)
        if failed:   # the pass broke what it claims or keeps (an unchanged model: the input's own)
            fact, text = failed
            error = PassFailure if record.modified or fact in p.establishes else ModelError
            raise error(f"after pass '{p.name}': {text}")
        stale = stale_analyses(model)
        if stale:
            raise PassFailure(f"after pass '{p.name}': cached analyses no longer match the model "
                              f"({', '.join(stale)}): it changed a part of the model it declares "
                              f"unchanged, or reported no change")
        if self.level == "reload":
            model.reload()


class DumpAfter(Instrument):
    """Saves the model after every pass of the user's pipeline as ``DIR/NNN_<pass>.onnx``."""

    def __init__(self, directory):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ModelError(f"{self.directory}: cannot create the --dump-after folder ({exc.strerror})") from None

    def after(self, index, p, model, record, ctx):
        if not ctx.depth:
            save(model, self.directory / f"{index + 1:03d}_{p.name}.onnx")


class Reproducer(Instrument):
    """On failure, writes to DIR the failing pass's input model, the rest of the pipeline, the
    config and the data references, and the command that replays it."""

    def __init__(self, directory, *, write_to=None, announce: bool = True):
        """``write_to``: the folder the files go to (default ``directory``; the CLI stages them
        there and commits them to ``directory``, the folder the replay command names);
        ``announce``: print where they are."""
        self.directory = Path(directory)
        self.write_to = Path(write_to) if write_to is not None else self.directory
        self.announce = announce
        self.written = False
        self.error: str | None = None
        self._snapshot = None
        existing = next(p for p in (self.directory, *self.directory.parents) if p.exists())
        if not existing.is_dir():  # refuse now: failing while reporting a failure would hide it
            raise ModelError(f"{self.directory}: cannot create the --reproducer folder ('{existing}' is a file)")

    def before(self, index, p, model, ctx):
        if not ctx.depth:
            self._snapshot = model.to_proto()

    def failed(self, index, p, model, remaining, ctx):
        if ctx.depth:   # the user's pipeline reports it (a pass may also survive a nested failure)
            return
        try:
            self._write(remaining, ctx)
        except (OSError, ModelError) as exc:   # the pass's failure is what gets reported
            self.error = f"the reproducer could not be written ({getattr(exc, 'strerror', None) or exc})"
            if self.announce:
                print(f"qpasses: {self.error}", file=sys.stderr)

    def _write(self, remaining, ctx):
        from .pipeline import print_pipeline

        d, w = self.directory, self.write_to
        w.mkdir(parents=True, exist_ok=True)
        save(self._snapshot, w / "input.onnx")
        (w / "pipeline.txt").write_text(print_pipeline(remaining) + "\n")
        (w / "config.json").write_text(json.dumps(given_config(ctx.config), indent=2, default=str) + "\n")
        command = f"qpasses run {d / 'input.onnx'} -o {d / 'output.onnx'} --config {d / 'config.json'}"
        if ctx.data_source:
            command += f" --calib {Path(ctx.data_source).resolve()}"
        elif ctx.calibration_data is not None:
            command += " --calib <the calibration data, given as Python objects>"
        command += f" --passes \"$(cat {d / 'pipeline.txt'})\""
        (w / "command.txt").write_text(command + "\n")
        self.written = True
        if self.announce:
            print(f"qpasses: reproducer written to {d} (replay: {command})", file=sys.stderr)


def given_config(config) -> dict:
    """The keys the user wrote, as a config file that loads back to the same config."""
    out = {key: getattr(config, key) for key in sorted(config.given)}
    if "calibration" in out:
        cal = config.calibration
        written = getattr(cal, "_given", None) or cal.__dict__.keys()
        out["calibration"] = {k: getattr(cal, k) for k in sorted(written) if not k.startswith("_")}
    return out
