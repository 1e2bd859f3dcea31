"""Configuration: QuantConfig and its checks, onnxruntime's spellings of its keys, tensor overrides,
and the backend presets (targets/*.json)."""
