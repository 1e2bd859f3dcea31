"""Output SNR without and with the correct-bias pass, per benchmark model and activation type.

    /tmp/venv/bin/python tools/bench_correct_bias.py [--models a,b] [--activations uint16,uint8]

Each model is quantized three times with the qpasses default config (only ``activation_type`` set)
on the 64 calibration samples of tools/models.py: without correct-bias, with it applied to every
layer (``activation_bits=8``; the default pipeline does the 16-bit ones), and scored (select-by-snr{bias_correction=true} scores both on the
calibration feeds and keeps the better). SNR is on the eval samples, min over outputs, as in bench_vs_ort.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models as bench_models  # noqa: E402

import qpasses  # noqa: E402
from qpasses.api import run_pipeline  # noqa: E402
from qpasses.core.context import RunContext  # noqa: E402
from qpasses.core.instruments import TimePasses  # noqa: E402
from qpasses.core.pipeline import QUANTIZE_PIPELINE  # noqa: E402
from qpasses.evaluation.evaluate import session, snr_db  # noqa: E402

FORCED = QUANTIZE_PIPELINE.replace("correct-bias,", "correct-bias{activation_bits=8},")   # every layer
WITHOUT = QUANTIZE_PIPELINE.replace("correct-bias,", "")
SCORED = FORCED.replace("select-by-snr", "select-by-snr{bias_correction=true}")


def output_snr(float_path: Path, quantized, evals: list[dict]) -> float:
    ref, test = session(str(float_path)), session(quantized)
    names = [o.name for o in ref.get_outputs()]
    pairs = [(ref.run(names, e), test.run(names, e)) for e in evals]
    return min(snr_db(np.concatenate([np.ravel(r[k]) for r, _ in pairs]).astype(np.float64),
                      np.concatenate([np.ravel(t[k]) for _, t in pairs]).astype(np.float64))
               for k in range(len(names)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=lambda s: [x for x in s.split(",") if x], default=None)
    ap.add_argument("--activations", default="uint16,uint8")
    ap.add_argument("--samples", type=int, default=64)
    args = ap.parse_args()
    names = args.models or [m for m in bench_models.DEFAULT_MODELS if m != "light_squeezenet"]
    print("| model | activations | without dB | always dB | gain dB | scored dB | select-by-snr's choice | correct-bias s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        try:
            bm = bench_models.prepare(name)
        except FileNotFoundError as exc:   # the corpus is not downloaded
            print(f"| {name} | skipped: {exc} |||||")
            continue
        evals = list(bm.samples("eval"))
        for act in args.activations.split(","):
            config = {"activation_type": act}
            snrs = []
            for passes in (WITHOUT, FORCED, SCORED):
                timer = TimePasses()
                ctx = RunContext(config, bm.samples("calib", args.samples))
                q, _ = run_pipeline(qpasses.load(str(bm.path)), passes, ctx=ctx, time_passes=timer)
                snrs.append(output_snr(bm.path, q.to_proto(), evals))
                if passes == FORCED:   # the pipeline's own pass (depth 0), not select-by-snr's trials
                    seconds = sum(row[1] for row in timer.rows if row[0].startswith("correct-bias") and not row[4])
            # the last run is SCORED: select-by-snr's findings say what it decided
            decision = ctx.findings.as_dict().get("select-by-snr", {}).get("bias_correction", {})
            choice = (f"{'kept' if decision['applied'] else 'refused'} ({decision['gain_db']:+.2f} dB on calib)"
                      if decision else "not scored")
            print(f"| {name} | {act} | {snrs[0]:.2f} | {snrs[1]:.2f} | {snrs[1] - snrs[0]:+.2f} | {snrs[2]:.2f} | "
                  f"{choice} | {seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
