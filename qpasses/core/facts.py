"""The facts a model can carry, each with the checker `--verify-each` and the end of a pipeline run.

A fact says that a decision in the saved model holds for the graph as it is now. Facts have a safe
default (pipeline.PassManager): a pass that changes the model keeps only those it ``preserves``.
A fact exists because some pass ``requires`` it, or because it is a claim: the rewrite a pass
reports (weights quantized, converts inserted), registered with ``claim`` by the pass that makes
it, so that a reported rewrite missing from the graph fails the run instead of passing as done.
"""
from __future__ import annotations

import math

from ..analysis.ranges import tensors_needing_ranges
from ..errors import ModelError
from ..ir.decisions import float_reasons
from ..ir.model import QModel
from ..quant.oprules import QDQ_OPS
from ..quant.qdq import keeps_float_input
from ..quant.qtypes import qtype



def _types_annotated(model: QModel) -> list[str]:
    tensors = model.tensors()
    problems = [f"table entry '{name}' names no tensor of the graph" for name in model.quant if name not in tensors]
    for name, tq in model.quant.items():
        for dep in ([tq.shares] if tq.shares else []) + list(tq.derived_from or []):
            if dep not in model.quant:
                problems.append(f"table entry '{name}' refers to '{dep}', which has no entry")
    return problems


def _calibrated(model: QModel) -> list[str]:
    needed = tensors_needing_ranges(model)
    missed = set(model.decisions.get("calibration", {}).get("unobserved", ()))   # bodies that never ran
    problems = [f"'{name}' needs a calibrated range and has none" for name in sorted(needed or ())
                if name not in model.ranges and name not in missed]
    for name, (lo, hi) in model.ranges.items():
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            problems.append(f"calibrated range of '{name}' is not a finite [min, max]: [{lo}, {hi}]")
    return problems


def _qparams_computed(model: QModel) -> list[str]:
    problems = []
    for name, tq in model.quant.items():
        if not tq.scale or tq.zero_point is None or len(tq.scale) != len(tq.zero_point):
            problems.append(f"'{name}' has no scale/zero point")
            continue
        if not all(math.isfinite(s) and s > 0 for s in tq.scale):
            problems.append(f"'{name}' has a scale that is not finite and positive")
        qt = qtype(tq.qtype)
        if not all(qt.qmin <= z <= qt.qmax for z in tq.zero_point):
            problems.append(f"'{name}' has a zero point outside {tq.qtype}")
    return problems


def _qdq_inserted(model: QModel) -> list[str]:
    """Every entry in the table is read through Q/DQ: a DequantizeLinear writes it (a graph output,
    a merged Relu), or no other node reads its float tensor but a Conv/Gemm whose weight stayed
    float (qdq.keeps_float_input), unless a pass recorded why it stays float (a bias fed as an input)."""
    tensors, kept = model.tensors(), float_reasons(model)
    problems = []
    for name in model.quant:
        t = tensors.get(name)
        if t is None or name in kept or (t.inputs and t.inputs[0].op == "DequantizeLinear"):
            continue
        readers = [n for n in t.outputs if n.op not in QDQ_OPS and not keeps_float_input(n, t)]
        if readers:
            problems.append(f"'{name}' is in the quantization table but node '{readers[0].name}' "
                            f"({readers[0].op}) reads it without Q/DQ")
    return problems


CHECKERS = {
    "types-annotated": _types_annotated,
    "calibrated": _calibrated,
    "qparams-computed": _qparams_computed,
    "qdq-inserted": _qdq_inserted,
}
# facts that say a rewrite a pass reported is in the graph, registered by ``claim``. Unlike the
# facts passes require, a claim outlives the passes after it (the safe default for a claim is to
# keep checking it), unless a pass declares it ``invalidates`` it. qdq-inserted is a claim too, but
# one later passes require: it keeps the safe default of the facts.
CLAIMS: set[str] = set()


def claim(fact: str):
    """Decorator: register ``checker(model) -> [problem, ...]`` for the rewrite a pass claims with ``fact``."""
    def register(checker):
        CHECKERS[fact] = checker
        CLAIMS.add(fact)
        return checker
    return register


def fact_problems(model: QModel) -> tuple[str, str] | None:
    """(fact, one line) for the first carried fact that does not hold, else None."""
    if model.facts - CHECKERS.keys():   # a claim read from a saved model: its pass registers the checker
        from .registry import all_passes

        all_passes()
    for fact in sorted(model.facts & CHECKERS.keys()):   # others (older saves) are read by no pass
        problems = CHECKERS[fact](model)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            return fact, f"fact '{fact}' does not hold: {problems[0]}{more}"
    return None


def check_facts(model: QModel) -> None:
    """Run the checker of every fact the model carries; a ModelError names the first failing ones."""
    failed = fact_problems(model)
    if failed:
        raise ModelError(failed[1])
