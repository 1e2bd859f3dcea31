"""The flags and command of `qpasses compare --per-layer` (the work is in provider.py; this module
imports nothing heavy, since the parser is built on every call of the CLI)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ..errors import QpassesError
from . import LAYER_SAMPLES as SAMPLES

PROVIDERS = ("ort-int8", "openvino")   # provider.PROVIDERS' keys


def add_arguments(parser) -> None:
    """The per-layer flags of `qpasses compare`."""
    parser.add_argument("--per-layer", action="store_true",
                        help="per quantized tensor, the provider's integers against the simulation's (LSBs)")
    parser.add_argument("--provider", choices=PROVIDERS, default=None,
                        help="with --per-layer: ort-int8 (default: onnxruntime CPU, all optimizations) or openvino (CPU)")
    parser.add_argument("--report", help="with --per-layer: also write the comparison as JSON here")
    parser.add_argument("--samples", type=int, default=None, help=f"with --per-layer: feeds to run (default {SAMPLES})")


def cmd_per_layer(args) -> int:
    from ..cli.outputs import Staging, strict_json, write_text
    from ..cli.paths import PathGuard, escape
    from .provider import compare_per_layer, table

    if not args.per_layer:
        raise QpassesError("--provider, --report and --samples go with --per-layer")
    if args.metric:
        raise QpassesError("--metric does not apply to --per-layer (it reports SNR and LSBs)")
    samples = SAMPLES if args.samples is None else args.samples
    if samples < 1:
        raise QpassesError(f"--samples {args.samples}: give at least 1")
    if args.provider == "openvino" and importlib.util.find_spec("openvino") is None:
        raise QpassesError("--provider openvino needs OpenVINO: pip install 'qpasses[openvino]'")
    guard = PathGuard()   # every path read and written, checked before any work (cli/paths.py)
    guard.read_file("float model", args.float_model)
    guard.read_file("quantized model", args.quant_model)
    guard.read_data("--data", args.data)
    if args.report:
        guard.write_file("--report", args.report)
    guard.check()
    result = compare_per_layer(args.float_model, args.quant_model, args.data,
                               provider=args.provider or "ort-int8", samples=samples)
    if args.report:
        with Staging(guard) as staging:
            write_text(staging.file(args.report, "--report"), strict_json(result), Path(args.report))
            staging.commit()
    print("\n".join(escape(line) for line in table(result)))
    sys.stdout.flush()
    return 0
