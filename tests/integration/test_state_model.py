"""The state model: what a later pass reads is saved in the model, so a run resumed from any
saved intermediate model gives the same bytes as the uninterrupted run, and `--verify-each reload`
(which continues from the saved form after every pass) changes nothing."""
from __future__ import annotations

import numpy as np
import pytest

from qpasses.api import run_pipeline
from qpasses.cli.examples import example_model
from qpasses.config.quant_config import CalibrationConfig
from qpasses.core.context import RunContext
from qpasses.core.facts import CHECKERS, CLAIMS, check_facts
from qpasses.core.pipeline import QUANTIZE_PIPELINE, PassManager, parse_pipeline, print_pipeline
from qpasses.core.registry import all_passes
from qpasses.errors import ModelError, PassFailure, PipelineError, PreconditionError
from qpasses.ir.model import from_proto, load, save


def _feeds(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input": rng.normal(0.3, 1.0, (1, 3, 32, 32)).astype(np.float32)} for _ in range(n)]


CONFIGS = {
    "default": ({}, QUANTIZE_PIPELINE),
    "uint16": ({"activation_type": "uint16"}, QUANTIZE_PIPELINE),
    "per-tensor-minmax": ({"per_channel": False, "calibration": {"method": "minmax"}}, QUANTIZE_PIPELINE),
    "mixed-precision": ({"mixed_precision": {"relu1": "uint16"}}, QUANTIZE_PIPELINE),
    "bias-correction-scored": ({"activation_type": "uint16"},
                               QUANTIZE_PIPELINE.replace("select-by-snr", "select-by-snr{bias_correction=true}")),
    "bias-correction-8bit": ({}, QUANTIZE_PIPELINE.replace("correct-bias", "correct-bias{activation_bits=8}")),
}


def _run(model, passes, config, data, **kw):
    model, _ = run_pipeline(model, passes, ctx=RunContext(config, data), **kw)
    return model


def _bytes(model) -> bytes:
    return model.to_proto().SerializeToString()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_resuming_from_any_saved_model_gives_the_same_bytes(name, tmp_path):
    config, text = CONFIGS[name]
    data = _feeds(12)
    whole = _bytes(_run(from_proto(example_model()), text, config, data))
    passes = [p.text() for p in parse_pipeline(text)]
    for k in range(1, len(passes)):
        first = _run(from_proto(example_model()), ",".join(passes[:k]), config, data)
        save(first, tmp_path / "cut.onnx")
        resumed = _run(load(tmp_path / "cut.onnx"), ",".join(passes[k:]), config, data)
        assert _bytes(resumed) == whole, f"{name}: resuming after {passes[k - 1]} (pass {k}) differs"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_verify_each_reload_changes_nothing(name):
    config, text = CONFIGS[name]
    data = _feeds(12)
    plain = _bytes(_run(from_proto(example_model()), text, config, data))
    reloaded = _bytes(_run(from_proto(example_model()), text, config, data, verify_each="reload"))
    assert reloaded == plain


def test_dump_after_models_resume_to_the_same_bytes(tmp_path):
    """The issue's case: uint16, select-by-snr scoring bias correction, resumed from the dumps."""
    config, text = CONFIGS["bias-correction-scored"]
    data = _feeds(12)
    whole = _run(from_proto(example_model()), text, config, data, dump_after=tmp_path)
    passes = [p.text() for p in parse_pipeline(text)]
    dumps = sorted(tmp_path.glob("*.onnx"))
    assert len(dumps) == len(passes), [d.name for d in dumps]   # one per pass, in pipeline order
    for k, dumped in enumerate(dumps, start=1):
        if k == len(passes):
            assert _bytes(load(dumped)) == _bytes(whole)
            continue
        resumed = _run(load(dumped), ",".join(passes[k:]), config, data)
        assert _bytes(resumed) == _bytes(whole), f"resuming from {dumped.name}"


def test_decisions_are_saved_and_correct_bias_runs_once():
    config = {"activation_type": "uint16"}
    data = _feeds(8)
    model = _run(from_proto(example_model()), "annotate-types,calibrate,compute-qparams,correct-bias",
                 config, data)
    assert model.decisions["bias_correction"] == {"by": "correct-bias", "applied": True}
    assert model.decisions["calibration"]["method"] == CalibrationConfig.method
    reloaded = from_proto(model.to_proto())
    assert reloaded.decisions == model.decisions
    biases = {n: np.array(t.values) for n, t in reloaded.tensors().items() if n.endswith("_b")}
    result = PassManager("correct-bias").run(reloaded, RunContext(config, data))
    assert not result[0].modified
    assert all(np.array_equal(biases[n], reloaded.tensors()[n].values) for n in biases)


# -- facts -----------------------------------------------------------------------------------
def test_every_fact_has_a_checker_and_is_read_by_a_pass_or_checks_a_claim():
    passes = all_passes().values()
    named = set().union(*(p.requires | p.establishes | p.preserves for p in passes))
    assert named <= CHECKERS.keys()
    required = set().union(*(p.requires for p in passes))
    established = set().union(*(p.establishes for p in passes))
    assert established <= required | CLAIMS, f"facts nothing reads: {established - required - CLAIMS}"
    # the rewrites passes report are claims their passes establish; qdq-inserted, which later passes
    # require, keeps the facts' safe default
    assert CLAIMS == {"weights-quantized", "converts-inserted", "dynamic-quantized"} and CLAIMS <= established


def test_a_modifying_pass_drops_the_facts_it_does_not_preserve():
    model = _run(from_proto(example_model()), "annotate-types,calibrate,compute-qparams", {}, _feeds(4))
    assert {"types-annotated", "calibrated", "qparams-computed"} <= model.facts
    PassManager("fold-constants").run(model)        # nothing to fold: keeps every fact
    assert "qparams-computed" in model.facts
    model = _run(from_proto(example_model()), "annotate-types,calibrate,compute-qparams", {}, _feeds(4))
    PassManager("annotate-types").run(model, RunContext({"per_channel": False}))   # a new table
    assert model.facts == {"types-annotated", "calibrated"}
    with pytest.raises(PreconditionError, match="qparams-computed.*compute-qparams"):
        PassManager("insert-qdq").run(model)


def test_fact_checkers_catch_a_broken_decision():
    model = _run(from_proto(example_model()), "annotate-types,calibrate,compute-qparams", {}, _feeds(4))
    check_facts(model)
    name = next(n for n, tq in model.quant.items() if tq.role == "activation" and tq.shares is None)
    model.quant[name].scale = [float("nan")]
    with pytest.raises(ModelError, match=f"fact 'qparams-computed' does not hold: '{name}'"):
        check_facts(model)
    del model.ranges[name]
    with pytest.raises(ModelError, match="fact 'calibrated' does not hold"):
        check_facts(model)


def test_verify_each_names_the_pass_that_broke_a_fact():
    from qpasses import Pass, PassResult, register
    from qpasses.core.registry import unregister

    @register
    class BreakTable(Pass):
        """Test pass: claims to preserve the table but renames a tensor behind its back."""
        name = "break-table"
        preserves = frozenset({"types-annotated"})

        def run(self, model, ctx):
            model.tensors()["relu1"].name = "renamed"
            return PassResult(model, True)

    try:
        model = from_proto(example_model())
        with pytest.raises(PassFailure, match="after pass 'break-table': fact 'types-annotated'"):
            run_pipeline(model, "fold-batchnorm,annotate-types,break-table", verify_each="structure")
    finally:
        unregister("break-table")


# -- pipeline text ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "fold-constants,cleanup",
    'calibrate{method=minmax,data="/a,b.npz"}',
    'select-by-snr{then="compute-qparams,insert-qdq"}',
    'select-by-snr{then="compute-qparams,fix-bias-scales{enabled=false},insert-qdq"}',
    'calibrate{data="say \\"hi\\", \\\\ then"}',
])
def test_pipeline_text_round_trips_exactly(text):
    once = print_pipeline(parse_pipeline(text))
    assert once == text
    assert print_pipeline(parse_pipeline(once)) == once


