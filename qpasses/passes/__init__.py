"""Built-in passes: one module per pass, named after it (insert_qdq.py <-> insert-qdq); a pass with
machinery of its own is a package holding it (search_precision/checks.py)."""

# A Conv (weight, bias) + Relu: the docs example of the passes that compute and insert qparams.
CONV_RELU_EXAMPLE = """
g (float[1,2,4,4] x) => (float[1,2,4,4] y) <float[2,2,1,1] w = {0.5, -0.25, 0.125, 1.0}, float[2] b = {0.1, -0.2}>
{
  c = Conv(x, w, b)
  y = Relu(c)
}
"""
