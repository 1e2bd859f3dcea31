"""Executors (qpasses.executors): the spec, and sharded calibration that merges to exactly the
statistics, ranges and model of the one-process run. A LocalExecutor with several workers takes
the sharded code path in this process; tests/executors/test_ray.py runs it on Ray."""
import subprocess
import sys

import numpy as np
import pytest

from qpasses import executors
from qpasses.api import run_pipeline
from qpasses.calibration.collectors import Histogram, TensorStats
from qpasses.calibration.kept import KeptSamples
from qpasses.calibration.ranges import calibrate_ranges
from qpasses.calibration.runner import collect_stats
from qpasses.calibration.sharded import sharded_stats
from qpasses.cli.examples import example_data, example_model
from qpasses.config.quant_config import load_config
from qpasses.core.context import RunContext
from qpasses.errors import ConfigError
from qpasses.ir.model import load, save

SAMPLES = 23   # not a multiple of the shard counts: uneven shards


def _feeds(n=SAMPLES):
    data = example_data(n)
    return [{"input": x} for x in data["input"]]


def _hist_state(h: Histogram):
    return (h.exponent, h.offset, h.lo, h.hi, h.zeros, h.total, h.counts.tolist())


@pytest.mark.parametrize("spec, parsed", [("local", ("local", None)), ("ray", ("ray", None)),
                                          ("ray:auto", ("ray", "auto")), ("RAY:10.0.0.5:6379", ("ray", "10.0.0.5:6379"))])
def test_spec(spec, parsed):
    assert executors.parse(spec) == parsed


@pytest.mark.parametrize("spec", ["dask", "local:4", "ray:", " ", 3])
def test_bad_spec_is_one_config_line(spec):
    assert executors.parse("") == executors.parse(None) == ("local", None)   # empty: the default
    with pytest.raises(ConfigError) as err:
        load_config({"executor": spec})
    assert "\n" not in str(err.value) and "executor" in str(err.value)


def test_local_never_imports_ray():
    code = ("import sys; from qpasses import executors; from qpasses.api import quantize; "
            "from qpasses.cli.examples import example_model, example_data; "
            "quantize(example_model(), example_data(4), config={'executor': 'local'}); "
            "assert 'ray' not in sys.modules and executors.get('local').parallel is False")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_histogram_merge_is_exact():
    rng = np.random.default_rng(0)
    parts = [rng.normal(0, s, 5000).astype(np.float32) * (i + 1) for i, s in enumerate([0.01, 1.0, 30.0, 0.5])]
    parts[1][:100] = 0.0
    parts.append(np.array([3.0e4], np.float32))          # one outlier: the grid widens many times
    whole = Histogram(64)
    for x in parts:
        whole.add(x)
    for split in (1, 2, 4):
        merged = Histogram(64)
        for group in (parts[:split], parts[split:]):
            h = Histogram(64)
            for x in group:
                h.add(x)
            merged.merge(h)
        assert _hist_state(merged) == _hist_state(whole)
    empty = Histogram(64)
    empty.merge(whole)
    assert _hist_state(empty) == _hist_state(whole)


def test_moving_average_merge_replays_in_order():
    ranges = [(-1.0, 2.0), (-3.0, 1.0), (-0.5, 0.25), (float("inf"), 1.0), (-2.0, 4.0)]
    whole = TensorStats(0, 0.01)
    for r in ranges:
        whole.update_range(*r)
    first, second = TensorStats(0, 0.01, mergeable=True), TensorStats(0, 0.01, mergeable=True)
    for r in ranges[:2]:
        first.update_range(*r)
    for r in ranges[2:]:
        second.update_range(*r)
    first.merge(second)
    assert (first.avg, first.min, first.max, first.samples) == (whole.avg, whole.min, whole.max, whole.samples)


@pytest.mark.parametrize("method, moving", [("minmax", False), ("minmax", True), ("percentile", False),
                                            ("entropy", False), ("mse", False)])
@pytest.mark.parametrize("workers", [2, 5])
def test_sharded_calibration_is_exact(method, moving, workers):
    model = load(example_model())
    kw = dict(method=method, moving_average=moving, num_bins=128)
    local_kept, sharded_kept = KeptSamples(7, 2**20), KeptSamples(7, 2**20)
    local = calibrate_ranges(model, _feeds(), kept=local_kept, **kw)
    sharded = calibrate_ranges(model, _feeds(), kept=sharded_kept, executor=executors.LocalExecutor(workers), **kw)
    assert local == sharded   # ranges, observed and sample count, in the same order
    assert list(local[0]) == list(sharded[0])
    assert sharded_kept.names == local_kept.names and len(sharded_kept.feeds) == len(local_kept.feeds) == 7
    for a, b in zip(local_kept.outputs, sharded_kept.outputs):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_sharded_histograms_equal():
    model = load(example_model())
    whole, n = collect_stats(model, _feeds(), method="percentile", num_bins=128)
    merged, m = sharded_stats(executors.LocalExecutor(3), model, _feeds(), method="percentile", num_bins=128)
    assert n == m == SAMPLES and list(whole) == list(merged)
    for name in whole:
        assert _hist_state(whole[name].hist) == _hist_state(merged[name].hist), name
        assert whole[name].samples == merged[name].samples


