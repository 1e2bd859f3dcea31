"""`qpasses run` (alias quantize): load, run the pipeline, save the output once onnxruntime loads it,
measure it in that session, and commit every file together at the end (outputs.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import PassFailure, QpassesError, TargetNotMet
from ..ir.model import relaxed_gc


@relaxed_gc()   # as the pipeline: its own steps and the modules it imports build long-lived objects
def cmd_run(args) -> int:
    from ..api import run_pipeline
    from ..core.context import RunContext
    from ..core.instruments import DumpAfter, Reproducer, TimePasses
    from ..core.pipeline import default_pipeline, parse_pipeline
    from ..evaluation.evaluate import compare, eval_reference
    from ..evaluation.integer_kernels import worth_counting
    from ..evaluation.objective import format_db, parse_metric
    from ..evaluation.summary import shortfall
    from ..ir.decisions import float_reasons
    from ..ir.model import load
    from .outputs import PREFIX, Staging, check_loads, ort_source, save_staged, strict_json, write_text
    from .paths import escape, guard_run
    from .scores import objective_lines

    src, out = Path(args.model), Path(args.output)
    if args.quiet:
        os.environ["QPASSES_NO_PROGRESS"] = "1"
    # every path read and written, checked before any work (paths.py); the pipeline text too
    guard = guard_run(args, [p.name for p in parse_pipeline(args.passes or default_pipeline(args.calib is not None, effort=args.effort or "default"))])
    objective = parse_metric(args.metric)  # a bad spec stops here, before anything is written
    if args.html and not args.calib:
        raise QpassesError("--html reports on a quantized model: give --calib")
    if args.vs_onnxruntime and not args.calib:
        raise QpassesError("--vs-onnxruntime compares with onnxruntime's quantization of the same data: give --calib")
    notes: list[str] = []   # printed once everything is written: a failure prints one line only
    say = (lambda *a: None) if args.quiet else (lambda *a: notes.append(" ".join(map(str, a))))
    timer = TimePasses()
    model = load(src)
    guard.read_files("model's external data", getattr(model, "external_files", ()))
    guard.check()
    staging = Staging(guard)   # outputs go to temporary folders beside their targets (outputs.py)
    dump = DumpAfter(staging.folder(args.dump_after, "--dump-after")) if args.dump_after else None
    repro = Reproducer(args.reproducer, write_to=staging.folder(args.reproducer, "--reproducer"),
                       announce=False) if args.reproducer else None
    # --eval: the float model's outputs on the samples the SNR line uses, computed now (the data is
    # checked before any work, and the float model needs no second session)
    eval_data, reference = _eval_reference(args.eval, src) if args.eval else (None, None)
    ctx = RunContext(args.config, args.calib)
    if args.target:
        _apply_target(ctx, args.target)
    if args.effort:
        ctx.config.effort = args.effort
        ctx.config._given = ctx.config.given | {"effort"}
    if args.executor:   # checked here (one line, nothing written); Ray is reached when a pass needs it
        from ..executors import parse

        parse(args.executor)
        ctx.config.executor = args.executor
    try:
        model, records = run_pipeline(model, args.passes, ctx=ctx, verify_each=args.verify_each,
                                      dump_after=dump, reproducer=repro, time_passes=timer, notify=say)
    except (QpassesError, PassFailure) as exc:   # the reproducer alone is committed, named on the error line
        if repro is not None and repro.written:
            staging.commit({"--reproducer"})
            exc.args = (f"{exc}; reproducer written to {args.reproducer} "
                        f"(replay: {Path(args.reproducer) / 'command.txt'})",)
        elif repro is not None and repro.error:
            exc.args = (f"{exc}; {repro.error}",)
        raise
    findings = ctx.findings.as_dict()
    search = model.decisions.get("precision_search", {})
    if search and not search.get("met", True):
        line = f"search-precision {shortfall(search)}"
        if args.require_target:
            raise TargetNotMet(f"{line} (--require-target: nothing written)")
        say(f"qpasses: warning: {line}")
    staged = staging.file(out, "-o")
    proto = model.to_proto()   # exported once: saved, summarised
    # the graph onnxruntime optimizes, for the summary's kernel count (a staging name: never committed)
    optimized = staged.parent / f"{PREFIX}optimized.onnx" if worth_counting(proto) else None
    save_staged(proto, staged, out)
    # onnxruntime loads it (default optimizations), or nothing is written; the SNR line runs in this session
    session = check_loads(staged, out, src, optimized_to=optimized)
    report = {"input": str(src), "output": str(out),
              "pipeline": ",".join(r.text for r in records),
              "passes": [{"pass": r.text, "modified": r.modified, "seconds": round(r.seconds, 4),
                          "stats": r.stats} for r in records],
              "facts": sorted(model.facts), "decisions": model.decisions, "findings": findings,
              "unquantized": [{"tensor": name, **row} for name, row in float_reasons(model).items()]}
    selected = findings.get("select-by-snr", {})
    if selected.get("variants"):
        total = selected["samples"]
        scores = ", ".join(f"{v['variant']} {format_db(v['snr_db'])}"
                           + (f" [clearly behind: stopped after {v['samples']}]" if v.get("dropped") else
                              f" [clearly ahead after {v['samples']}]" if v.get("samples", total) < total else "")
                           for v in selected["variants"])
        say(f"qpasses: select-by-snr chose {selected['chosen']} ({scores}; {total} calibration samples)")
    data = eval_data or ctx.calibration_data
    if data is not None and ("qdq-inserted" in model.facts or ctx.config.mode != "static"):
        if reference is None:   # the calibration data: its float outputs calibrate kept, if it did
            reference = eval_reference(ort_source(src), data, _EVAL_SAMPLES, _kept_float_outputs(ctx, records))
        # a failing user metric is a user error: nothing is committed (as for every failure)
        report["accuracy"] = compare(ort_source(src), session or ort_source(staged), data, objective=objective,
                                     reference=reference)
        spread = objective.spread_note(report["accuracy"])
        report["objective"] = report["accuracy"].pop("objective", None)
        over = f" over {_samples_text(report['accuracy']['samples'], data)}"
        say(f"qpasses: {objective.headline(report['accuracy'] | {'objective': report['objective']}, over)}{spread}")
        for line in objective_lines(objective, report["accuracy"], report["objective"], always=False, overall=False):
            say(f"qpasses: {line}")
    if "types-annotated" in model.facts or "qdq-inserted" in model.facts:
        from ..evaluation.summary import run_summary

        report["summary"], report["integer_kernels"] = run_summary(model, float_reasons(model), proto, optimized)
        say(f"qpasses: {report['summary']}")
    del session, proto
    if args.vs_onnxruntime:   # a comparison, not the output: a failure is a warning naming onnxruntime's reason
        from ..errors import first_line
        from ..evaluation.vs_ort import compare as versus, line

        try:
            report["vs_onnxruntime"] = versus(src, staged, ctx.calibration_data)
            say(f"qpasses: {line(report['vs_onnxruntime'])}")
        except Exception as exc:   # onnxruntime's quantizer raises anything
            say(f"qpasses: warning: --vs-onnxruntime: onnxruntime's quantize_static failed ({first_line(exc)})")
    if args.time_passes:
        say(timer.table())
    if args.html:   # the per-layer page, on the data the SNR line used
        from ..report import build

        write_text(staging.file(args.html, "--html"), build(src, staged, eval_data or ctx.calibration_data,
                   objective=objective, run_report=report), Path(args.html))
    if args.report:   # strict JSON: NaN is null, infinities are "inf" / "-inf" (outputs.py)
        write_text(staging.file(args.report, "--report"), strict_json(report), Path(args.report))
    staging.commit()
    if staging.cleanup_error:
        say(f"qpasses: warning: {staging.cleanup_error}")
    say(f"qpasses: wrote {out}")
    for note in notes:   # control characters and bytes that are not UTF-8 escaped (paths, names)
        print("\n".join(escape(line) for line in note.splitlines()), file=sys.stderr)
    return 0


def _apply_target(ctx, text: str) -> None:
    """--target METRIC=VALUE into the run's config (accuracy.metric, accuracy.target)."""
    from ..config.quant_config import ACCURACY_METRICS

    metric, eq, value = text.partition("=")
    try:
        target = float(value)
    except ValueError:
        target = None
    if not eq or metric not in ACCURACY_METRICS or target is None or target != target:
        raise QpassesError(f"--target '{text}': expected METRIC=VALUE with METRIC one of "
                           f"{', '.join(ACCURACY_METRICS)} (e.g. snr=25, cosine=0.995, top1=0.99)")
    ctx.config.accuracy.metric, ctx.config.accuracy.target = metric, target
    ctx.config._given = ctx.config.given | {"accuracy"}