def test_quoted_values_keep_their_text():
    (p,) = parse_pipeline("calibrate{data='/a,b{c}.npz'}")
    assert p.data == "/a,b{c}.npz"


@pytest.mark.parametrize("text, message", [
    ("select-by-snr{then=bogus-pass}", "option 'then' of pass 'select-by-snr': unknown pass 'bogus-pass'"),
    ('select-by-snr{then="compute-qparams{nope=1}"}', "has no option 'nope'"),
    ('calibrate{data="/a', "unclosed"),
    ("calibrate{method}", "needs key=value"),
    ("cleanup{}x", "expected ','"),
])
def test_bad_pipeline_text_is_one_clear_error(text, message):
    with pytest.raises(PipelineError, match=message):
        parse_pipeline(text)


def test_nested_pipelines_are_timed_and_verified():
    from qpasses.core.instruments import TimePasses

    timer = TimePasses()
    run_pipeline(from_proto(example_model()), "annotate-types,calibrate,select-by-snr",
                 config={}, calibration_data=_feeds(8), time_passes=timer, verify_each="reload")
    nested = [row for row in timer.rows if row[4] == 1]
    assert [row[0] for row in nested][:4] == ["compute-qparams", "fix-bias-scales", "insert-qdq", "insert-converts"]
    assert "└ compute-qparams" in timer.table()


