"""Weight-only quantization of MatMul/Gemm weights, block-wise along K (the quantize-weights pass).

blocks.py: the blocked layout and round-to-nearest on given parameters; rtn.py, hqq.py, gptq.py,
awq.py: the algorithms choosing those parameters (and codes); hessian.py: the per-input statistics
GPTQ and AWQ read from the calibration data; matmulnbits.py and emit.py: the two output forms
(com.microsoft.MatMulNBits, opset-21 block-wise DequantizeLinear); targets.py: which weights;
mx.py: the OCP MX block formats (power-of-two block scales, int8/float8 elements); parallel.py:
the thread pool the weights are quantized on, results in order.
"""