def _eval_reference(source, model_path):
    """Open --eval data and run the float model on the samples the report uses (checked against
    the inputs its onnxruntime session takes, as compare does), before anything is written:
    (the data, the evaluate.Reference)."""
    from ..calibration.data import open_data
    from ..evaluation.evaluate import Reference, session
    from .outputs import ort_source

    data = open_data(source)
    return data, Reference.run(session(ort_source(model_path)), data, _EVAL_SAMPLES)


def _kept_float_outputs(ctx, records):
    """The float outputs calibrate kept (KeptSamples) when they are the input model's on the first
    calibration samples: kept from ``ctx.calibration_data``, after passes that each keep the float
    model's outputs (evaluate.FLOAT_EXACT_PASSES); else None."""
    from ..calibration.kept import KeptSamples
    from ..evaluation.evaluate import FLOAT_EXACT_PASSES

    kept = ctx.cache.get(KeptSamples.CACHE_KEY)
    if kept is None or kept.source is not ctx.calibration_data:
        return None
    before = [r.name for r in records[:next((i for i, r in enumerate(records) if r.name == "calibrate"), 0)]]
    return kept if all(name in FLOAT_EXACT_PASSES for name in before) else None


def _samples_text(samples: int, data) -> str:
    """'32 samples', or '32 of 64 samples' when the evaluation stopped at _EVAL_SAMPLES."""
    count = getattr(data, "count", None)
    return f"{samples} of {count} samples" if count and count > samples else f"{samples} samples"


_EVAL_SAMPLES = 32   # the SNR line's samples at most (the first ones of the data)

