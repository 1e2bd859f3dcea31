"""`qpasses compare`: SNR and max error of a quantized model against the float one (--per-layer:
report/compare_command.py)."""
from __future__ import annotations


def cmd_compare(args) -> int:
    from ..calibration.data import open_data
    from ..evaluation.evaluate import compare
    from ..evaluation.objective import format_db, parse_metric
    from ..ir.model import load
    from .scores import objective_lines

    if args.per_layer or args.provider or args.report or args.samples is not None:
        from ..report.compare_command import cmd_per_layer

        return cmd_per_layer(args)
    objective = parse_metric(args.metric)
    models = [load(path) for path in (args.float_model, args.quant_model)]  # one-line errors naming the file
    result = compare(*models, open_data(args.data), objective=objective)
    for name, row in result["outputs"].items():
        print(f"{name}: SNR {format_db(row['snr_db'])}, max abs error {row['max_abs_error']:.6g}")
    for line in objective_lines(objective, result, result.get("objective"), always=True):
        print(line.strip() if line.startswith("  ") else line)
    print(f"samples: {result['samples']}{objective.spread_note(result)}")
    return 0
