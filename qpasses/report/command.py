"""`qpasses report float.onnx q.onnx --data eval.npz -o report.html`, and the page `run --html` writes."""
from __future__ import annotations

from pathlib import Path


def cmd_report(args) -> int:
    from ..calibration.data import open_data
    from ..cli.outputs import Staging, write_text
    from ..cli.paths import PathGuard
    from ..evaluation.objective import parse_metric
    from . import build

    from ..errors import QpassesError

    objective = parse_metric(args.metric)   # a bad spec stops here, before anything is read
    if args.samples < 1:
        raise QpassesError(f"--samples {args.samples}: give at least 1")
    guard = PathGuard()   # every path read and written, checked before any work (cli/paths.py)
    guard.read_file("float model", args.float_model)
    guard.read_file("quantized model", args.quant_model)
    guard.read_data("--data", args.data)
    guard.write_file("-o", args.output)
    guard.check()
    with Staging(guard) as staging:   # written whole once it is built, or not at all
        text = build(args.float_model, args.quant_model, open_data(args.data), objective=objective,
                     layer_samples=args.samples)
        write_text(staging.file(args.output, "-o"), text, Path(args.output))
        staging.commit()
    print(f"qpasses: wrote {args.output}")
    return 0


def add_parser(sub) -> None:
    rep = sub.add_parser("report", help="a self-contained HTML report: per-layer errors, plots, summary")
    rep.add_argument("float_model")
    rep.add_argument("quant_model")
    rep.add_argument("--data", required=True, help="input data (.npz, folder)")
    rep.add_argument("-o", "--output", required=True, help="the .html file to write")
    rep.add_argument("--metric", help="objective per output component: snr (default), cosine, top1, module:function")
    rep.add_argument("--samples", type=int, default=8, help="feeds for the per-layer numbers (default 8)")
    rep.set_defaults(func=cmd_report)
