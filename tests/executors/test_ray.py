"""Ray as the executor (slow; skipped without Ray): a local cluster of 2 CPUs gives the statistics
and models of the one-process run."""
import pytest

ray = pytest.importorskip("ray")

from qpasses import executors  # noqa: E402
from qpasses.api import run_pipeline  # noqa: E402
from qpasses.calibration import sharded  # noqa: E402
from qpasses.calibration.runner import collect_stats  # noqa: E402
from qpasses.calibration.sharded import sharded_stats  # noqa: E402
from qpasses.cli.examples import example_data, example_model  # noqa: E402
from qpasses.executors.ray import runtime_env  # noqa: E402
from qpasses.ir.model import load, save  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env())
    executors._cache.pop(("ray", None), None)
    yield executors.get("ray")
    executors._cache.pop(("ray", None), None)
    ray.shutdown()


def _feeds(n=24):
    return [{"input": x} for x in example_data(n)["input"]]


def test_workers_and_shards(cluster):
    assert cluster.workers == 2 and cluster.parallel
    model = load(example_model())
    stats, count = sharded_stats(cluster, model, _feeds(), method="minmax")
    assert count == 24 and sharded.LAST["shards"] == 2


@pytest.mark.parametrize("method", ["percentile", "entropy"])
def test_histograms_equal(cluster, method):
    model = load(example_model())
    whole, _ = collect_stats(model, _feeds(), method=method, num_bins=256)
    merged, _ = sharded_stats(cluster, model, _feeds(), method=method, num_bins=256)
    assert list(whole) == list(merged)
    for name in whole:
        a, b = whole[name].hist, merged[name].hist
        assert (a.exponent, a.offset, a.lo, a.hi, a.zeros) == (b.exponent, b.offset, b.lo, b.hi, b.zeros)
        assert (a.counts == b.counts).all(), name


@pytest.mark.parametrize("config", [{"calibration": {"method": "minmax"}}, {"calibration": {"method": "entropy"}},
                                    {}])   # {}: percentile, then select-by-snr and search-precision choose
def test_models_are_byte_identical(cluster, config, tmp_path):
    data = example_data(24)
    written = []
    for spec in ("local", "ray"):
        model, _ = run_pipeline(example_model(), config=dict(config, executor=spec), calibration_data=data)
        written.append(save(model, tmp_path / f"{spec}.onnx").read_bytes())
    assert written[0] == written[1]


def test_search_precision_on_ray_decides_the_same(cluster, tmp_path, monkeypatch):
    """search-precision's checks as rounds of tasks on 2 CPUs: its decision, findings and the
    model bytes are the local run's (a model where it keeps four of twelve tensors float)."""
    from tests.executors.test_speculate import BRANCHY, _feeds as branchy_feeds

    from qpasses.core.context import RunContext
    from qpasses.core.pipeline import PassManager
    from qpasses.executors import speculate
    from qpasses.ir.model import from_proto
    from qpasses.testing import parse

    monkeypatch.setattr(speculate, "width", lambda workers, build, score: workers)   # not from timings
    runs = []
    for spec in ("local", "ray"):
        speculate.LAST.clear()
        model = from_proto(parse(BRANCHY))
        ctx = RunContext({"op_types_to_quantize": ["Tanh", "Mul"], "calibration": {"method": "minmax"},
                          "executor": spec}, branchy_feeds(40))
        PassManager("annotate-types,calibrate{hold_out=8},search-precision{target=30},compute-qparams,"
                    "fix-bias-scales,insert-qdq,insert-converts").run(model, ctx)
        runs.append((model.decisions["precision_search"], ctx.findings.as_dict()["search-precision"],
                     save(model, tmp_path / f"{spec}.onnx").read_bytes()))
    assert runs[0] == runs[1] and len(runs[0][0]["promoted"]) >= 2
    assert 0 < speculate.LAST["rounds"] < speculate.LAST["used"] == runs[0][0]["evaluations"] - 1
