"""The `qpasses` command line: run (alias quantize) | check | passes | explain | compare | report.

Exit codes: 0 success, 2 user error (one line on stderr), 1 internal error. A reader that closes
stdout early (`qpasses passes | head -1`) ends the command quietly (exit 0).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import PassFailure, QpassesError, TargetNotMet
from .outputs import discard_open
from .process import error_line, guarded, interrupted_line


def main(argv=None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a reader that went away (`qpasses passes | head -1`) shows here
    except BrokenPipeError:  # stop quietly, as head, grep -q and less expect
        _drop_stdout()
        return 0


def _drop_stdout() -> None:
    """Point stdout at devnull so that the interpreter's final flush does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _main(argv) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:   # signals interrupt it, onnxruntime's log is silenced, what it staged is removed (process.py)
        return guarded(args.func, args, discard_open, debug=_debug(args))
    except TargetNotMet as exc:
        print(f"qpasses: error: {exc}", file=sys.stderr)
        return 3
    except QpassesError as exc:
        print(error_line(exc, internal=False), file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:   # SIGINT, SIGTERM, SIGHUP (process.py): nothing was written
        line, code = interrupted_line(exc)
        print(line, file=sys.stderr)
        return code
    except BrokenPipeError:
        raise
    except Exception as exc:  # an internal error (PassFailure, ...): one line, traceback only on request
        debug = _debug(args)
        if debug:
            import traceback

            traceback.print_exc()
        print(error_line(exc, internal=True, hint=not debug), file=sys.stderr)
        return 1


def _debug(args) -> bool:
    return bool(getattr(args, "traceback", False) or os.environ.get("QPASSES_TRACEBACK"))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, exit 2
        self.exit(2, f"qpasses: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="qpasses", description="Quantize float ONNX models to QDQ with composable passes.")
    p.add_argument("--version", action="version", version=f"qpasses {_version()}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    run = sub.add_parser("run", aliases=["quantize"], help="run a pipeline on a model (alias: quantize)")
    run.add_argument("model", help="input .onnx model (never modified)")
    run.add_argument("-o", "--output", required=True, help="output .onnx path")
    run.add_argument("--passes", help="pipeline text, e.g. 'fold-constants,cleanup' (default: the "
                                      "default pipeline; it quantizes when --calib is given)")
    run.add_argument("--config", help="quantization config (JSON or YAML)")
    run.add_argument("--calib", help="calibration data: .npz, folder of .npz, or ONNX test-data folder")
    run.add_argument("--eval", help="data to measure the output SNR on (default: the calibration data)")
    run.add_argument("--metric", help=_METRIC_HELP)
    run.add_argument("--report", help="write a JSON run report here")
    run.add_argument("--html", help="write the HTML report here (per-layer errors and plots; needs --calib)")
    run.add_argument("--verify-each", choices=("structure", "checker", "ort", "reload"),
                     help="check the IR and the model's facts after every pass (reload: also continue "
                          "from the saved form of the model after each pass)")
    run.add_argument("--dump-after", metavar="DIR", help="save the model after every pass as DIR/NNN_<pass>.onnx")
    run.add_argument("--reproducer", metavar="DIR", help="on failure, save the failing pass's input and the rest of the pipeline")
    run.add_argument("--effort", choices=("default", "high"),
                     help="high: reconstruct the weights against the quantized model's inputs (AdaRound; "
                          "config effort; 3-5x the default's time)")
    run.add_argument("--target", metavar="METRIC=VALUE",
                     help="accuracy target for search-precision: snr=25 (dB), cosine=0.995, top1=0.99 "
                          "(the worst output component, less one standard error, must reach it on calibration feeds)")
    run.add_argument("--require-target", action="store_true",
                     help="exit 3 (writing nothing) when the target cannot be met")
    run.add_argument("--executor", metavar="local|ray[:ADDRESS]",
                     help="where calibration shards and scored variants run (default: config "
                          "executor, local); ray needs pip install 'qpasses[ray]'")
    run.add_argument("--vs-onnxruntime", action="store_true",
                     help="also quantize with onnxruntime's quantize_static (QDQ, U8S8 per-channel MinMax) on the "
                          "same data and print the output's latency and size against that model")
    run.add_argument("--time-passes", action="store_true", help="print seconds per pass")
    run.add_argument("--quiet", action="store_true", help="print nothing but errors")
    run.add_argument("--traceback", action="store_true", help="show a traceback on internal errors")
    run.set_defaults(func=cmd_run)

    chk = sub.add_parser("check", help="before calibrating: what quantizing a model will do (exit 2: it cannot)")
    chk.add_argument("model")
    chk.add_argument("--config", help="quantization config (JSON or YAML)")
    chk.set_defaults(func=cmd_check)

    from ..report.command import add_parser as add_report

    add_report(sub)
    ls = sub.add_parser("passes", help="list every registered pass")
    ls.set_defaults(func=cmd_passes)

    ex = sub.add_parser("explain", help="why a tensor is quantized the way it is")
    ex.add_argument("model")
    ex.add_argument("--tensor", help="tensor name (default: every quantized tensor)")
    ex.set_defaults(func=cmd_explain)

    exm = sub.add_parser("example", help="write the bundled example model and calibration data to a folder")
    exm.add_argument("folder")
    exm.add_argument("--force", action="store_true", help="replace model.onnx, calib.npz and eval.npz if there")
    exm.set_defaults(func=cmd_example)

    cmp_ = sub.add_parser("compare", help="SNR and max error of a quantized model against the float one")
    cmp_.add_argument("float_model")
    cmp_.add_argument("quant_model")
    cmp_.add_argument("--data", required=True, help="input data (.npz, folder)")
    cmp_.add_argument("--metric", help=_METRIC_HELP)
    from ..report.compare_command import add_arguments as add_per_layer

    add_per_layer(cmp_)   # --per-layer, --provider, --report, --samples (report/compare_command.py)
    cmp_.set_defaults(func=cmd_compare)
    return p


_METRIC_HELP = ("objective per output component: snr (default), cosine, top1, or module:function "
                "(metric(float_outputs, quant_outputs) -> float, higher is better)")


def _version() -> str:
    from .. import __version__

    return __version__


def cmd_run(args) -> int:
    from ..api import run_pipeline
    from ..core.context import RunContext
    from ..core.instruments import DumpAfter, Reproducer, TimePasses
    from ..core.pipeline import default_pipeline, parse_pipeline
    from ..evaluation.evaluate import compare, eval_reference
    from ..evaluation.integer_kernels import worth_counting
    from ..evaluation.objective import parse_metric
    from ..evaluation.summary import shortfall
    from ..ir.decisions import float_reasons
    from ..ir.model import load
    from .outputs import PREFIX, Staging, check_loads, ort_source, save_staged, strict_json, write_text
    from .paths import escape, guard_run

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
        scores = ", ".join(f"{v['variant']} {_fmt_db(v['snr_db'])}"
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
        for line in _objective_lines(objective, report["accuracy"], report["objective"], always=False, overall=False):
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


def _objective_lines(objective, accuracy: dict, summary: dict | None, *, always: bool,
                     overall: bool = True) -> list[str]:
    """One line per output component (in the objective's metric; for a user metric, the SNR of
    split outputs), then the overall objective (unless not ``overall``: run's headline says it).
    The component lines appear when an output is split or the metric is not snr (otherwise the
    per-output SNR says it all); the overall line then, for a user metric, or ``always``."""
    if not summary:
        return []
    split = any(len(names) > 1 for names in summary["outputs"].values())
    per_component = split or (objective.builtin and objective.metric != "snr")
    if not (per_component or always or not objective.builtin):
        return []
    scores = summary["components"] if objective.builtin else accuracy.get("components", {})
    show = objective if objective.builtin else objective.with_metric("snr")
    lines = []
    for name, value in scores.items() if per_component else ():
        where = summary["slices"].get(name)
        lines.append(f"  {name}: {show.format(value)}" + (f" ({where})" if where else ""))
    if not overall:
        return lines
    line = f"objective: {objective.format(summary['overall'])}"
    if objective.builtin and scores:
        line += f" (worst component {min(scores, key=scores.get)})"
    return lines + [line]


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


def _fmt_db(value: float) -> str:
    from ..evaluation.objective import format_db

    return format_db(value)


def cmd_check(args) -> int:
    from .paths import escape
    from .preflight import check

    result = check(args.model, args.config)
    print("\n".join(escape(line) for line in result.lines))
    if result.ok:
        return 0
    more = f" (and {len(result.problems) - 1} more, above)" if len(result.problems) > 1 else ""
    print(escape(f"qpasses: error: {args.model} cannot be quantized: {result.problems[0]}{more}"), file=sys.stderr)
    return 2


def cmd_passes(args) -> int:
    from ..core.pipeline import in_pipeline_order

    for cls in in_pipeline_order():  # default pipeline order, then the rest by name
        print(f"{cls.name}: {cls.summary()}")
        for f in cls.options():
            print(f"    {f.name} = {_default_text(f)}  {f.metadata.get('help', '')}".rstrip())
        if cls.requires:
            print(f"    requires: {', '.join(sorted(cls.requires))}")
        if cls.establishes:
            print(f"    establishes: {', '.join(sorted(cls.establishes))}")
        if cls.preserves:
            print(f"    preserves: {', '.join(sorted(cls.preserves))}")
    return 0


def _default_text(f) -> str:
    from ..core.pipeline import format_value, option_default

    return format_value(option_default(f))


def cmd_explain(args) -> int:
    from ..ir.model import load
    from .explain import explain_lines

    model = load(args.model)
    for line in explain_lines(model, args.tensor):
        print(line)
    return 0


def cmd_example(args) -> int:
    from .examples import write_example

    model, calib, evald = write_example(args.folder, force=args.force)
    print(f"wrote {model}, {calib}, {evald}\n"
          f"next: qpasses run {model} -o {Path(args.folder) / 'model.qdq.onnx'} --calib {calib} --eval {evald}")
    return 0


def cmd_compare(args) -> int:
    from ..calibration.data import open_data
    from ..evaluation.evaluate import compare
    from ..evaluation.objective import parse_metric
    from ..ir.model import load

    if args.per_layer or args.provider or args.report or args.samples is not None:
        from ..report.compare_command import cmd_per_layer

        return cmd_per_layer(args)
    objective = parse_metric(args.metric)
    models = [load(path) for path in (args.float_model, args.quant_model)]  # one-line errors naming the file
    result = compare(*models, open_data(args.data), objective=objective)
    for name, row in result["outputs"].items():
        print(f"{name}: SNR {_fmt_db(row['snr_db'])}, max abs error {row['max_abs_error']:.6g}")
    for line in _objective_lines(objective, result, result.get("objective"), always=True):
        print(line.strip() if line.startswith("  ") else line)
    print(f"samples: {result['samples']}{objective.spread_note(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
