"""Python API: load, run a pipeline, save."""
from __future__ import annotations

import sys

import numpy as np

from .core.context import RunContext
from .core.instruments import DumpAfter, Instrument, Reproducer, TimePasses, VerifyEach
from .core.pipeline import PassManager, default_pipeline
from .core.prechecks import LoadableTypes, QuantizableValues
from .ir.model import QModel, load
from .quant.upgrade import prepare_opset, quantizes


def run_pipeline(model, passes: str | list | None = None, *, config=None, calibration_data=None,
                 verify_each: str | None = None, dump_after=None, reproducer=None,
                 time_passes: TimePasses | None = None, ctx: RunContext | None = None, notify=None):
    """Run ``passes`` (text or Pass list; default: the default pipeline) on a model.

    ``model`` is a path, ModelProto or QModel (edited in place). ``calibration_data`` is a path
    (.npz, folder) or any iterable of ``{input_name: array}`` dicts or a CalibrationDataReader.
    ``dump_after`` and ``reproducer`` are folders (or instruments writing elsewhere, as the CLI's
    staged ones). A quantizing pipeline first refuses what would give a broken model (core/prechecks.py).
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
        passes = default_pipeline(ctx.calibration_data is not None, ctx.config.mode, ctx.config.format,
                                  ctx.config.effort)
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
    if quantizes(names):   # refuse up front what would give a broken model (core/prechecks.py)
        manager.instruments[:0] = [QuantizableValues(), LoadableTypes(names)]
    # a quantizing pipeline upgrades opset < 10 to 11, as onnxruntime's quantizer does, and to 13 for
    # per-channel weights (upgrade.py)
    for notice in prepare_opset(model, ctx.config, names):
        (notify or (lambda line: print(line, file=sys.stderr)))(notice)
    records = manager.run(model, ctx)
    return model, records


ONE_SHOT_BYTES = 2 * 2**30   # a one-shot source is read into memory up to this size, else refused


def quantize(model, calibration_data, config=None, passes: str | None = None) -> QModel:
    """Quantize a float model with the default pipeline of the config's mode (or ``passes``).

    ``calibration_data`` as for ``run_pipeline``. Several passes read the data again after
    calibrate (select-by-snr, search-precision's confirmation, round-weights): a one-shot source
    (a generator, a reader without ``rewind()``) is read once into memory up front (refused
    with the reason above ``ONE_SHOT_BYTES``). Notices (an opset upgraded) go to stderr, as
    ``run_pipeline``'s; ``model.summary`` holds what the command line would print besides (the
    8-bit share, the tensors kept float, a missed target, the notices).
    """
    notices: list[str] = []

    def notify(line: str) -> None:
        notices.append(line)
        print(line, file=sys.stderr)

    data = replayable(calibration_data)
    model, _ = run_pipeline(model, passes, config=config, calibration_data=data, notify=notify)
    model.summary = "\n".join(notices + run_summary_lines(model))
    return model


def quantize_static(model_input, model_output, calibration_data_reader, *, quant_format=None,
                    op_types_to_quantize=None, per_channel=None, reduce_range=None, activation_type=None,
                    weight_type=None, nodes_to_quantize=None, nodes_to_exclude=None,
                    use_external_data_format: bool = False, calibrate_method=None, calibration_providers=None,
                    extra_options=None, config=None) -> QModel:
    """onnxruntime's ``quantize_static`` call, done by qpasses: reads ``model_input``, calibrates on
    ``calibration_data_reader`` (a CalibrationDataReader: ``get_next()`` returns a feed dict, None
    at the end; or any source ``quantize`` takes) and writes ``model_output``. The keywords take
    onnxruntime's spellings and values (``QuantFormat.QDQ``, ``QuantType.QUInt8``,
    ``CalibrationMethod.MinMax``, ``extra_options`` keys such as ``ActivationSymmetric``); one left
    out keeps qpasses' default, not onnxruntime's. ``config``: more qpasses keys (a dict). Returns
    the QModel (``summary`` as for ``quantize``)."""
    from .errors import ConfigError
    from .ir.model import save

    if calibration_providers and any(p != "CPUExecutionProvider" for p in calibration_providers):
        raise ConfigError("quantize_static: qpasses calibrates with onnxruntime's CPUExecutionProvider only "
                          f"(calibration_providers={list(calibration_providers)})")
    keywords = {k: v for k, v in {
        "quant_format": quant_format, "op_types_to_quantize": op_types_to_quantize, "per_channel": per_channel,
        "reduce_range": reduce_range, "activation_type": activation_type, "weight_type": weight_type,
        "nodes_to_quantize": nodes_to_quantize, "nodes_to_exclude": nodes_to_exclude,
        "calibrate_method": calibrate_method, "extra_options": extra_options}.items() if v is not None}
    if keywords and config is not None and not isinstance(config, dict):
        raise ConfigError("quantize_static: give onnxruntime's keywords with a config dict, not a path or QuantConfig")
    if keywords or config is None:
        config = {**(config or {}), **keywords}
    model = quantize(model_input, calibration_data_reader, config)
    save(model, model_output, external_data=True if use_external_data_format else None)
    return model


def replayable(source):
    """``source`` if it can be read again (a path, a list, a reader with ``rewind()``); a one-shot
    generator or reader read once into a list of feeds (arrays copied: a reader may reuse its
    buffers); CalibrationDataError above ONE_SHOT_BYTES, with the reason."""
    from .calibration.data import open_data
    from .errors import CalibrationDataError

    data = open_data(source) if source is not None else None
    if data is None or data.rereadable:
        return source
    feeds, size = [], 0
    for feed in data:
        feeds.append({k: np.array(v) for k, v in feed.items()})
        size += sum(a.nbytes for a in feeds[-1].values())
        if size > ONE_SHOT_BYTES:
            raise CalibrationDataError(
                f"{data.source}: a one-shot source (a generator, or a reader without rewind()) is read into "
                f"memory because several passes read the calibration data again, and it holds more than "
                f"{ONE_SHOT_BYTES // 2**30} GB after {len(feeds)} samples: pass a path (.npz), a list, or a "
                f"reader with rewind()")
    return feeds


def run_summary_lines(model: QModel) -> list[str]:
    """What the command line prints about a quantized model without measuring it: the share of
    weighted ops in 8 bits and the tensors kept float (or the weights a weight-only run quantized),
    a target the search missed, and a search that kept most of the int8 speed-up float."""
    from .evaluation.summary import shortfall, slow_share, summary_line
    from .ir.decisions import float_reasons

    lines = []
    if "types-annotated" in model.facts or "qdq-inserted" in model.facts:
        lines.append(summary_line(model.to_proto(metadata=False), float_reasons(model)))
    elif model.decisions.get("weight_only"):
        lines.append(f"weight-only: {len(model.decisions['weight_only'])} weights quantized, "
                     f"{len(float_reasons(model))} left float")
    search = model.decisions.get("precision_search", {})
    if search and not search.get("met", True):
        lines.append(f"warning: search-precision {shortfall(search)}")
    if search and (slow := slow_share(search)):
        lines.append(f"warning: {slow}")
    return lines
