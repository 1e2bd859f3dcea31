"""qpasses.evaluation.objective: error per output component (Concat pieces found statically), the snr / cosine /
top1 / user metrics, and --metric on the command line."""
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qpasses
from qpasses.cli import main
from qpasses.evaluation.evaluate import compare, session
from qpasses.evaluation.objective import (Component, MetricError, Objective, objective_scores, output_components,
                                          parse_metric)
from qpasses.ir.decisions import float_reasons

CHANNELS, ANCHORS, CLASSES = 8, 64, 6


def detector(*, transpose=False, identity=False, value_info=False, batch_axis=False):
    """A YOLO-style head: output = Concat([boxes (N,4,A) in 0..320, Sigmoid(scores) (N,6,A) in 0..1],
    axis=1), optionally transposed to (N,A,10) or behind an Identity."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, CHANNELS, 1)).astype(np.float32) * 0.5, "w_box"),
             numpy_helper.from_array(rng.standard_normal((CLASSES, CHANNELS, 1)).astype(np.float32) * 0.5, "w_cls"),
             numpy_helper.from_array(np.array(320, np.float32), "scale")]
    nodes = [helper.make_node("Conv", ["x", "w_box"], ["box_logits"]),
             helper.make_node("Sigmoid", ["box_logits"], ["box_unit"]),
             helper.make_node("Mul", ["box_unit", "scale"], ["boxes"]),
             helper.make_node("Conv", ["x", "w_cls"], ["cls_logits"]),
             helper.make_node("Sigmoid", ["cls_logits"], ["scores"]),
             helper.make_node("Concat", ["boxes", "scores"], ["cat"], axis=0 if batch_axis else 1)]
    last = "cat"
    if transpose:
        nodes.append(helper.make_node("Transpose", [last], ["cat_t"], perm=[0, 2, 1]))
        last = "cat_t"
    if identity:
        nodes.append(helper.make_node("Identity", [last], ["cat_i"]))
        last = "cat_i"
    nodes[-1].output[0] = "output"
    x_shape = ["batch", CHANNELS, ANCHORS]
    graph = helper.make_graph(nodes, "det", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "d1", "d2"])], inits)
    if value_info:
        graph.value_info.extend([helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 4, ANCHORS]),
                                 helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, CLASSES, ANCHORS])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model)
    return model


def feeds(n, seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, CHANNELS, ANCHORS)).astype(np.float32)} for _ in range(n)]


def _spans(components):
    return [(c.name, c.axis, c.start, c.stop) for c in components]


# -- components ------------------------------------------------------------------------------

@pytest.mark.parametrize("value_info", [False, True])
def test_concat_output_is_split_into_named_pieces(value_info):
    comps = output_components(detector(value_info=value_info))   # without value_info: shape inference
    assert _spans(comps["output"]) == [("output[boxes]", 1, 0, 4), ("output[scores]", 1, 4, 4 + CLASSES)]
    assert comps["output"][1].source == "scores" and comps["output"][1].where == "output[4:10] on axis 1"


def test_transpose_and_identity_after_the_concat():
    comps = output_components(detector(transpose=True, identity=True))
    assert _spans(comps["output"]) == [("output[boxes]", 2, 0, 4), ("output[scores]", 2, 4, 4 + CLASSES)]


def test_outputs_that_are_not_split():
    assert _spans(output_components(detector(batch_axis=True))["output"]) == [("output", None, 0, None)]
    # a size along the concat axis is symbolic: one component
    graph = helper.make_graph([helper.make_node("Concat", ["a", "b"], ["y"], axis=1)], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, "n", 2]),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 3, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    assert _spans(output_components(helper.make_model(graph))["y"]) == [("y", None, 0, None)]


def test_sizes_an_exporter_computes_from_shapes_are_followed():
    """boxes = Reshape(x, [Shape(x)[0], -1, 4]) then Transpose: onnx's shape inference leaves its sizes
    unknown, onnxruntime's symbolic inference (tried next) finds them: two components, not one."""
    i64 = lambda name, values: numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Concat", ["n", "rest"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["r"]),
             helper.make_node("Transpose", ["r"], ["boxes"], perm=[0, 2, 1]),
             helper.make_node("Sigmoid", ["c"], ["scores"]),
             helper.make_node("Concat", ["boxes", "scores"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 4]),
                                           helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 3, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [i64("zero", [0]), i64("rest", [-1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inferred = onnx.shape_inference.infer_shapes(model)
    assert not any(vi.name == "boxes" and all(d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)
                   for vi in inferred.graph.value_info)
    assert _spans(output_components(model)["y"]) == [("y[boxes]", 1, 0, 4), ("y[scores]", 1, 4, 7)]


def test_symbolic_inference_does_not_import_onnxruntime_tools():
    """Its package __init__ imports torch when installed (1.2 s of a 10 s quantization)."""
    code = ("import sys; from qpasses.analysis.output_components import _symbolic_inference; "
            "_symbolic_inference(); print('onnxruntime.tools' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_components_from_a_path_and_a_qmodel(tmp_path):
    path = tmp_path / "det.onnx"
    onnx.save(detector(), path)
    expected = _spans(output_components(detector())["output"])
    assert _spans(output_components(path)["output"]) == expected
    assert _spans(output_components(qpasses.load(path))["output"]) == expected


def test_repeated_concat_input_is_named_by_range():
    graph = helper.make_graph([helper.make_node("Concat", ["a", "a", "b"], ["y"], axis=-1)], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 3, 2]),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 3, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 9])])
    comps = output_components(helper.make_model(graph))["y"]
    assert _spans(comps) == [("y[0:2]", 2, 0, 2), ("y[2:4]", 2, 2, 4), ("y[4:9]", 2, 4, 9)]


