"""Measurement: models run in onnxruntime against the float reference (SNR, the accuracy objective,
duels between variants, reused runs), the run's summary and the comparison with onnxruntime's own
quantizer."""
