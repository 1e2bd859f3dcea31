"""quantize-silu: SiLU gates 8-bit when the outputs allow, as integer kernels in onnxruntime."""
import numpy as np
import onnxruntime as ort
import pytest

from qpasses.api import run_pipeline
from qpasses.core.context import RunContext
from qpasses.core.pipeline import PassManager
from qpasses.ir.model import from_proto
from qpasses.passes.quantize_silu import QuantizeSilu
from qpasses.testing import parse

SILU = """
<ir_version: 10, opset_import: ["" : 17]>
g (float[1, 8, 6, 6] x) => (float[1, 4, 6, 6] y) <float[8, 8, 1, 1] w = {%s}, float[4, 8, 1, 1] v = {%s}>
{
    a = Conv(x, w)
    g = Sigmoid(a)
    s = Mul(a, g)
    y = Conv(s, v)
}
"""


def _model():
    rng = np.random.default_rng(0)
    w, v = rng.uniform(-0.5, 0.5, 64), rng.uniform(-0.5, 0.5, 32)
    return from_proto(parse(SILU % (", ".join(f"{x:.4f}" for x in w), ", ".join(f"{x:.4f}" for x in v))))


def _feeds(n=16):
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(0, 1, (1, 8, 6, 6)).astype(np.float32)} for _ in range(n)]


def _run(config=None, search=None, **options):
    model, ctx = _model(), RunContext(config, _feeds())
    PassManager("annotate-types,calibrate").run(model, ctx)
    if search is not None:   # what search-precision decided
        model.decisions["precision_search"] = search
    record = PassManager([QuantizeSilu(**options)]).run(model, ctx)[0]
    return model, ctx, record


def test_the_gate_becomes_8_bit_and_runs_as_integer_kernels(tmp_path):
    model, ctx, record = _run()
    decision = model.decisions["silu_gates"]
    assert record.modified and decision["quantized"] and decision["gates"] == ["g"]
    gate, source = model.quant["g"], model.quant["a"]
    assert gate.qtype == source.qtype and "quantize-silu" in gate.why[-1] and "g" not in model.decisions.get("float", {})
    lo, hi = model.ranges["a"]
    assert model.ranges["g"] == pytest.approx((1 / (1 + np.exp(-lo)), 1 / (1 + np.exp(-hi))))
    run_pipeline(model, "compute-qparams,fix-bias-scales,insert-qdq,insert-converts", ctx=ctx)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.to_proto().SerializeToString(), options, providers=["CPUExecutionProvider"])
    import onnx
    ops = {n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node}
    assert {"QLinearSigmoid", "QLinearMul"} <= ops and "Sigmoid" not in ops


@pytest.mark.parametrize(("search", "options", "quantized"), [
    (None, {"margin_db": -100.0}, False),                                      # must gain 100 dB
    ({"metric": "snr", "target": 1000.0}, {}, False),                          # below the target
    ({"metric": "snr", "target": 0.0, "aim": -1000.0}, {"margin_db": -100.0}, True),   # meets the aim
])
def test_the_gates_stay_float_unless_the_outputs_allow(search, options, quantized):
    model, _, _ = _run(search=search, **options)
    decision = model.decisions["silu_gates"]
    assert decision["quantized"] is quantized and ("g" in model.quant) is quantized
    if not quantized:
        assert "quantize-silu: 8-bit SiLU gates took" in model.decisions["float"]["g"]["reason"]


def test_a_target_holds_with_the_searchs_in_sample_allowance():
    """A target the search checked 1 dB higher (on the feeds the ranges came from) binds the gates there too."""
    model, _, _ = _run(search={"metric": "snr", "target": 0.0})
    after = model.decisions["silu_gates"]["after"]
    for checked_at, quantized in ((after - 0.5, True), (after + 0.5, False)):
        model, _, _ = _run(search={"metric": "snr", "target": after - 1.0, "checked_at": checked_at}, margin_db=100.0)
        assert model.decisions["silu_gates"]["quantized"] is quantized


def test_the_aim_is_read_at_the_level_the_searchs_confirmation_read():
    """The gates' cost is read on the check feeds (with and without them); the level it is taken
    from is the search's confirmation on more feeds when there is one."""
    model, _, _ = _run(search={"metric": "snr", "target": 0.0})
    before, after = (model.decisions["silu_gates"][k] for k in ("before", "after"))
    cost = before - after
    for wide, quantized in ((None, False), (after + cost, False), (after + cost + 1.0, True)):
        search = {"metric": "snr", "target": 0.0, "aim": after + 0.5} | ({"confirmed": {"score": wide}} if wide else {})
        model, _, _ = _run(search=search, margin_db=-100.0)
        assert model.decisions["silu_gates"]["quantized"] is quantized, wide


