"""Calibration: data sources, streaming per-tensor statistics and the onnxruntime runner.

- ``data``: ``open_data(source) -> CalibrationData`` (re-iterable feeds) and ``validate`` (one feed
  against the model's inputs).
- ``collectors``: ``TensorStats`` (running min/max, optional growing ``Histogram``) and the range
  finalisers ``minmax_range``, ``percentile_range``, ``entropy_range``, ``mse_range``, ``pow2_range``.
- ``runner``: ``collect_stats(model, data, ...)`` runs the float model once over the samples
  (``calibrate_ranges`` also finalises the ranges); ``augment`` says what is measured and exposes
  it as extra outputs, ``tensor_types`` reads element types (inference: ``analysis.dtypes``),
  ``kept`` holds the first feeds and float outputs for select-by-snr, ``progress`` draws the bar.
- ``segments``: a segmented onnxruntime executor (a big graph run as a chain of sessions, weights
  handed over as arrays), used by the runner, evaluate and correct-bias; ``sessions``: its
  onnxruntime plumbing.
"""
from .collectors import (Histogram, TensorStats, entropy_range, finalise, minmax_range, mse_range,
                         percentile_range, pow2_range)
from .data import CalibrationData, InputSpec, model_inputs, open_data, validate
from .ranges import calibrate_ranges
from .runner import collect_stats

__all__ = [
    "CalibrationData", "Histogram", "InputSpec", "TensorStats", "calibrate_ranges", "collect_stats",
    "entropy_range", "finalise", "minmax_range", "model_inputs", "mse_range", "open_data",
    "percentile_range", "pow2_range", "validate",
]
