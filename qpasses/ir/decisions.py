"""Decisions saved with the model that more than one pass writes (``QModel.decisions``)."""
from __future__ import annotations

from .model import QModel

FLOAT = "float"
PRECISION_SEARCH = "precision_search"   # search-precision's: metric, target, aim, promotions
PAIR_SUMS = "pair_sums"                 # protect-pair-sums': the layers whose int16 pair sums could saturate
COMPUTED = "computed"                   # fold-constants': the tensors it made constant (not initializers in the input)


def leave_float(model: QModel, reasons: dict[str, str], by: str) -> None:
    """Record why tensors stay float (``explain`` and the report read it from the saved model)."""
    if not reasons:
        return
    entries = model.decisions.setdefault(FLOAT, {})
    for name in sorted(reasons):
        entries[name] = {"reason": reasons[name], "pass": by}
    model.decisions[FLOAT] = dict(sorted(entries.items()))


def float_reasons(model: QModel) -> dict[str, dict]:
    """Tensor -> {reason, pass} for every tensor a pass decided to leave float."""
    return model.decisions.get(FLOAT, {})

