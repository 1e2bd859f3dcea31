"""The `qpasses` command line: run (alias quantize) | check | passes | explain | example | compare | report.

This module builds the parser and dispatches; each command lives in its own module (run.py,
preflight.py: check, passes.py, explain.py, examples.py: example, compare.py, report/command.py),
imported only when that command runs.

Exit codes: 0 success, 2 user error (one line on stderr), 1 internal error. A reader that closes
stdout early (`qpasses passes | head -1`) ends the command quietly (exit 0).
"""
from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys

from ..errors import QpassesError, TargetNotMet
from .outputs import discard_open
from .process import error_line, guarded, interrupted_line


def main(argv=None) -> int:
    # the process ends after the command: the interpreter's final garbage collections would only
    # walk every object the run made (60-90 ms after a 600 KB model); frozen, they are left to the OS
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
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
                     help="high: reconstruct the weights against the quantized model's inputs (AdaRound) instead "
                          "of rounding them against the float model's (config effort; ppocr_v4_rec +0.03 decoded "
                          "text at 1.6x the default's time, ddddocr_det 3.3x for no gain: docs/configuration.md)")
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
    run.set_defaults(func=_run)

    chk = sub.add_parser("check", help="before calibrating: what quantizing a model will do (exit 2: it cannot)")
    chk.add_argument("model")
    chk.add_argument("--config", help="quantization config (JSON or YAML)")
    chk.set_defaults(func=_check)

    from ..report.command import add_parser as add_report

    add_report(sub)
    ls = sub.add_parser("passes", help="list every registered pass")
    ls.set_defaults(func=_passes)

    ex = sub.add_parser("explain", help="why a tensor is quantized the way it is")
    ex.add_argument("model")
    ex.add_argument("--tensor", help="tensor name (default: every quantized tensor)")
    ex.set_defaults(func=_explain)

    exm = sub.add_parser("example", help="write the bundled example model and calibration data to a folder")
    exm.add_argument("folder")
    exm.add_argument("--force", action="store_true", help="replace model.onnx, calib.npz and eval.npz if there")
    exm.set_defaults(func=_example)

    cmp_ = sub.add_parser("compare", help="SNR and max error of a quantized model against the float one")
    cmp_.add_argument("float_model")
    cmp_.add_argument("quant_model")
    cmp_.add_argument("--data", required=True, help="input data (.npz, folder)")
    cmp_.add_argument("--metric", help=_METRIC_HELP)
    from ..report.compare_command import add_arguments as add_per_layer

    add_per_layer(cmp_)   # --per-layer, --provider, --report, --samples (report/compare_command.py)
    cmp_.set_defaults(func=_compare)
    return p


_METRIC_HELP = ("objective per output component: snr (default), cosine, top1, or module:function "
                "(metric(float_outputs, quant_outputs) -> float, higher is better)")


def _version() -> str:
    from .. import __version__

    return __version__


# each command's module is imported when that command runs (inside process.guarded, as its work)
def _run(args) -> int:
    from .run import cmd_run

    return cmd_run(args)


def _check(args) -> int:
    from .preflight import cmd_check

    return cmd_check(args)


def _passes(args) -> int:
    from .passes import cmd_passes

    return cmd_passes(args)


def _explain(args) -> int:
    from .explain import cmd_explain

    return cmd_explain(args)


def _example(args) -> int:
    from .examples import cmd_example

    return cmd_example(args)


def _compare(args) -> int:
    from .compare import cmd_compare

    return cmd_compare(args)


if __name__ == "__main__":
    sys.exit(main())
