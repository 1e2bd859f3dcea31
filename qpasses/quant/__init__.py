"""Quantization rules and math: quantized types, ranges to scales and zero points, which op inputs
are quantized, Q/DQ building blocks, weight rounding, and the opset a quantized model needs."""
