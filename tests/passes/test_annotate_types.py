"""annotate-types: op rules, per-channel axes, constants, biases, shares, Relu merge, overrides."""
import numpy as np
import pytest

from qpasses.config.quant_config import QuantConfig
from qpasses.core.context import RunContext
from qpasses.core.verify import check_onnx
from qpasses.errors import ConfigError, PreconditionError
from qpasses.ir.decisions import float_reasons
from qpasses.passes.annotate_types import AnnotateTypes
from qpasses.testing import assert_same_outputs, model_from_text, random_feed, run_pass, run_passes


def annotate_with_findings(text, opset=17, **cfg):
    """(model, result, findings) of annotate-types run with the config ``cfg``. These tests check
    the op rules themselves, so every op with a rule is selected unless ``cfg`` says otherwise (the
    default selection has its own tests)."""
    cfg.setdefault("op_types_to_quantize", "all")
    model = model_from_text(text, opset=opset)
    ctx = RunContext(cfg)
    result = AnnotateTypes().run(model, ctx)
    return model, result, ctx.findings.as_dict()


def annotate(text, opset=17, **cfg):
    return annotate_with_findings(text, opset, **cfg)[:2]


def roles(model):
    """tensor -> (role, qtype, axis, shares) for every entry."""
    return {name: (tq.role, tq.qtype, tq.axis, tq.shares) for name, tq in model.quant.items()}


ACT, W8, U8 = "activation", "int8", "uint8"

