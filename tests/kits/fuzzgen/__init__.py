"""Hypothesis generators for fuzzing qpasses: random valid float models, quantization configs and
data, and the check of what the default pipeline does with them (tests/integration/test_fuzz.py,
tools/fuzz.py).

- ``builder``: ``Builder`` grows a graph one op at a time, tracking every float tensor's static shape;
- ``ops``: one generator per op (``OPS``) and ``op_step``, the strategy that adds one random op;
- ``models``: ``models()`` draws a :class:`DrawnModel`; ``feeds_for`` makes its feeds;
- ``configs``: ``configs()`` draws a QuantConfig dict (with ``overrides()``);
- ``cases``: ``cases()`` draws a :class:`FuzzCase` (model, 4 calibration feeds, config);
- ``outcome``: ``run_case`` quantizes a case with the default pipeline and classifies the outcome
  (``snr_floor``, ``no_floor_reasons``).

``cases()`` draws a random DAG over the ops qpasses quantizes (and a few it does not: Abs, Neg,
Shape arithmetic), opset 11-21, random static (sometimes symbolic-batch) shapes, tensors and graph
inputs read by several nodes, several graph outputs (some also read inside the graph, sometimes a
graph input), constants given as initializers, shared or twinned (same values, another name), or
built by constant subgraphs (Constant, ConstantOfShape, Reshape/Transpose/Add of constants:
fold-constants has work), Conv/ConvTranspose/Gemm followed by BatchNormalization (fold-batchnorm),
scoped ('net/x:0') or missing node names; plus a random QuantConfig (types, symmetry, per-channel,
calibration method, mixed precision requests, tensor overrides, node/op selections, ...) and 4
calibration feeds (N(0, 1), sometimes scaled, offset or constant).

Every drawn model passes onnx.checker and runs in onnxruntime (``run_case`` checks it again).
Numerics are kept well-conditioned on purpose: divisors are constants away from zero or
``Sigmoid(t) + 1``, the Where condition is a bool graph input, Softmax never runs over a size-1
axis (onnxruntime's QLinearSoftmax turns that 1.0 into 0).

Hypothesis is a test dependency: these generators live under tests/ (``tests.kits.fuzzgen``; tools/fuzz.py
puts the repository on the import path itself), never in the qpasses package.
"""