# -- the detector: pooled SNR hides the probabilities ------------------------------------------

# The erased probabilities: every op quantized (Concat and Sigmoid stay float by default), the
# Concat output on the one 8-bit grid its 0..320 range gives (fixed here: compute-qparams would
# keep a Concat of ranges this far apart float) and search-precision off (its default target
# would keep the Concat float too)
ONE_GRID = {"op_types_to_quantize": "all", "accuracy": {"target": 0},
            "tensor_overrides": {"output": [{"scale": 320 / 255, "zero_point": 0}]}}


@pytest.fixture(scope="module")
def quantized_detector():
    float_model = detector()
    return float_model, qpasses.quantize(float_model, calibration_data=feeds(16, seed=2), config=ONE_GRID)


def test_pooled_snr_is_high_while_the_probabilities_are_lost(quantized_detector):
    float_model, quant = quantized_detector
    result = compare(float_model, quant, feeds(8), objective=Objective(), judged=True)
    assert "qdq-inserted" in quant.facts
    pooled, boxes, scores = result["snr_db"], result["components"]["output[boxes]"], result["components"]["output[scores]"]
    assert pooled > 30 and boxes > 30, result       # what the output SNR alone reports
    assert scores < 15, result                      # the probabilities share the boxes' 8-bit grid
    assert result["objective"]["overall"] == pytest.approx(scores)
    assert result["objective"]["outputs"] == {"output": ["output[boxes]", "output[scores]"]}


@pytest.mark.parametrize("config, kept_float", [
    (None, {"output": "Concat 'Concat_5' stays float by default", "scores": "Sigmoid 'Sigmoid_4' stays float by default"}),
    ({"op_types_to_quantize": "all", "accuracy": {"target": 0}}, {"output": "Concat 'Concat_5' joins ranges"}),
], ids=["default", "all-ops"])
def test_without_a_fixed_grid_the_probabilities_are_kept(config, kept_float):
    """By default Concat and Sigmoid stay float (saying why); with every op selected,
    compute-qparams still keeps the Concat of boxes and probabilities float (with search-precision
    off): the probabilities are not on the boxes' grid, and every component keeps its accuracy."""
    float_model = detector()
    quant = qpasses.quantize(float_model, calibration_data=feeds(16, seed=2), config=config)
    result = compare(float_model, quant, feeds(8), objective=Objective(), judged=True)
    assert "qdq-inserted" in quant.facts and "cls_logits" in quant.quant     # the Convs are quantized
    reasons = float_reasons(quant)
    for tensor, why in kept_float.items():
        assert tensor not in quant.quant and reasons[tensor]["reason"].startswith(why), reasons
    assert min(result["components"].values()) > 15, result     # the scores too, not only the boxes
    assert result["objective"]["overall"] == pytest.approx(min(result["components"].values()))


