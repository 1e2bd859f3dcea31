"""The state-model invariants on real architectures and on the fuzz set (slow): `--verify-each
reload` changes nothing, and a run resumed from the saved model after select-by-snr gives the same
bytes as the uninterrupted one."""
from __future__ import annotations

import os

import onnx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.kits.fuzzgen.cases import cases
from qpasses import QpassesError
from qpasses.api import run_pipeline
from qpasses.core.context import RunContext
from qpasses.core.pipeline import QUANTIZE_PIPELINE, parse_pipeline
from qpasses.ir.model import from_proto, load, save
from qpasses.testing import random_feed

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
pytestmark = pytest.mark.slow


def _bytes(proto_model, config, feeds, passes=QUANTIZE_PIPELINE, **kw) -> bytes:
    model = from_proto(proto_model) if isinstance(proto_model, onnx.ModelProto) else proto_model
    run_pipeline(model, passes, ctx=RunContext(config, feeds), **kw)
    return model.to_proto().SerializeToString()


def _resumed(proto_model, config, feeds, cut: str, tmp_path) -> bytes:
    names = [p.text() for p in parse_pipeline(QUANTIZE_PIPELINE)]
    k = names.index(cut) + 1
    first = from_proto(proto_model)
    run_pipeline(first, ",".join(names[:k]), ctx=RunContext(config, feeds))
    save(first, tmp_path / "cut.onnx")
    return _bytes(load(tmp_path / "cut.onnx"), config, feeds, ",".join(names[k:]))


@pytest.mark.parametrize("name", ["light_squeezenet", "light_shufflenet", "light_resnet50"])
def test_light_models(name, tmp_path):
    proto = onnx.load(os.path.join(LIGHT, f"{name}.onnx"))
    feeds = [random_feed(proto, seed=s) for s in range(8)]
    # cpu x86-64-vnni: protect-pair-sums' emulation on random-normal feeds (most pairs past their cap)
    # takes ~90 s a run on light_resnet50; the state model is what is tested here
    config = {"calibration": {"method": "minmax"}, "cpu": "x86-64-vnni"}
    plain = _bytes(proto, config, feeds)
    assert _bytes(proto, config, feeds, verify_each="reload") == plain
    assert _resumed(proto, config, feeds, "select-by-snr", tmp_path) == plain


@settings(max_examples=25, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_fuzz_set(case):
    try:
        plain = _bytes(case.model, case.config, case.feeds)
    except QpassesError:
        return   # a one-line refusal: the fuzz test checks those
    assert _bytes(case.model, case.config, case.feeds, verify_each="reload") == plain
