"""QOperator lowering: QDQ node units (DQ -> op -> Q) matched and rewritten into onnxruntime's
QLinear* kernels (units.py: what matches and why not; kernels.py: the operator each becomes)."""