def test_run_prints_and_reports_the_components(tmp_path, quantized_detector, capsys):
    float_model, _ = quantized_detector
    src, out, report = tmp_path / "det.onnx", tmp_path / "q.onnx", tmp_path / "report.json"
    onnx.save(float_model, src)
    np.savez(tmp_path / "calib.npz", x=np.stack([f["x"] for f in feeds(16, seed=2)]))
    (tmp_path / "config.json").write_text(json.dumps(ONE_GRID))
    code = main(["run", str(src), "-o", str(out), "--calib", str(tmp_path / "calib.npz"), "--report", str(report),
                 "--config", str(tmp_path / "config.json"), "--html", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert code == 0, err
    lines = err.splitlines()
    snr_line = next(i for i, line in enumerate(lines) if "output SNR vs float" in line)
    assert lines[snr_line + 1].startswith("qpasses:   output[boxes]: SNR ")
    assert lines[snr_line + 2].startswith("qpasses:   output[scores]: SNR ")
    assert "objective:" not in err   # the first line is the objective
    data = json.loads(report.read_text())
    objective = data["objective"]
    assert objective["metric"] == "snr" and set(objective["components"]) == {"output[boxes]", "output[scores]"}
    assert objective["overall"] == min(objective["components"].values()) < 15 < data["accuracy"]["snr_db"]
    # the headline is the worst component (the class scores), not the whole output the boxes dominate
    assert re.match(rf"qpasses: output SNR vs float: {objective['overall']:.2f} dB over 16 samples, worst of 2 "
                    r"output components: output\[scores\]", lines[snr_line]), lines[snr_line]
    page = (tmp_path / "r.html").read_text()   # the report's first line says the same
    headline = page.index(f'<p class="headline"><b>output SNR vs float: {objective["overall"]:.2f} dB over 16 '
                          f'samples, worst of 2 output components: output[scores]</b>')
    assert headline < page.index("<table")
    assert data["accuracy"]["components"] == objective["components"]


# -- built-in metrics against numpy -----------------------------------------------------------

def _pair(seed=0, feeds_=3):
    rng = np.random.default_rng(seed)
    refs = [rng.standard_normal((2, 6, 5)).astype(np.float32) for _ in range(feeds_)]
    tests = [r + rng.standard_normal(r.shape).astype(np.float32) * 0.7 for r in refs]
    return refs, tests


COMPONENTS = {"y": [Component("y", "y[a]", 1, 0, 2, "a"), Component("y", "y[b]", 1, 2, 6, "b")]}


def test_cosine_is_the_mean_over_feeds_of_each_components_cosine():
    refs, tests = _pair()

    def cosine(r, t):
        r, t = r.ravel().astype(np.float64), t.ravel().astype(np.float64)
        return float(np.dot(r, t) / np.linalg.norm(r) / np.linalg.norm(t))

    scores = Objective("cosine", components=COMPONENTS).scores([{"y": r} for r in refs], [{"y": t} for t in tests])
    assert scores["y[a]"] == pytest.approx(np.mean([cosine(r[:, 0:2], t[:, 0:2]) for r, t in zip(refs, tests)]), rel=1e-12)
    assert scores["y[b]"] == pytest.approx(np.mean([cosine(r[:, 2:6], t[:, 2:6]) for r, t in zip(refs, tests)]), rel=1e-12)
    whole = Objective("cosine").scores([{"y": r} for r in refs], [{"y": t} for t in tests])
    assert whole == {"y": pytest.approx(np.mean([cosine(r, t) for r, t in zip(refs, tests)]), rel=1e-12)}
    zero = np.zeros((1, 6, 5), np.float32)
    assert Objective("cosine").scores({"y": zero}, {"y": zero}) == {"y": 1.0}
    assert Objective("cosine").scores({"y": zero}, {"y": zero + 1}) == {"y": 0.0}


def test_top1_is_the_argmax_agreement_over_the_last_axis_of_each_slice():
    refs, tests = _pair(1)
    objective = Objective("top1", components=COMPONENTS)
    scores = objective.scores_from_runs([[r] for r in refs], [[t] for t in tests], ["y"])
    for name, cut in (("y[a]", slice(0, 2)), ("y[b]", slice(2, 6))):
        agree = [np.argmax(r[:, cut], -1) == np.argmax(t[:, cut], -1) for r, t in zip(refs, tests)]
        assert scores[name] == np.concatenate([a.ravel() for a in agree]).mean()    # 3 feeds x 2 x sizes
    assert 0 < scores["y[a]"] < 1 and 0 < scores["y[b]"] < 1
    assert objective.overall(scores) == min(scores.values())
    assert Objective("top1").scores({"y": refs[0]}, {"y": refs[0]}) == {"y": 1.0}


def test_snr_per_component_and_the_function_form():
    refs, tests = _pair(2)
    objective = Objective("snr", components=COMPONENTS)
    scores = objective_scores(objective, [[r] for r in refs], [[t] for t in tests], ["y"])

    def snr(cut):
        r = np.concatenate([x[:, cut].ravel() for x in refs]).astype(np.float64)
        t = np.concatenate([x[:, cut].ravel() for x in tests]).astype(np.float64)
        return 10 * np.log10(np.sum(r * r) / np.sum((r - t) ** 2))

    assert scores == {"y[a]": pytest.approx(snr(slice(0, 2)), rel=1e-12), "y[b]": pytest.approx(snr(slice(2, 6)), rel=1e-12)}
    assert objective.scores({"y": refs[0]}, {"y": refs[0]}) == {"y[a]": np.inf, "y[b]": np.inf}
    # a run-time shape that does not match the static split: one component
    assert list(objective.scores({"y": refs[0][:, :5]}, {"y": tests[0][:, :5]})) == ["y"]


@pytest.mark.parametrize("metric", ["snr", "cosine", "top1", "user"])
def test_standard_error_is_the_jackknife_of_the_overall_score(metric):
    """Leave each feed out in turn: sqrt((n-1)/n * sum of squared deviations) of the overall score."""
    refs, tests = _pair(3, feeds_=6)
    tests[4] = refs[4] + (tests[4] - refs[4]) * 3   # one noisier feed: the spread is not uniform
    if metric == "user":
        objective = Objective(lambda f, q: -float(np.mean([np.abs(a["y"] - b["y"]).mean() for a, b in zip(f, q)])))
    else:
        objective = Objective(metric, components=COMPONENTS)
    runs_r, runs_t = [[r] for r in refs], [[t] for t in tests]
    left_out = np.array([objective.overall(objective.scores_from_runs(runs_r[:i] + runs_r[i + 1:],
                                                                      runs_t[:i] + runs_t[i + 1:], ["y"]))
                         for i in range(6)])
    if metric == "snr":   # on the worst component's error-to-signal ratio
        left_out = 10 ** (-left_out / 10)
    expected = np.sqrt(5 / 6 * np.sum((left_out - left_out.mean()) ** 2))
    error = objective.standard_error(runs_r, runs_t, ["y"])
    assert expected > 0 and error == pytest.approx(expected, rel=1e-9)
    assert objective.standard_error(runs_r[:1], runs_t[:1], ["y"]) == 0.0
    assert objective.standard_error(runs_r, runs_r, ["y"]) == 0.0   # identical: inf dB, 1, 1 on every feed
    score = objective.overall(objective.scores_from_runs(runs_r, runs_t, ["y"]))
    bound = objective.lower_bound(score, error, 1.0)
    if metric == "snr":
        assert bound == pytest.approx(-10 * np.log10(10 ** (-score / 10) + error), rel=1e-12)
    else:
        assert bound == pytest.approx(score - error, rel=1e-12)
    assert objective.lower_bound(score, error, 0.0) == pytest.approx(score, rel=1e-12) and bound < score


# -- user metrics ------------------------------------------------------------------------------

def test_user_metric_through_the_api(quantized_detector):
    float_model, quant = quantized_detector
    seen = {}

    def class_agreement(float_outputs, quant_outputs):
        seen["args"] = float_outputs, quant_outputs
        f = np.stack([o["output"][:, 4:].argmax(1) for o in float_outputs])
        q = np.stack([o["output"][:, 4:].argmax(1) for o in quant_outputs])
        return np.mean(f == q)

    result = compare(float_model, quant, feeds(5), objective=Objective(metric=class_agreement))
    float_outputs, quant_outputs = seen["args"]
    assert len(float_outputs) == len(quant_outputs) == 5
    assert all(list(o) == ["output"] and o["output"].shape == (1, 4 + CLASSES, ANCHORS)
               and o["output"].dtype == np.float32 for o in float_outputs + quant_outputs)
    ref_sess, q_sess = session(float_model), session(quant)
    runs = [(ref_sess.run(None, f)[0], q_sess.run(None, f)[0]) for f in feeds(5)]
    expected = np.mean([np.mean(r[:, 4:].argmax(1) == q[:, 4:].argmax(1)) for r, q in runs])
    summary = result["objective"]
    assert summary["metric"] == "class_agreement"
    assert summary["components"] == {"class_agreement": pytest.approx(expected)}
    assert summary["overall"] == pytest.approx(expected)
    assert set(result["components"]) == {"output[boxes]", "output[scores]"}    # the SNR per component stays


def test_user_metric_that_fails_or_returns_no_number():
    refs, tests = _pair()
    with pytest.raises(MetricError, match="metric boom failed: ZeroDivisionError"):
        Objective(lambda f, q: 1 / 0, name="boom").scores({"y": refs[0]}, {"y": tests[0]})
    with pytest.raises(MetricError, match="returned 'high', not a number"):
        Objective(lambda f, q: "high", name="text").scores({"y": refs[0]}, {"y": tests[0]})


METRIC_MODULE = textwrap.dedent("""
    import numpy as np

    def class_agreement(float_outputs, quant_outputs):
        f = np.stack([o["output"][:, 4:].argmax(1) for o in float_outputs])
        q = np.stack([o["output"][:, 4:].argmax(1) for o in quant_outputs])
        return float(np.mean(f == q))

    def broken(float_outputs, quant_outputs):
        raise RuntimeError("no labels here")

    NOT_A_FUNCTION = 3
""")


@pytest.fixture
def cli_files(tmp_path, quantized_detector):
    float_model, quant = quantized_detector
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "detmetric.py").write_text(METRIC_MODULE)
    onnx.save(float_model, tmp_path / "det.onnx")
    qpasses.save(quant, tmp_path / "q.onnx")
    np.savez(tmp_path / "calib.npz", x=np.stack([f["x"] for f in feeds(16, seed=2)]))
    np.savez(tmp_path / "eval.npz", x=np.stack([f["x"] for f in feeds(6)]))
    return tmp_path


def _cli(folder, *args, pythonpath=True):
    env = dict(os.environ, QPASSES_NO_PROGRESS="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder / "lib"), env.get("PYTHONPATH")]))
    work = folder / "elsewhere"
    work.mkdir(exist_ok=True)   # not the module's folder: it is found through PYTHONPATH only
    return subprocess.run([sys.executable, "-m", "qpasses", *map(str, args)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)


def test_user_metric_through_the_cli(cli_files):
    d = cli_files
    proc = _cli(d, "run", d / "det.onnx", "-o", d / "out.onnx", "--calib", d / "calib.npz", "--eval", d / "eval.npz",
                "--metric", "detmetric:class_agreement", "--report", d / "report.json")
    assert proc.returncode == 0, proc.stderr
    assert "qpasses:   output[scores]: SNR " in proc.stderr          # the components stay visible
    line = next(x for x in proc.stderr.splitlines() if x.startswith("qpasses: objective: "))
    report = json.loads((d / "report.json").read_text())
    value = report["objective"]["overall"]
    assert report["objective"]["metric"] == "detmetric:class_agreement" and 0 <= value <= 1
    worst = min(report["accuracy"]["components"].values())   # the SNR beside: the worst component's
    assert line == (f"qpasses: objective: detmetric:class_agreement {value:.6g} over 6 samples; "
                    f"output SNR vs float: {worst:.2f} dB")

    proc = _cli(d, "compare", d / "det.onnx", d / "q.onnx", "--data", d / "eval.npz", "--metric", "detmetric:class_agreement")
    assert proc.returncode == 0, proc.stderr
    assert "output[boxes]: SNR " in proc.stdout and "objective: detmetric:class_agreement " in proc.stdout


def test_compare_prints_every_component_in_the_chosen_metric(cli_files):
    d = cli_files
    proc = _cli(d, "compare", d / "det.onnx", d / "q.onnx", "--data", d / "eval.npz", "--metric", "cosine",
                pythonpath=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("output: SNR ")
    assert lines[1].startswith("output[boxes]: cosine ") and lines[1].endswith("(output[0:4] on axis 1)")
    assert lines[2].startswith("output[scores]: cosine ")
    assert lines[3].startswith("objective: cosine ") and lines[3].endswith("(worst component output[scores])")
    assert lines[4] == "samples: 6"   # cosine: no SNR spread line


def test_compare_says_how_far_the_samples_spread_take_the_worst_snr(cli_files):
    """With the snr objective, the samples line carries the worst component one jackknife standard
    error down (on the error-to-signal ratio): below the worst component's own SNR."""
    d = cli_files
    proc = _cli(d, "compare", d / "det.onnx", d / "q.onnx", "--data", d / "eval.npz", pythonpath=False)
    assert proc.returncode == 0, proc.stderr
    worst = float(re.search(r"objective: SNR (-?[0-9.]+) dB", proc.stdout).group(1))
    low = re.search(r"samples: 6 \(the worst component one standard error down, as they spread: SNR (-?[0-9.]+) dB\)",
                    proc.stdout)
    assert low and float(low.group(1)) < worst, proc.stdout


def test_metric_module_in_the_current_directory(cli_files, monkeypatch, capsys):
    monkeypatch.chdir(cli_files / "lib")
    monkeypatch.delitem(sys.modules, "detmetric", raising=False)
    objective = parse_metric("detmetric:class_agreement")
    assert objective.metric == "detmetric:class_agreement" and not objective.builtin
    assert main(["compare", str(cli_files / "det.onnx"), str(cli_files / "q.onnx"), "--data", str(cli_files / "eval.npz"),
                 "--metric", "detmetric:class_agreement"]) == 0
    assert "objective: detmetric:class_agreement " in capsys.readouterr().out


@pytest.mark.parametrize("spec, message", [
    ("psnr", "expected snr, cosine, top1 or module:function"),
    ("detmetric", "expected snr, cosine, top1 or module:function"),
    ("nosuchmodule_xyz:f", "cannot import module 'nosuchmodule_xyz'"),
    ("detmetric:missing", "has no 'missing'"),
    ("detmetric:NOT_A_FUNCTION", "is not callable"),
])
def test_bad_metric_spec_is_one_line_and_writes_nothing(cli_files, spec, message):
    d = cli_files
    out, report = d / "bad.onnx", d / "bad.json"
    proc = _cli(d, "run", d / "det.onnx", "-o", out, "--calib", d / "calib.npz", "--metric", spec, "--report", report)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and proc.stderr.startswith("qpasses: error: --metric")
    assert not out.exists() and not report.exists()
    assert not [p for p in d.iterdir() if p.name.startswith(".bad")]        # no temporary left either
    proc = _cli(d, "compare", d / "det.onnx", d / "q.onnx", "--data", d / "eval.npz", "--metric", spec)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stdout == ""


def test_a_failing_user_metric_is_a_user_error_and_leaves_no_output(cli_files):
    d = cli_files
    out = d / "broken.onnx"
    proc = _cli(d, "run", d / "det.onnx", "-o", out, "--calib", d / "calib.npz", "--metric", "detmetric:broken")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == ("qpasses: error: metric detmetric:broken failed: "
                                            "RuntimeError: no labels here")
    assert not out.exists()


def _runs(values):
    return [[np.asarray(v, np.float64)] for v in values]


def test_paired_difference_is_not_decided_by_one_feed():
    """A change better on 15 of 16 feeds and worse on one that holds most of the error: pooled, it
    reads several dB worse; the paired difference's standard error says the feeds cannot decide."""
    rng = np.random.default_rng(0)
    reference = [rng.normal(0, 1, 32) for _ in range(16)]
    old = [r + rng.normal(0, 0.02, 32) for r in reference]
    new = [r + rng.normal(0, 0.01, 32) for r in reference]
    old[3], new[3] = reference[3] + rng.normal(0, 0.3, 32), reference[3] + rng.normal(0, 0.6, 32)
    objective = Objective("snr")
    difference, error = objective.paired_difference(_runs(reference), _runs(old), _runs(new), ["y"])
    assert difference < -3 and error > -difference


def test_paired_difference_of_a_change_worse_on_every_feed_is_clear():
    rng = np.random.default_rng(1)
    reference = [rng.normal(0, 1, 32) for _ in range(16)]
    old = [r + rng.normal(0, 0.01, 32) for r in reference]
    new = [r + rng.normal(0, 0.02, 32) for r in reference]
    objective = Objective("snr")
    difference, error = objective.paired_difference(_runs(reference), _runs(old), _runs(new), ["y"])
    assert -7 < difference < -5 and error < 1
    same, zero = objective.paired_difference(_runs(reference), _runs(old), _runs(old), ["y"])
    assert same == 0 and zero == 0
