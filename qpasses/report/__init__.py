"""The self-contained HTML report of a quantized model (``qpasses report``, ``qpasses run --html``).

``layers`` measures every quantized activation against the float model, ``svg`` draws the plots
by hand, ``html`` lays out the page; ``build`` puts them together.
"""
from __future__ import annotations

from pathlib import Path

LAYER_SAMPLES = 8    # feeds for the per-layer numbers (report, compare --per-layer): every quantized activation is fetched
EVAL_SAMPLES = 32    # feeds for the output SNR and objective (as qpasses run)


def build(float_model, qdq_model, data, *, objective=None, run_report: dict | None = None,
          layer_samples: int = LAYER_SAMPLES) -> str:
    """The report page for a float model and its QDQ model (paths or QModels) on ``data`` (a
    path or CalibrationData). ``run_report``: what ``qpasses run`` knows besides (time per pass)."""
    from ..analysis.saturation import qdq_layers, risks
    from ..calibration.data import open_data
    from ..evaluation.evaluate import Reference
    from ..evaluation.objective import parse_metric
    from ..evaluation.summary import kept_float, summary_line
    from ..ir.decisions import PAIR_SUMS, float_reasons
    from ..ir.model import load
    from . import html, layers

    names = [str(m) if isinstance(m, (str, Path)) else "(in memory)" for m in (float_model, qdq_model)]
    if run_report and run_report.get("output"):   # `run --html` reads the staged file: name its destination
        names[1] = str(run_report["output"])
    fmodel = float_model if not isinstance(float_model, (str, Path)) else load(float_model)
    qmodel = qdq_model if not isinstance(qdq_model, (str, Path)) else load(qdq_model)
    objective = objective or parse_metric(None)
    data = open_data(data)
    reference = Reference.run(fmodel, data, EVAL_SAMPLES)   # the data checked as `qpasses compare` checks it
    feeds = reference.feeds
    if objective.components is None:
        objective = objective.for_model(fmodel)
    accuracy = reference.score(qmodel, objective=objective)
    qproto = qmodel.to_proto(metadata=False)
    rows = layers.layers(fmodel, qmodel, feeds[:layer_samples])
    paired = qdq_layers(qmodel)
    info = {"model": Path(names[1]).name, "float": names[0], "quantized": names[1],
            "data": str(getattr(data, "source", "") or "data"), "accuracy": accuracy,
            "objective": accuracy.get("objective"), "headline": objective.headline(accuracy, f" over {accuracy['samples']} samples"),
            "layer_samples": min(layer_samples, len(feeds)),
            "summary": summary_line(qproto, float_reasons(qmodel)), "decisions": qmodel.decisions,
            "floats": kept_float(qproto, float_reasons(qmodel)), "floats_recorded": len(float_reasons(qmodel)),
            "passes": (run_report or {}).get("passes"), "vs_onnxruntime": (run_report or {}).get("vs_onnxruntime"),
            "spread": objective.spread_note(accuracy),
            "pair_sums": {"checked": len(paired), "risks": risks(paired), "record": qmodel.decisions.get(PAIR_SUMS)}}
    return html.page(info, rows, layers.precision_cells(qproto))
