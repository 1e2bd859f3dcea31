"""Measure the table of float-vs-int8 latency search-precision counts a promotion's cost in.

For every pattern of qpasses.analysis.op_costs (kind, input/output channels, positions), its
representative one-op model as qpasses leaves it float against its int8 QDQ form, one thread,
interleaved runs; picoseconds lost per multiply-accumulate. Writes qpasses/analysis/op_costs.json
(or ``--out``) with the machine it ran on; ``--repeats K`` keeps the median of K measurements.

    python tools/measure_op_costs.py [--repeats 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qpasses.analysis import op_costs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.3, help="of runs per pattern and measurement")
    ap.add_argument("--out", type=Path, default=op_costs.SHIPPED)
    args = ap.parse_args()
    table = {}
    for name in op_costs.grid():
        table[name] = round(statistics.median(op_costs.measure(name, args.seconds) for _ in range(args.repeats)), 2)
        print(f"{name:24s} {table[name]:8.2f} ps/MAC", flush=True)
    about = op_costs.machine() | {"date": datetime.date.today().isoformat(), "threads": 1, "repeats": args.repeats}
    args.out.write_text(json.dumps({"machine": about, "ps_per_mac": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
