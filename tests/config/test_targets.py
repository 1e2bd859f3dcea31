"""Target presets: qnn defaults, explicit config keys winning, and the table rules."""
import pytest

from qpasses.config.quant_config import QuantConfig, load_config
from qpasses.config.targets import apply_target_rules, known_targets, load_target
from qpasses.core.context import RunContext
from qpasses.errors import ConfigError
from qpasses.passes.annotate_types import AnnotateTypes
from qpasses.testing import model_from_text, run_pass

SIG_TANH = """g (float[2,3] x) => (float[2,3] y, float[2,3] z) { [sig] y = Sigmoid(x)  [tanh] z = Tanh(x) }"""
MATMUL_LN = """g (float[2,3] x) => (float[2,2] y, float[2,3] z)
    <float[3,2] w = {1,2,3,4,5,6}, float[3] sc = {1,1,1}, float[3] bi = {0,0,0}> {
    [mm] y = MatMul(x, w)  [ln] z = LayerNormalization<axis=-1>(x, sc, bi) }"""


def annotate(text, **cfg):
    """(the model annotated with target qnn and ``cfg``, the run's config)."""
    model, ctx = model_from_text(text), RunContext({"target": "qnn", **cfg})
    AnnotateTypes().run(model, ctx)
    return model, ctx.config


def test_known_targets_are_the_preset_files():
    assert "qnn" in known_targets()
    assert all("." not in name for name in known_targets())    # qnn.constraints.json is not a preset


def test_unknown_target_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"target: unknown target 'qnnn' \(known: .*qnn"):
        load_config({"target": "qnnn"})
    model = model_from_text(SIG_TANH)
    with pytest.raises(ConfigError, match="unknown target 'htp'"):
        run_pass(AnnotateTypes(), model, QuantConfig(target="htp"))


def test_qnn_defaults_follow_get_qnn_qdq_config():
    cfg = load_config({"target": "qnn"})
    assert (cfg.activation_type, cfg.weight_type, cfg.weight_symmetric, cfg.minimum_real_range) == \
        ("uint8", "uint8", False, 0.0001)


@pytest.mark.parametrize("given, expected", [
    ({"activation_type": "QUInt16"}, {"activation_type": "uint16", "weight_type": "uint8"}),
    ({"weight_type": "QInt8"}, {"weight_type": "int8", "weight_symmetric": True}),       # derived again
    ({"weight_type": "QInt8", "weight_symmetric": False}, {"weight_symmetric": False}),
    ({"activation_type": "uint8", "minimum_real_range": None}, {"minimum_real_range": None}),
    ({"extra_options": {"MinimumRealRange": 0.5}}, {"minimum_real_range": 0.5}),
])
def test_keys_given_by_the_user_win(given, expected):
    cfg = load_config({"target": "qnn", **given})
    for key, value in expected.items():
        assert getattr(cfg, key) == value, key


def test_hand_built_config_gets_the_preset_in_the_run_context():
    model, ctx = model_from_text(MATMUL_LN), RunContext(QuantConfig(target="qnn", activation_type="uint16"))
    AnnotateTypes().run(model, ctx)
    assert ctx.config.weight_type == "uint8" and ctx.config.activation_type == "uint16"
    assert model.quant["w"].qtype == "uint8" and model.quant["w"].symmetric is False
    assert model.quant["x"].why[0].startswith("config default activation_type=uint16")
    assert model.quant["w"].why[0].startswith("target qnn default weight_type=uint8")


@pytest.mark.parametrize("act, sig, tanh", [
    ("uint16", (1 / 65536, 0), (1 / 32768, 32768)),
    ("int16", (1 / 32768, 0), (1 / 32768, 0)),
    ("uint8", None, None),
])
def test_sigmoid_and_tanh_fixed_qparams(act, sig, tanh):
    model, config = annotate(SIG_TANH, activation_type=act)
    for name, want in (("y", sig), ("z", tanh)):
        tq = model.quant[name]
        if want is None:
            assert not tq.fixed and tq.scale is None
        else:
            assert (tq.scale, tq.zero_point, tq.fixed) == ([want[0]], [want[1]], True)
            assert tq.why[-1].startswith("target qnn: ")
    assert load_target("qnn").fixed_output_qparams["Sigmoid"]["uint16"] == (2.0**-16, 0)