def test_kept_feeds_refill_across_small_shards():
    """Shards smaller than the kept count: the driver keeps the same first feeds, byte limit included."""
    model = load(example_model())
    per_feed = 3 * 32 * 32 * 4 + 10 * 4
    for limit, max_bytes in ((20, 2**20), (20, 9 * per_feed + 10)):
        local, sharded = KeptSamples(limit, max_bytes), KeptSamples(limit, max_bytes)
        collect_stats(model, _feeds(), kept=local)
        sharded_stats(executors.LocalExecutor(6), model, _feeds(), kept=sharded)
        assert (len(local.feeds), local.full, local.bytes) == (len(sharded.feeds), sharded.full, sharded.bytes)


def test_pipeline_model_is_byte_identical(monkeypatch, tmp_path):
    """The whole default pipeline (select-by-snr, search-precision included) with a sharding
    executor writes the same bytes as the local run."""
    data = example_data(SAMPLES)
    outputs = []
    for workers in (1, 3):
        monkeypatch.setitem(executors._cache, ("local", None), executors.LocalExecutor(workers))
        model, _ = run_pipeline(example_model(), config={"calibration": {"method": "minmax"}}, calibration_data=data)
        path = tmp_path / f"w{workers}.onnx"
        save(model, path)
        outputs.append(path.read_bytes())
    assert outputs[0] == outputs[1]


def _select_findings(workers, monkeypatch, tmp_path):
    monkeypatch.setitem(executors._cache, ("local", None), executors.LocalExecutor(workers))
    ctx = RunContext({"per_channel": False}, example_data(SAMPLES))
    model, _ = run_pipeline(example_model(), ctx=ctx)
    return ctx.findings.as_dict()["select-by-snr"], save(model, tmp_path / f"s{workers}.onnx").read_bytes()


def test_select_by_snr_scored_as_tasks_decides_the_same(monkeypatch, tmp_path):
    """Four variants (ranges x weights) scored up front as tasks: the replayed duels give the same
    scores, sample counts, early stops and choice as scoring them one after the other."""
    local, local_bytes = _select_findings(1, monkeypatch, tmp_path)
    tasks, task_bytes = _select_findings(3, monkeypatch, tmp_path)
    assert len(local["variants"]) == 4
    assert local == tasks and local_bytes == task_bytes


def test_replayed_contender_fails_on_the_feed_that_failed():
    from qpasses.evaluation.evaluate import Reference
    from qpasses.executors.scoring import Replayed

    feeds = [{"x": np.zeros(1, np.float32)} for _ in range(6)]
    reference = Reference(["y"], ["x"], feeds, [[np.ones(1)] for _ in feeds])
    errors = np.arange(6.0).reshape(6, 1)
    replay = Replayed(reference, {"errors": errors, "done": 4, "failure": RuntimeError("feed 4")}, penalty=0.5)
    replay.advance(3)
    assert replay.ran == 3 and replay.penalty == 0.5
    with pytest.raises(RuntimeError, match="feed 4"):
        replay.advance(6)
    assert replay.ran == 4
    with pytest.raises(ValueError, match="no session"):
        Replayed(reference, {"errors": None, "done": -1, "failure": ValueError("no session")})


def test_ray_absent_is_one_line_naming_the_install(monkeypatch):
    from qpasses.errors import QpassesError
    from qpasses.executors.ray import RayExecutor

    monkeypatch.setitem(sys.modules, "ray", None)   # import ray raises ImportError
    with pytest.raises(QpassesError) as err:
        RayExecutor()
    assert str(err.value) == "--executor ray needs Ray, which is not installed: pip install 'qpasses[ray]'"


def test_cli_rejects_a_bad_executor_before_writing(tmp_path):
    from qpasses.cli import main
    from qpasses.cli.examples import write_example

    write_example(tmp_path)
    out = tmp_path / "out.onnx"
    code = main(["run", str(tmp_path / "model.onnx"), "-o", str(out), "--calib", str(tmp_path / "calib.npz"),
                 "--executor", "spark", "--quiet"])
    assert code == 2 and not out.exists()
