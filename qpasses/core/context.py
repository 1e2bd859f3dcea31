"""RunContext: what one run brings that is not part of the model.

The config, the calibration data, caches and the findings sink live here, apart from the saved
model: a pass may read the config and the data and may reuse a cache (it must reach the same
result without it), but it never decides from what another pass wrote. What a later pass reads
is a decision saved in the model (``QModel.quant``, ``ranges``, ``decisions``, ``facts``).
"""
from __future__ import annotations

from ..config.quant_config import QuantConfig, load_config


class Findings:
    """Write-only for passes: what they found, for the CLI report (``as_dict``)."""

    def __init__(self):
        self._data: dict = {}

    def set(self, key: str, value) -> None:
        self._data[key] = value

    def update(self, key: str, values: dict) -> None:
        """Merge ``values`` into the mapping under ``key``."""
        self._data.setdefault(key, {}).update(values)

    def add_rows(self, key: str, rows: list[dict], by: str) -> None:
        """Merge ``rows`` into the list under ``key``, one row per ``row[by]`` (a later row wins), sorted."""
        merged = {row[by]: row for row in self._data.get(key, [])}
        merged.update((row[by], row) for row in rows)
        self._data[key] = [merged[k] for k in sorted(merged)]

    def as_dict(self) -> dict:
        return self._data


class RunContext:
    """The config (target defaults applied), calibration data, a transient cache and the findings."""

    def __init__(self, config=None, calibration_data=None):
        from ..config.targets import apply_target_defaults

        self.config: QuantConfig = apply_target_defaults(load_config(config))
        # the data's path, for a reproducer (None when given as Python objects)
        self.data_source = _path_or_none(calibration_data)
        if calibration_data is not None and not hasattr(calibration_data, "validated"):
            from ..calibration.data import open_data

            calibration_data = open_data(calibration_data)
        self.calibration_data = calibration_data
        self.cache: dict = {}           # e.g. calibrate's kept feeds: reused if there, never required
        self.findings = Findings()
        self.instruments: list = []     # the manager's, so nested pipelines are instrumented too
        self.depth = 0                  # 0: the user's pipeline; 1: a pipeline a pass runs on a copy

    def nested(self) -> "RunContext":
        """A context for a pipeline a pass runs on a copy: same config, data and cache, own findings."""
        child = RunContext.__new__(RunContext)
        child.__dict__.update(self.__dict__)
        child.findings = Findings()
        child.depth = self.depth + 1
        return child


def _path_or_none(source):
    from pathlib import Path

    return str(source) if isinstance(source, (str, Path)) else None
