"""Test graphs shared by several test files."""

# The example of onnxruntime PR 20028 (mixed-precision overrides; op names as in the PR, lower case).
ORT_PR_20028 = """
g (float[1,2] input_0, float[1,2] input_1) => (float[1,2] output_0, float[1,2] output_1, float[1,2] output_2) {
  [op1] op1_out = Sigmoid (input_0)
  [op2] op2_out = Cos (input_1)
  [op3] op3_out = Sin (op1_out)
  [op4] op4_out = Tanh (op2_out)
  [op5] op5_out = Mul (op3_out, op4_out)
  [op6] output_0 = Relu (op5_out)
  [op7] output_1 = Cos (op2_out)
  [op8] output_2 = Sigmoid (op2_out)
}"""
