"""The score lines of a comparison (`qpasses run`'s SNR line, `qpasses compare`): per output
component, then the overall objective."""
from __future__ import annotations


def objective_lines(objective, accuracy: dict, summary: dict | None, *, always: bool,
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