def test_reproducer_replays_a_config_caused_failure(tmp_path):
    import subprocess
    import sys

    from qpasses.cli.examples import write_example

    model, calib, _ = write_example(tmp_path / "ex")
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"mixed_precision": {"no_such_tensor": "uint16"}}')
    repro = tmp_path / "repro"
    run = subprocess.run([sys.executable, "-m", "qpasses", "run", str(model), "-o", str(tmp_path / "q.onnx"),
                          "--calib", str(calib), "--config", str(cfg), "--reproducer", str(repro)],
                         capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert (repro / "config.json").exists() and (repro / "command.txt").exists()
    command = (repro / "command.txt").read_text().strip()
    assert "--config" in command and str(calib.resolve()) in command
    replay = subprocess.run(command.replace("qpasses run", f"{sys.executable} -m qpasses run", 1),
                            shell=True, capture_output=True, text=True)
    assert replay.returncode == 2 and "no_such_tensor" in replay.stderr, replay.stderr
    assert not (repro / "output.onnx").exists()


def test_findings_are_write_only_for_passes():
    """Passes write findings; only the caller reads them (no pass decides from another's report)."""
    import ast
    from pathlib import Path

    import qpasses.passes

    for path in Path(qpasses.passes.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (node.attr in ("as_dict", "_data") or (
                    node.attr == "report" and isinstance(node.value, ast.Name) and node.value.id in ("model", "ctx"))):
                pytest.fail(f"{path.name}:{node.lineno} reads '{node.attr}'")


def test_cleanup_forgets_what_it_removes_so_its_facts_hold():
    from qpasses.testing import parse

    model = from_proto(parse("""
        g (float[1, 4] x) => (float[1, 4] y) {
            y = Relu(x)
            d = Sigmoid(x)
            e = Identity(d)
        }"""))
    config = {"op_types_to_quantize": "all"}
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(1, 4)).astype(np.float32)} for _ in range(4)]
    model = _run(model, "annotate-types,calibrate,compute-qparams", config, data)
    assert "d" in model.quant and "d" in model.ranges
    _run(model, "cleanup", config, data, verify_each="structure")   # checks the facts it keeps
    assert "d" not in model.quant and "e" not in model.quant and "d" not in model.ranges
    assert {"types-annotated", "calibrated", "qparams-computed"} <= model.facts


def test_instruments_of_one_run_do_not_leak_into_the_next():
    from qpasses.core.instruments import TimePasses

    ctx = RunContext({}, _feeds(4))
    timer = TimePasses()
    model = from_proto(example_model())
    PassManager("fold-batchnorm", [timer]).run(model, ctx)
    PassManager("cleanup").run(model, ctx)
    assert [row[0] for row in timer.rows] == ["fold-batchnorm"]
