"""Python API: load, run a pipeline, save."""
from __future__ import annotations

import sys

from .context import RunContext
from .instruments import DumpAfter, Instrument, Reproducer, TimePasses, VerifyEach
from .ir import QModel, load
from .pipeline import PassManager, default_pipeline
from .prechecks import LoadableTypes, QuantizableValues
from .upgrade import prepare_opset, quantizes


def run_pipeline(model, passes: str | list | None = None, *, config=None, calibration_data=None,
                 verify_each: str | None = None, dump_after=None, reproducer=None,
                 time_passes: TimePasses | None = None, ctx: RunContext | None = None, notify=None):
    """Run ``passes`` (text or Pass list; default: the default pipeline) on a model.

    ``model`` is a path, ModelProto or QModel (edited in place). ``calibration_data`` is a path
    (.npz, folder) or any iterable of ``{input_name: array}`` dicts or a CalibrationDataReader.
    ``dump_after`` and ``reproducer`` are folders (or instruments writing elsewhere, as the CLI's
    staged ones). A quantizing pipeline first refuses what would give a broken model (prechecks.py).
    ``notify(line)`` receives notices (default: printed on stderr).
    Give ``ctx`` (a RunContext, instead of config and data) to read the findings afterwards.
    Returns ``(model, records)``.
    """
    if not isinstance(model, QModel):
        model = load(model)
    if ctx is None:
        ctx = RunContext(config, calibration_data)
    elif config is not None or calibration_data is not None:
        raise ValueError("run_pipeline: give the config and calibration data either to the RunContext or here")
    if passes is None:
        passes = default_pipeline(ctx.calibration_data is not None, ctx.config.mode, ctx.config.format)
    instruments = []
    if time_passes is not None:
        instruments.append(time_passes)
    if verify_each:
        instruments.append(VerifyEach(verify_each))
    if dump_after:
        instruments.append(dump_after if isinstance(dump_after, Instrument) else DumpAfter(dump_after))
    if reproducer:
        instruments.append(reproducer if isinstance(reproducer, Instrument) else Reproducer(reproducer))
    manager = PassManager(passes, instruments)
    names = [p.name for p in manager.passes]
    if quantizes(names):   # refuse up front what would give a broken model (prechecks.py)
        manager.instruments[:0] = [QuantizableValues(), LoadableTypes(names)]
    # a quantizing pipeline upgrades opset < 10 to 11, as onnxruntime's quantizer does, and to 13 for
    # per-channel weights (upgrade.py)
    for notice in prepare_opset(model, ctx.config, names):
        (notify or (lambda line: print(line, file=sys.stderr)))(notice)
    records = manager.run(model, ctx)
    return model, records


def quantize(model, calibration_data, config=None, passes: str | None = None) -> QModel:
    """Quantize a float model to QDQ with the default pipeline (or ``passes``)."""
    return run_pipeline(model, passes, config=config, calibration_data=calibration_data)[0]