# -- op families ------------------------------------------------------------------------------
FAMILIES = {
    "conv": ("""g (float[1,2,4,4] x) => (float[1,3,4,4] y) <float[3,2,1,1] w = {1,2,3,4,5,6}, float[3] b = {1,2,3}>
                { y = Conv(x, w, b) }""",
             {"x": (ACT, U8, None, None), "w": ("weight", W8, 0, None), "b": ("bias", "int32", 0, None),
              "y": (ACT, U8, None, None)}),
    "conv_transpose": ("""g (float[1,2,4,4] x) => (float[1,3,4,4] y) <float[2,3,1,1] w = {1,2,3,4,5,6}, float[3] b = {1,2,3}>
                { y = ConvTranspose(x, w, b) }""",
                       {"x": (ACT, U8, None, None), "w": ("weight", W8, 1, None), "b": ("bias", "int32", 0, None),
                        "y": (ACT, U8, None, None)}),
    "gemm_transb": ("""g (float[2,2] x) => (float[2,3] y) <float[3,2] w = {1,2,3,4,5,6}, float[3] b = {1,2,3}>
                { y = Gemm<transB=1>(x, w, b) }""",
                    {"x": (ACT, U8, None, None), "w": ("weight", W8, 0, None), "b": ("bias", "int32", 0, None),
                     "y": (ACT, U8, None, None)}),
    "gemm": ("""g (float[2,2] x) => (float[2,3] y) <float[2,3] w = {1,2,3,4,5,6}, float[3] b = {1,2,3}>
                { y = Gemm(x, w, b) }""",
             {"x": (ACT, U8, None, None), "w": ("weight", W8, 1, None), "b": ("bias", "int32", 0, None),
              "y": (ACT, U8, None, None)}),
    "matmul_weight": ("""g (float[2,2] x) => (float[2,3] y) <float[2,3] w = {1,2,3,4,5,6}> { y = MatMul(x, w) }""",
                      {"x": (ACT, U8, None, None), "w": ("weight", W8, 1, None), "y": (ACT, U8, None, None)}),
    "matmul_batched_weight": ("""g (float[2,2,2] x) => (float[2,2,1] y) <float[2,2,1] w = {1,2,3,4}> { y = MatMul(x, w) }""",
                              {"x": (ACT, U8, None, None), "w": ("weight", W8, 2, None), "y": (ACT, U8, None, None)}),
    "matmul_vector_weight": ("""g (float[2,2] x) => (float[2] y) <float[2] w = {1,2}> { y = MatMul(x, w) }""",
                             {"x": (ACT, U8, None, None), "w": ("weight", W8, None, None), "y": (ACT, U8, None, None)}),
    "matmul_act_act": ("""g (float[2,2] x, float[2,3] z) => (float[2,3] y) { y = MatMul(x, z) }""",
                       {"x": (ACT, U8, None, None), "z": (ACT, U8, None, None), "y": (ACT, U8, None, None)}),
    "add_sub_mul_div": ("""g (float[2] x, float[2] z) => (float[2] y) {
                            a = Add(x, z)  s = Sub(a, z)  m = Mul(s, x)  y = Div(m, z) }""",
                        {n: (ACT, U8, None, None) for n in "xzasmy"}),
    "add_constant": ("""g (float[2] x) => (float[2] y) <float[2] k = {1, 2}> { y = Add(x, k) }""",
                     {"x": (ACT, U8, None, None), "k": ("weight", U8, None, None), "y": (ACT, U8, None, None)}),
    "concat_constant": ("""g (float[2] x, float[2] z) => (float[6] y) <float[2] k = {1, 2}> { y = Concat<axis=0>(x, k, z) }""",
                        {"x": (ACT, U8, None, None), "k": ("weight", U8, None, None), "z": (ACT, U8, None, None),
                         "y": (ACT, U8, None, None)}),
    "pools": ("""g (float[1,2,4,4] x) => (float[1,2,1,1] g, float[1,2,2,2] m, float[1,2,2,2] v, float[1,2,1,1] h) {
                  s = Sigmoid(x)
                  g = GlobalAveragePool(s)
                  m = MaxPool<kernel_shape=[2,2], strides=[2,2]>(s)
                  v = AveragePool<kernel_shape=[2,2], strides=[2,2]>(s)
                  h = GlobalMaxPool(s) }""",
              {"x": (ACT, U8, None, None), "s": (ACT, U8, None, None), "g": (ACT, U8, None, None),
               "m": (ACT, U8, None, "s"), "v": (ACT, U8, None, "s"), "h": (ACT, U8, None, "s")}),
    "activations": ("""g (float[2] x) => (float[2] y) {
                       a = Sigmoid(x)  b = Tanh(a)  c = LeakyRelu(b)  d = HardSigmoid(c)  e = HardSwish(d)
                       y = Softmax(e) }""",
                    {n: (ACT, U8, None, None) for n in "xabcdey"}),
    "layernorm": ("""g (float[2,3] x) => (float[2,3] y) <float[3] sc = {1,2,3}, float[3] bi = {1,2,3}> {
                     y = LayerNormalization<axis=-1>(x, sc, bi) }""",
                  {"x": (ACT, U8, None, None), "sc": ("weight", W8, None, None), "bi": ("bias", "int32", None, None),
                   "y": (ACT, U8, None, None)}),
    "instancenorm": ("""g (float[1,2,3] x) => (float[1,2,3] y) <float[2] sc = {1,2}, float[2] bi = {1,2}> {
                        y = InstanceNormalization(x, sc, bi) }""",
                     {"x": (ACT, U8, None, None), "sc": ("weight", W8, None, None),
                      "bi": ("bias", "int32", None, None), "y": (ACT, U8, None, None)}),
    "where_quantized": ("""g (bool[2] c, float[2] x, float[2] z) => (float[2] y) {
                           a = Sigmoid(x)  b = Tanh(z)  y = Where(c, a, b) }""",
                        {"x": (ACT, U8, None, None), "z": (ACT, U8, None, None), "a": (ACT, U8, None, None),
                         "b": (ACT, U8, None, None), "y": (ACT, U8, None, None)}),
    "where_with_constant_stays_float": ("""g (bool[2] c, float[2] x) => (float[2] y) <float[2] k = {1, 2}> {
                                           a = Sigmoid(x)  y = Where(c, a, k) }""",
                                        {"x": (ACT, U8, None, None), "a": (ACT, U8, None, None)}),
    "resize": ("""g (float[1,1,2,2] x) => (float[1,1,4,4] y) <float[4] sc = {1, 1, 2, 2}> {
                  a = Sigmoid(x)  y = Resize<mode="nearest">(a, , sc) }""",
               {"x": (ACT, U8, None, None), "a": (ACT, U8, None, None), "y": (ACT, U8, None, "a")}),
    "shape_only_chain": ("""g (float[2,3] x) => (float[3,2] y, int64[2] i) <int64[2] shp = {3, 2}, int64[1] ax = {0}> {
                            a = Sigmoid(x)  r = Reshape(a, shp)  t = Transpose<perm=[1,0]>(r)
                            f = Flatten(t)  u = Unsqueeze(f, ax)  s = Squeeze(u, ax)
                            d = Identity(s)  y = Reshape(d, shp)  i = Shape(y) }""",
                         {"x": (ACT, U8, None, None), "a": (ACT, U8, None, None), "r": (ACT, U8, None, "a"),
                          "t": (ACT, U8, None, "r"), "f": (ACT, U8, None, "t"), "u": (ACT, U8, None, "f"),
                          "s": (ACT, U8, None, "u"), "d": (ACT, U8, None, "s"), "y": (ACT, U8, None, "d")}),
    "shape_only_on_float_input_stays_float": ("""g (float[2,3] x) => (float[3,2] y) { t = Transpose<perm=[1,0]>(x)
                                                 y = Sigmoid(t) }""",
                                              {"t": (ACT, U8, None, None), "y": (ACT, U8, None, None)}),
    "gather_constant_table": ("""g (int64[2] i) => (float[2,2] y) <float[3,2] tab = {1,2,3,4,5,6}, int64[2] shape = {2, 2}> {
                                 e = Gather(tab, i)  r = Reshape(e, shape)  y = Sigmoid(r) }""",
                              {"tab": ("weight", U8, None, None), "e": (ACT, U8, None, "tab"),
                               "r": (ACT, U8, None, "e"), "y": (ACT, U8, None, None)}),
    # nothing quantized reads what the lookup selects: an 8-bit table would only add rounding
    "gather_constant_table_read_float": ("""g (int64[2] i) => (float[2,2] y) <float[3,2] tab = {1,2,3,4,5,6}> {
                                            e = Gather(tab, i)  y = Neg(e) }""", {}),
    "split": ("""g (float[4] x) => (float[2] a, float[2] b) { s = Sigmoid(x)  a, b = Split<num_outputs=2>(s) }""",
              {"x": (ACT, U8, None, None), "s": (ACT, U8, None, None), "a": (ACT, U8, None, "s"),
               "b": (ACT, U8, None, "s")}),
    "pad_zero_shares": ("""g (float[4] x) => (float[6] y) <int64[2] p = {1, 1}> { y = Pad(x, p) }""",
                        {"x": (ACT, U8, None, None), "y": (ACT, U8, None, "x")}),
    "pad_value_own_range": ("""g (float[4] x) => (float[6] y) <int64[2] p = {1, 1}, float v = {5.0}> {
                               y = Pad(x, p, v) }""",
                            {"x": (ACT, U8, None, None), "y": (ACT, U8, None, None)}),
    "clip_bounds_never_quantized": ("""g (float[2] x) => (float[2] y, float[2] z) <float lo = {-1.0}, float hi = {1.0}> {
                                       s = Sigmoid(x)  y = Clip(s, lo, hi)  z = Neg(s) }""",
                                    {"x": (ACT, U8, None, None), "s": (ACT, U8, None, None), "y": (ACT, U8, None, None)}),
    "topk_values_share_indices_float": ("""g (float[4] x) => (float[2] v, int64[2] i) <int64[1] k = {2}> {
                                           s = Sigmoid(x)  v, i = TopK(s, k) }""",
                                        {"x": (ACT, U8, None, None), "s": (ACT, U8, None, None),
                                         "v": (ACT, U8, None, "s")}),
    "unknown_op_stays_float": ("""g (float[2] x) => (float[2] y) { e = Erf(x)  y = Neg(e) }""", {}),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_op_family_rules(name):
    text, expected = FAMILIES[name]
    model, result = annotate(text, opset=18, per_channel=True)
    assert roles(model) == expected
    # modified exactly when something is saved: table entries, or why tensors stay float
    assert result.modified is (bool(expected) or bool(float_reasons(model)))


def test_per_tensor_weights_asymmetric_unless_told():
    text = FAMILIES["conv"][0]
    model, _ = annotate(text, per_channel=False)
    assert (model.quant["w"].axis, model.quant["w"].symmetric) == (None, False)
    assert "asymmetric: a per-tensor weight grid" in model.quant["w"].why[-1]
    model, _ = annotate(text, per_channel=False, weight_symmetric=True)
    assert model.quant["w"].symmetric is True
    model, _ = annotate(text, weight_type="uint8", per_channel=False)
    assert (model.quant["w"].qtype, model.quant["w"].symmetric) == ("uint8", False)
    model, _ = annotate(text, weight_type="uint8", per_channel=True)   # per-channel: symmetric (onnxruntime)
    assert model.quant["w"].symmetric and "per-channel weights are symmetric" in model.quant["w"].why[1]
    model, _ = annotate(text, weight_type="int8", weight_symmetric=False, per_channel=False)
    assert model.quant["w"].symmetric is False


def test_per_channel_axes_option_overrides_the_rule():
    model, _ = annotate(FAMILIES["matmul_weight"][0], per_channel=True, per_channel_axes={"MatMul": 0})
    assert model.quant["w"].axis == 0


def test_activation_options():
    text = FAMILIES["add_constant"][0]
    model, _ = annotate(text, activation_restricted_asymmetric=True, reduce_range=True)
    x, k = model.quant["x"], model.quant["k"]
    assert (x.restricted, x.reduce_range) == (True, False)           # reduce_range: constants only
    assert (k.restricted, k.reduce_range, k.symmetric) == (True, True, False)
    assert "constant read as an activation by Add 'Add_0'" in k.why[0]
    model, _ = annotate(text, activation_type="int8", activation_restricted_asymmetric=True)
    assert model.quant["x"].restricted is False                      # uint8 only
    model, _ = annotate(text, activation_symmetric=True, activation_restricted_asymmetric=True)
    assert (model.quant["x"].symmetric, model.quant["x"].restricted, model.quant["k"].symmetric) == (True, False, True)


def test_why_starts_with_the_reason_for_the_type():
    model, _ = annotate(FAMILIES["conv"][0], per_channel=True)
    assert model.quant["x"].why[0] == "config default activation_type=uint8 (input of Conv 'Conv_0')"
    assert model.quant["y"].why[0] == "config default activation_type=uint8 (output of Conv 'Conv_0')"
    assert model.quant["w"].why[0] == "config default weight_type=int8 (weight of Conv 'Conv_0', per-channel axis 0)"
    assert model.quant["b"].why[0] == "int32 bias of Conv 'Conv_0': scale = scale('x') * scale('w')"
    assert model.quant["b"].derived_from == ["x", "w"]


def test_non_float_tensors_never_get_entries():
    model, _ = annotate(FAMILIES["gather_constant_table"][0])
    assert "i" not in model.quant
    model, _ = annotate(FAMILIES["where_quantized"][0])
    assert "c" not in model.quant


def test_shape_inference_gives_missing_dtypes():
    # 'c' has no value_info: its float type comes from shape inference; 'n' (int64) never gets an entry
    model, _ = annotate("""g (float[2,3] x) => (float[2,3] y, int64[2] n) {
        c = Sigmoid(x)  y = Tanh(c)  s = Shape(c)  n = Identity(s) }""")
    assert set(model.quant) == {"x", "c", "y"}


def test_rule_table_gives_dtypes_when_shape_inference_fails():
    # Unsqueeze with an 'axes' attribute is invalid at opset 18: inference fails, the rules still type 'u'
    model, _ = annotate("""g (float[2] x) => (float[1,2] y) { a = Sigmoid(x)  u = Unsqueeze<axes=[0]>(a)
        y = Tanh(u) }""", opset=18)
    assert roles(model)["u"] == (ACT, U8, None, "a") and "y" in model.quant


def test_selection_by_op_type_and_node():
    text = """g (float[2] x) => (float[2] y) { [s] a = Sigmoid(x)  [t] b = Tanh(a)  [n] y = Neg(b) }"""
    assert set(annotate(text, op_types_to_quantize=["Tanh"])[0].quant) == {"a", "b"}
    assert set(annotate(text, nodes_to_quantize=["s"])[0].quant) == {"x", "a"}
    assert set(annotate(text, nodes_to_exclude=["t"])[0].quant) == {"x", "a"}
    assert set(annotate(text, op_types_to_exclude_output_quantization=["Tanh"])[0].quant) == {"x", "a"}


def test_force_quantize_no_input_check():
    text = FAMILIES["shape_only_on_float_input_stays_float"][0]
    model, _ = annotate(text, force_quantize_no_input_check=True)
    assert roles(model)["t"] == (ACT, U8, None, "x") and "x" in model.quant


# -- biases -------------------------------------------------------------------------------------
def test_bias_needs_quantize_bias():
    model, _ = annotate(FAMILIES["conv"][0], quantize_bias=False)
    assert "b" not in model.quant and model.quant["w"].role == "weight"


def test_bias_incompatible_with_per_channel_weight_stays_float():
    # group=2 ConvTranspose: weight [2, 2, 1, 1] axis 1 has 2 channels, the bias has 4
    model, _, findings = annotate_with_findings("""g (float[1,2,4,4] x) => (float[1,4,4,4] y) <float[2,2,1,1] w = {1,2,3,4}, float[4] b = {1,2,3,4}>
        { y = ConvTranspose<group=2>(x, w, b) }""", per_channel=True)
    assert "b" not in model.quant
    assert findings["annotate-types"]["float_biases"] == [
        "b (ConvTranspose 'ConvTranspose_0'): shape [4] does not match the 2 channels of 'w' (axis 1)"]


def test_computed_bias_stays_float():
    model, _ = annotate("""g (float[2,2] x, float[3] b) => (float[2,3] y) <float[3,2] w = {1,2,3,4,5,6}>
        { y = Gemm<transB=1>(x, w, b) }""")
    assert "b" not in model.quant and model.quant["x"].role == ACT


def test_shared_bias_is_copied_per_node():
    text = """g (float[1,2,4,4] x) => (float[1,2,4,4] y, float[1,2,4,4] z)
        <float[2,2,1,1] w = {1,2,3,4}, float[2,2,1,1] v = {4,3,2,1}, float[2] b = {0.5, -1}> {
        [c1] y = Conv(x, w, b)  [c2] z = Conv(x, v, b) }"""
    model = model_from_text(text)
    before = model.copy()
    result = run_pass(AnnotateTypes(), model, QuantConfig())
    assert result.stats["bias_copies"] == 1
    assert model.quant["b_c1"].derived_from == ["x", "w"] and model.quant["b"].derived_from == ["x", "v"]
    check_onnx(model)
    assert_same_outputs(before, model, random_feed(before))
    assert run_pass(AnnotateTypes(), model, QuantConfig()).modified is False


# -- Relu / Clip merge ------------------------------------------------------------------------------
CONV_RELU = """g (float[1,2,4,4] x) => (float[1,2,4,4] y) <float[2,2,1,1] w = {1,2,3,4}> {
    [conv] c = Conv(x, w)  [relu] y = Relu(c) }"""
MERGE_WHY = ("Relu merged into the producer's range (exact: the output range starts at 0): "
             "Relu 'relu' is dropped and 'c' shares the qparams of 'y'")


def test_relu_merges_into_its_producer():
    model, result = annotate(CONV_RELU)
    assert model.quant["c"].shares == "y" and model.quant["c"].why[-1] == MERGE_WHY
    assert result.stats["merged"] == 1


@pytest.mark.parametrize("text, cfg", [
    (CONV_RELU.replace("=> (float[1,2,4,4] y)", "=> (float[1,2,4,4] y, float[1,2,4,4] c)"), {}),  # graph output
    (CONV_RELU.replace("[relu] y = Relu(c)", "r = Relu(c)  y = Add(r, c)"), {}),                   # two readers
    (CONV_RELU.replace("[relu] y = Relu(c)", "t = Identity(c)  y = Relu(t)"), {}),                # input shares
    (CONV_RELU, {"activation_symmetric": True}),
    (CONV_RELU, {"keep_removable_activations": True}),
    (CONV_RELU, {"calibration": {"symmetric": True}}),
    (CONV_RELU, {"tensor_overrides": {"c": [{"rmin": -1.0}]}}),
    (CONV_RELU, {"tensor_overrides": {"y": [{"quant_type": "uint16"}]}}),                           # types differ
    (CONV_RELU.replace("Relu(c)", "Clip(c, one)").replace("<float[2,2,1,1]", "<float one = {1.0}, float[2,2,1,1]"), {}),
    (CONV_RELU.replace("Relu(c)", "Clip(c, lo)").replace("x) =>", "x, float lo) =>"), {}),          # computed min
])
def test_relu_or_clip_that_must_not_merge(text, cfg):
    model, _ = annotate(text, **cfg)
    relu_out = "r" if "r = Relu" in text else "y"
    assert relu_out in model.quant and len(model.quant) >= 2       # quantized, but not merged
    assert all(tq.shares is None for name, tq in model.quant.items() if name != "t")


def test_relu_on_a_float_graph_input_stays_float():
    model, result = annotate("""g (float[2] x) => (float[2] y) { y = Relu(x) }""")
    assert len(model.quant) == 0 and set(float_reasons(model)) == {"x", "y"}
    assert result.modified is True                                     # the reasons are saved
    assert run_pass(AnnotateTypes(), model).modified is False


@pytest.mark.parametrize("bounds", ["zero", "zero, six", ", six", "neg"])
def test_clip_with_bounds_around_zero_merges(bounds):
    text = CONV_RELU.replace("Relu(c)", f"Clip(c, {bounds})").replace(
        "<float[2,2,1,1]", "<float zero = {0.0}, float six = {6.0}, float neg = {-1.0}, float[2,2,1,1]")
    model, _ = annotate(text)
    assert model.quant["c"].shares == "y"
    assert "zero" not in model.quant and "six" not in model.quant


def test_merged_relu_with_an_override_on_the_output_keeps_the_type_consistent():
    model, _ = annotate(CONV_RELU, tensor_overrides={"y": [{"rmax": 4.0}]})
    assert model.quant["c"].shares == "y" and model.quant["y"].rmax == 4.0


# -- overrides ----------------------------------------------------------------------------------------
def test_override_quant_type_leads_the_why():
    model, result = annotate(FAMILIES["activations"][0], tensor_overrides={"b": [{"quant_type": "QUInt16"}]})
    b = model.quant["b"]
    assert b.qtype == "uint16" and b.why[0] == "override quant_type=uint16 (default was uint8)"
    assert b.why[1].startswith("config default activation_type=uint8")
    assert result.stats["overrides"] == 1


def test_override_fixed_qparams_and_flags():
    model, _ = annotate(FAMILIES["activations"][0], tensor_overrides={
        "a": [{"quant_type": "uint16", "scale": 1 / 65536, "zero_point": 0}],
        "c": [{"symmetric": True, "rmin": -2.0, "rmax": 2.0}]})
    a, c = model.quant["a"], model.quant["c"]
    assert (a.qtype, a.scale, a.zero_point, a.fixed) == ("uint16", [1 / 65536], [0], True)
    assert (c.symmetric, c.rmin, c.rmax, c.fixed) == (True, -2.0, 2.0, False)
    assert any(line.startswith("override scale/zero_point: fixed") for line in a.why)


def test_override_per_channel_weight_and_per_tensor_override():
    text = FAMILIES["conv"][0]
    scales = [{"axis": 0, "scale": s, "zero_point": 0} for s in (0.1, 0.2, 0.3)]
    model, _ = annotate(text, tensor_overrides={"w": scales})
    w = model.quant["w"]
    assert (w.axis, w.scale, w.zero_point, w.fixed) == (0, [0.1, 0.2, 0.3], [0, 0, 0], True)
    assert model.quant["b"].axis == 0 and model.quant["b"].derived_from == ["x", "w"]
    # onnxruntime: an override without 'axis' makes the weight per-tensor even with per_channel
    model, _ = annotate(text, per_channel=True, tensor_overrides={"w": [{"quant_type": "uint8"}]})
    w = model.quant["w"]
    assert (w.axis, w.qtype, w.symmetric) == (None, "uint8", False)
    assert model.quant["b"].axis is None


def test_override_on_a_bias_quantizes_it_as_a_weight():
    model, _ = annotate(FAMILIES["conv"][0], tensor_overrides={"b": [{"quant_type": "int8"}]})
    assert roles(model)["b"] == ("weight", "int8", None, None)


def test_override_convert_sorted_readers():
    text = """g (float[2] x) => (float[2] y, float[2] z, float[2] u) {
        [p] a = Sigmoid(x)  [t2] y = Tanh(a)  [t1] z = Tanh(a)  [n] u = Neg(a) }"""
    model, _ = annotate(text, tensor_overrides={"a": [{"convert": {"quant_type": "uint16", "recv_nodes": ["t2", "t1"]}}]})
    conv = model.quant["a"].convert
    assert (conv.qtype, conv.recv_nodes, conv.symmetric) == ("uint16", ["t1", "t2"], False)
    model, _ = annotate(text, tensor_overrides={"a": [{"convert": {"quant_type": "uint16"}}]})
    assert model.quant["a"].convert.recv_nodes == ["n", "t1", "t2"]   # default: every reader


def test_override_on_a_shared_output_gives_it_its_own_qparams():
    text = FAMILIES["shape_only_chain"][0]
    model, _ = annotate(text, tensor_overrides={"t": [{"quant_type": "uint16"}]})
    t, f = model.quant["t"], model.quant["f"]
    assert (t.shares, t.qtype) == (None, "uint16")
    assert (f.shares, f.qtype) == ("t", "uint16")      # the next shape op follows its source's type


def test_shares_follow_an_overridden_source_type():
    model, _ = annotate(FAMILIES["shape_only_chain"][0], tensor_overrides={"a": [{"quant_type": "int16"}]})
    assert {model.quant[n].qtype for n in "artfusdy"} == {"int16"}


def test_override_no_rule_can_carry_is_refused():
    with pytest.raises(ConfigError, match=r"tensor_overrides\['e'\]: cannot be quantized: Erf '\S+' has no "
                                          r"quantization rule and Neg '\S+' has no quantization rule"):
        annotate_with_findings(FAMILIES["unknown_op_stays_float"][0], tensor_overrides={"e": [{"quant_type": "uint16"}]})


def test_invalid_config_changes_nothing():
    text = """g (float[1,2,4,4] x) => (float[1,2,4,4] y, float[1,2,4,4] z)
        <float[2,2,1,1] w = {1,2,3,4}, float[2] b = {0.5, -1}> { [c1] y = Conv(x, w, b)  [c2] z = Conv(x, w, b) }"""
    model = model_from_text(text)
    before = model.to_proto().SerializeToString()
    config = QuantConfig(tensor_overrides={"yy": [{}], "x": [{"scale": 0.1}]}, nodes_to_exclude=["c3"])
    with pytest.raises(ConfigError) as info:
        run_pass(AnnotateTypes(), model, config)
    assert "(3 problems)" in str(info.value)
    assert model.to_proto().SerializeToString() == before and len(model.quant) == 0


# -- pass contract ---------------------------------------------------------------------------------
def test_idempotent_and_exact_modified():
    model, first = annotate(FAMILIES["conv"][0], per_channel=True)
    table = model.quant.to_json()
    second = run_pass(AnnotateTypes(), model, {"per_channel": True})
    assert first.modified and not second.modified and model.quant.to_json() == table
    assert run_pass(AnnotateTypes(), model, {"per_channel": False}).modified is True


def test_deterministic_table():
    text = FAMILIES["shape_only_chain"][0] + ""
    tables = [annotate(text, tensor_overrides={"a": [{"quant_type": "uint16"}]})[0].quant for _ in range(2)]
    assert tables[0].to_json() == tables[1].to_json()
    assert list(tables[0]) == list(tables[1])


def test_no_op_model():
    model, result = annotate(FAMILIES["unknown_op_stays_float"][0])
    assert len(model.quant) == 0 and result.stats == {}
    assert set(float_reasons(model)) == {"x", "e", "y"} and result.modified is True   # the reasons are saved
    assert run_pass(AnnotateTypes(), model).modified is False


def test_table_survives_a_save_round_trip():
    model, _ = annotate(FAMILIES["conv"][0], per_channel=True)
    from qpasses.ir.model import from_proto

    again = from_proto(model.to_proto())
    assert again.quant == model.quant and again.quant["w"].axis == 0


def test_establishes_types_annotated_for_later_passes():
    model = model_from_text(FAMILIES["conv"][0])
    config = QuantConfig(mixed_precision={"y": "uint16"})
    with pytest.raises(PreconditionError, match="annotate-types"):
        run_passes("propagate-mixed-precision", model, config)
    run_passes("annotate-types", model, config)
    assert "types-annotated" in model.facts
    check_onnx(model)


def test_without_config_uses_defaults():
    model = model_from_text(FAMILIES["conv"][0])
    AnnotateTypes().run(model, RunContext())
    assert model.quant["w"].qtype == "int8" and not hasattr(model, "config")   # the config is the run's


def test_linear_scale():
    # a long chain is annotated with one table entry per tensor and no recursion
    body = "\n".join(f"t{i + 1} = Sigmoid(t{i})" for i in range(2000))
    model = model_from_text(f"g (float[2] t0) => (float[2] t2000) {{ {body} }}")
    import time

    start = time.perf_counter()
    run_pass(AnnotateTypes(), model, QuantConfig(op_types_to_quantize="all"))
    assert len(model.quant) == 2001 and time.perf_counter() - start < 10
    assert np.all([model.quant[f"t{i}"].qtype == "uint8" for i in range(2001)])


def test_example_runs():
    model = model_from_text(AnnotateTypes.example)
    assert run_pass(AnnotateTypes(), model).modified is True


MIXED = """g (float[1,2,8,8] x) => (float[1,10] y, float[1,4] v)
  <float[4,2,3,3] w = {%s}, float[4] b = {1,2,3,4}, int64[2] shp = {1, 64}, float[10,64] gw = {%s},
   float[10] gb = {%s}, float[1,10] k = {%s}, float[1,2] k2 = {1, 2}, int64[1] s0 = {0}, int64[1] s1 = {4},
   int64[1] ax = {1}> {
  [conv] c = Conv<pads=[1,1,1,1]>(x, w, b)
  [relu] r = Relu(c)
  [pool] p = MaxPool<kernel_shape=[2,2], strides=[2,2]>(r)
  [rs] f = Reshape(p, shp)
  [gemm] g = Gemm<transB=1>(f, gw, gb)
  [add] a = Add(g, k)
  [sig] s = Sigmoid(a)
  [cat] q = Concat<axis=1>(s, k2)
  [slice] v = Slice(q, s0, s1, ax)
  [sm] y = Softmax(s)
}""" % (",".join(["0.1"] * 72), ",".join(["0.01"] * 640), ",".join(["0.5"] * 10), ",".join(["0.2"] * 10))


@pytest.mark.parametrize("per_channel", [False, True])
def test_same_tensors_as_onnxruntime(tmp_path, per_channel):
    """onnxruntime's quantize_static puts Q/DQ on exactly the tensors we annotate (merged Relu inputs aside)."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from qpasses.testing import parse

    proto = parse(MIXED)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([random_feed(proto, seed=i) for i in range(2)])

        def get_next(self):
            return next(self.feeds, None)

    onnx.save(proto, tmp_path / "f.onnx")
    quantize_static(tmp_path / "f.onnx", tmp_path / "q.onnx", Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=per_channel, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    ort = {n.output[0].removesuffix("_DequantizeLinear_Output")
           for n in onnx.load(tmp_path / "q.onnx").graph.node if n.op_type == "DequantizeLinear"}
    model, _ = annotate(MIXED, per_channel=per_channel)
    assert model.quant["c"].shares == "r"            # the Relu is dropped: onnxruntime has no 'c' either
    assert ort == set(model.quant) - {"c"}


def test_by_default_element_wise_ops_stay_float_with_a_reason():
    text = """
    g (float[1,3,8,8] x, float[1,4,8,8] s) => (float[1,4,8,8] y) <float[4,3,1,1] w = {1,2,3,4,5,6,7,8,9,10,11,12}> {
      c = Conv (x, w)
      a = Add (c, s)
      y = Relu (a)
    }"""
    model, _ = annotate(text, op_types_to_quantize=None)
    assert {"x", "w", "c"} <= set(model.quant) and "a" not in model.quant and "s" not in model.quant
    reasons = model.decisions["float"]
    assert "stays float by default" in reasons["a"]["reason"] and "op_types_to_quantize: all" in reasons["a"]["reason"]
    everything, _ = annotate(text, op_types_to_quantize="all")
    assert {"a", "s"} <= set(everything.quant)


def test_by_default_a_matmul_of_two_computed_tensors_stays_float_with_a_reason():
    text = """
    g (float[1,4,8] x) => (float[1,4,8] y) <float[8,8] wq = {%s}, float[8,8] wk = {%s}> {
      q = MatMul (x, wq)
      k = MatMul (x, wk)
      kt = Transpose <perm = [0,2,1]> (k)
      s = MatMul (q, kt)
      p = Softmax <axis = -1> (s)
      y = MatMul (p, q)
    }""" % (",".join(["0.1"] * 64), ",".join(["0.2"] * 64))
    model, _ = annotate(text, op_types_to_quantize=None)
    assert {"x", "wq", "wk", "k"} <= set(model.quant)   # weight MatMuls: inputs, weights, k read quantized
    assert not {"s", "p", "y"} & set(model.quant) and model.quant["kt"].shares == "k"   # a move of k
    reasons = model.decisions["float"]
    assert "MatMulIntegerToFloat" in reasons["q"]["reason"]   # q: only float MatMuls read it
    assert "multiplies two computed tensors" in reasons["s"]["reason"]
    assert "multiplies two computed tensors" in reasons["y"]["reason"]
    for selection in ("all", ["MatMul"]):
        everything, _ = annotate(text, op_types_to_quantize=selection)
        assert {"s", "p", "y"} <= set(everything.quant)



ISLAND = """g (float[1,2,4,4] x) => (float[1,1,4,4] a, float[1,1,4,4] b, float[1,2,4,4] r)
  <float[2,2,1,1] w = {1, -1, 2, 1}, int64[4] shape = {1, 2, 4, 4}>
{
  c = Conv(x, w)
  s = Sigmoid(c)
  a, b = Split <axis = 1> (s)
  r = Reshape(c, shape)
}"""


def test_data_movement_among_float_ops_stays_float_by_default():
    """A Split (which starts a quantized region by itself) between a float Sigmoid and the outputs
    would only round: by default it stays float with its reason; the Conv and what moves its output
    keep their grid; an explicit selection keeps the island."""
    model, _ = annotate(ISLAND, op_types_to_quantize=None)
    names = {name for name, _ in model.quant.items()}
    assert {"x", "c", "r"} <= names and not {"s", "a", "b"} & names
    assert model.quant["r"].shares == "c"
    for name in ("s", "a", "b"):
        assert "only data movement reads or writes it between float ops" in float_reasons(model)[name]["reason"]
    kept, _ = annotate(ISLAND, op_types_to_quantize=["Conv", "Split", "Reshape"])
    assert {"s", "a", "b"} <= {name for name, _ in kept.quant.items()}