def test_fixed_qparams_follow_an_override_type_but_not_a_user_scale():
    model, config = annotate(SIG_TANH, tensor_overrides={"y": [{"quant_type": "uint16"}],
                                                 "z": [{"quant_type": "uint16", "scale": 0.01, "zero_point": 100}]})
    assert (model.quant["y"].scale, model.quant["y"].zero_point) == ([1 / 65536], [0])
    assert (model.quant["z"].scale, model.quant["z"].zero_point) == ([0.01], [100])


def test_rules_reapply_after_type_changes_and_are_idempotent():
    model, config = annotate(SIG_TANH, activation_type="uint16")
    assert apply_target_rules(model, config) == 0
    model.quant["y"].qtype = "uint8"                 # e.g. the mixed-precision pass demoted it
    model.quant["z"].qtype = "int16"
    assert apply_target_rules(model, config) == 2
    assert not model.quant["y"].fixed and model.quant["y"].scale is None
    assert (model.quant["z"].scale, model.quant["z"].zero_point) == ([1 / 32768], [0])
    assert apply_target_rules(model, config) == 0


def test_16bit_activation_puts_matmul_and_layernorm_weights_back_to_8bit():
    model, config = annotate(MATMUL_LN, activation_type="uint16", per_channel=False)
    assert model.quant["w"].qtype == "uint8" and model.quant["sc"].qtype == "uint8"
    assert apply_target_rules(model, config) == 0
    for name in ("w", "sc"):                          # a later pass promoted the weights with the region
        model.quant[name].qtype, model.quant[name].symmetric = "uint16", True
    assert apply_target_rules(model, config) == 2
    w = model.quant["w"]
    assert (w.qtype, w.symmetric) == ("uint8", False)
    assert w.why[0] == ("target qnn: MatMul 'mm' reads 16-bit 'x': weight_type=uint8, weight_symmetric=False "
                        "(was uint16)")
    assert apply_target_rules(model, config) == 0


def test_weight_rule_respects_user_overrides_and_8bit_activations():
    model, config = annotate(MATMUL_LN, activation_type="uint16", tensor_overrides={"w": [{"quant_type": "uint16"}]})
    assert model.quant["w"].qtype == "uint16"
    model, config = annotate(MATMUL_LN, per_channel=False)     # 8-bit activations: nothing to do
    model.quant["w"].qtype = "uint16"
    assert apply_target_rules(model, config) == 0


def test_matmul_weights_stay_per_tensor_with_per_channel():
    text = MATMUL_LN.replace("[ln]", "[conv] q = Conv(x4, cw)  [ln]").replace(
        "(float[2,3] x)", "(float[2,3] x, float[1,2,3,3] x4)").replace(
        "float[3] sc", "float[2,2,1,1] cw = {1,2,3,4}, float[3] sc").replace(
        "float[2,3] z)", "float[2,3] z, float[1,2,3,3] q)")
    model, config = annotate(text, per_channel=True)
    assert model.quant["w"].axis is None and model.quant["w"].symmetric is False
    assert model.quant["cw"].axis == 0


def test_no_target_no_rules():
    # every op, as the qnn preset selects (Sigmoid stays float by default): only the target's rules are missing
    model, config = model_from_text(SIG_TANH), QuantConfig(activation_type="uint16", op_types_to_quantize="all")
    run_pass(AnnotateTypes(), model, config)
    assert apply_target_rules(model, config) == 0 and not model.quant["y"].fixed


def test_annotate_with_target_is_idempotent():
    model, config = annotate(SIG_TANH + "", activation_type="uint16")
    assert run_pass(AnnotateTypes(), model, config).modified is False