def test_an_explicit_op_selection_is_left_alone():
    model, _, record = _run({"op_types_to_quantize": ["Conv"]})
    assert not record.modified and "silu_gates" not in model.decisions and "g" not in model.quant


def test_a_run_resumed_around_it_gives_the_same_bytes(tmp_path):
    """Around it, and around select-by-snr and search-precision before it."""
    from qpasses.core.pipeline import QUANTIZE_PIPELINE
    from qpasses.ir.model import load, save

    def run(model, passes):
        return run_pipeline(model, passes, ctx=RunContext(None, _feeds()))[0]

    whole = run(_model(), QUANTIZE_PIPELINE)
    assert whole.decisions["silu_gates"]["quantized"]
    passes = QUANTIZE_PIPELINE.split(",")
    at = passes.index("quantize-silu")
    for cut in (at - 2, at - 1, at, at + 1):   # before select-by-snr, search-precision, it; after it
        save(run(_model(), ",".join(passes[:cut])), tmp_path / "cut.onnx")
        resumed = run(load(tmp_path / "cut.onnx"), ",".join(passes[cut:]))
        assert resumed.to_proto().SerializeToString() == whole.to_proto().SerializeToString(), passes[cut - 1]


CSP = """
<ir_version: 10, opset_import: ["" : 17]>
g (float[1, 8, 6, 6] x) => (float[1, 4, 6, 6] y) <float[8, 8, 1, 1] w = {%s}, float[8, 8, 1, 1] u = {%s},
                                                   float[4, 24, 1, 1] v = {%s}>
{
    a = Conv(x, w)
    ga = Sigmoid(a)
    sa = Mul(a, ga)
    b = Conv(sa, u)
    gb = Sigmoid(b)
    sb = Mul(b, gb)
    r = Add(sb, sa)
    c = Concat <axis = 1> (sa, sb, r)
    y = Conv(c, v)
}
"""


def _csp():
    rng = np.random.default_rng(2)
    text = [", ".join(f"{v:.4f}" for v in rng.uniform(-0.5, 0.5, n)) for n in (64, 64, 96)]
    return from_proto(parse(CSP % tuple(text)))


def test_silus_whose_products_only_joins_read_run_on_integer_kernels(tmp_path):
    """A CSP block: two SiLU products and their residual Add joined by a Concat that feeds a Conv (the
    first product also feeds a Conv: its gate is a plain one)."""
    from qpasses.analysis.silu import silu_chains

    model, ctx = _csp(), RunContext(None, _feeds())
    PassManager("annotate-types,calibrate").run(model, ctx)
    chains = silu_chains(model)
    assert chains.products == {"sb": ("gb", "b")} and chains.joins == {"r": "c"}
    assert chains.names() == ["gb", "r", "sb"]
    record = PassManager([QuantizeSilu(margin_db=100.0)]).run(model, ctx)[0]
    decision = model.decisions["silu_gates"]
    assert record.modified and decision["chains_quantized"] and record.stats == {"gates": 1, "chains": 1}
    lo, hi = model.ranges["b"]
    silu = lambda v: v / (1 + np.exp(-v))   # noqa: E731
    assert model.ranges["sb"][1] == pytest.approx(silu(hi))
    assert model.ranges["sb"][0] == pytest.approx(-0.2784645 if lo < -1.2784645 else silu(lo))
    assert model.ranges["r"] == model.ranges["c"]
    run_pipeline(model, "compute-qparams,fix-bias-scales,insert-qdq,insert-converts", ctx=ctx)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.to_proto().SerializeToString(), options, providers=["CPUExecutionProvider"])
    import onnx
    ops = [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]
    assert {"QLinearConcat", "QLinearAdd", "QLinearSigmoid", "QLinearMul"} <= set(ops)
    assert not {"Sigmoid", "Mul", "Add", "Concat", "Conv"} & set(ops)
    simulation = ort.SessionOptions()   # the QDQ graph as written: the same numbers on every CPU
    simulation.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.to_proto().SerializeToString(), simulation, providers=["CPUExecutionProvider"])
    float_model = _csp().to_proto()
    ref = ort.InferenceSession(float_model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = _feeds(1)[0]
    y, q = ref.run(None, feed)[0], sess.run(None, feed)[0]
    assert 10 * np.log10(np.sum(y ** 2) / np.sum((y - q) ** 2)) > 20


def test_a_chain_with_a_reader_that_stays_float_is_not_taken():
    from qpasses.analysis.silu import silu_chains

    model, ctx = _csp(), RunContext({"nodes_to_exclude": ["y"]}, _feeds())
    model.graph.nodes[-1].name = "y"
    PassManager("annotate-types,calibrate").run(model, ctx)
    assert not silu_chains(model)   # the Concat's output is float: no chain can end 8-bit
