"""compare --per-layer: when reading the tensors changes what the provider executes, bisect over
them to name the ones whose reading changes the output SNR, in about log2(n) compilations."""
import math

import numpy as np
import onnx
import pytest

from qpasses.evaluation.evaluate import session
from qpasses.report import localise, provider
from qpasses.report.backends import with_outputs

from tests.kits import report_kit


class Table:
    """A fake provider: the output SNR of a compilation is a function of the tensors read."""

    def __init__(self, rule):
        self.rule, self.compiled = rule, 0

    def reading(self, names):
        self.compiled += 1
        error = 10 ** (-self.rule(set(names)) / 20)   # 100 ones against 1 + error: SNR = -20 log10(error)
        return lambda feed: [np.full(100, 1 + error)]


NAMES = [f"t{i}" for i in range(100)]
REFS = [[np.ones(100)]]


def _run(rule):
    fake = Table(rule)
    result = localise.localise(fake, NAMES, [{}], REFS, rule(set()), rule(set(NAMES)))
    assert result is None or result["compilations"] == fake.compiled
    return result


def test_one_tensor_whose_reading_repairs_the_output():
    result = _run(lambda read: 88.0 if "t37" in read else 7.0)
    assert [f["tensor"] for f in result["found"]] == ["t37"] and result["complete"]
    assert result["found"][0]["snr_read_alone_db"] == pytest.approx(88.0)
    assert result["compilations"] <= math.ceil(math.log2(100)) + 2   # the bisection, alone, the rest
    text = "\n".join(localise.lines(result))
    assert "differs around t37 (reading it changes the output from 7.0 dB to 88.0 dB)" in text


def test_each_of_several_tensors_changes_it_and_the_search_resumes_after_each():
    result = _run(lambda read: 7.0 + 20 * len(read & {"t10", "t50", "t90"}))
    assert [f["tensor"] for f in result["found"]] == ["t10", "t50", "t90"]
    assert result["compilations"] <= localise.MAX_FOUND * (math.ceil(math.log2(100)) + 2)


def test_a_tensor_that_matters_only_after_another_is_named_as_such():
    result = _run(lambda read: 60.0 if {"t3", "t70"} <= read else 7.0)
    found = result["found"][0]
    assert found["tensor"] == "t70" and found["earlier_read"] == 70
    assert "after the 70 tensors before it" in "\n".join(localise.lines(result)) and "alone it does not" in \
        "\n".join(localise.lines(result))


def test_reading_that_makes_it_worse_is_found_too_and_no_gap_searches_nothing():
    assert _run(lambda read: 30.0 - 10 * ("t5" in read))["found"][0]["tensor"] == "t5"
    assert _run(lambda read: 30.0 + 0.5 * ("t5" in read)) is None
    assert _run(lambda read: math.inf if "t5" in read else 20.0)["found"][0]["tensor"] == "t5"


class FragileUnlessRead:
    """A stand-in provider executing the QDQ model as written, except that while the integers of
    ``TENSOR`` are not read, its QuantizeLinear's zero point is 20 higher (a fusion that goes
    wrong as deployed and that reading the tensor prevents)."""

    name, TENSOR = "fragile", "bn2"

    def __init__(self, qproto, qnames):
        self.qproto, self.qnames = qproto, list(qnames)
        self.outputs = [o.name for o in qproto.graph.output]
        self.q_of = {n.input[0]: n.output[0] for n in qproto.graph.node if n.op_type == "QuantizeLinear"}
        self.readable, self.dropped, self.notes = set(qnames), set(), []
        self._exposed = self.reading(self.qnames, fetch=self.qnames + self.outputs)
        self._deployed = self.reading([])

    def reading(self, names, fetch=None):
        proto = onnx.ModelProto()
        proto.CopyFrom(self.qproto)
        if self.q_of[self.TENSOR] not in names:
            node = next(n for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == self.TENSOR)
            zp = onnx.numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == node.input[2]))
            proto.graph.initializer.append(onnx.numpy_helper.from_array(zp + np.asarray(20, zp.dtype), "zp20"))
            node.input[2] = "zp20"
        sess = session(with_outputs(proto, names), optimize=False)
        fetch = fetch or self.outputs
        return lambda feed: sess.run(fetch, feed)

    def run(self, feed):
        return dict(zip(self.qnames + self.outputs, self._exposed(feed)))

    def deployed(self, feed):
        return self._deployed(feed)

    def kernel(self, qname):
        return "fragile"

    def cause(self, qname):
        return "?"


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return report_kit.quantized_example(tmp_path_factory.mktemp("example"))


def test_compare_names_the_tensor_whose_reading_repairs_the_provider(example, monkeypatch, capsys):
    model, q, evals = example
    monkeypatch.setitem(provider.PROVIDERS, "fragile", FragileUnlessRead)
    result = provider.compare_per_layer(model, q, evals, provider="fragile", samples=4)
    out = result["outputs"]["logits"]
    assert out["provider_snr_db"] < out["provider_read_snr_db"] - 6   # as deployed, 20 LSB off at bn2
    changes = result["read_changes"]
    assert [f["tensor"] for f in changes["found"]] == ["bn2"] and changes["complete"]
    assert changes["deployed_snr_db"] == pytest.approx(out["provider_snr_db"])
    assert changes["found"][0]["snr_read_alone_db"] == pytest.approx(out["provider_read_snr_db"], abs=1e-6)
    n = len(result["tensors"])
    assert changes["searched"] == n and changes["compilations"] <= math.ceil(math.log2(n)) + 2
    text = "\n".join(provider.table(result))
    assert (f"the provider's execution differs around bn2 (reading it changes the output from "
            f"{out['provider_snr_db']:.1f} dB to {out['provider_read_snr_db']:.1f} dB)") in text


def test_nothing_is_searched_when_reading_changes_nothing(example):
    model, q, evals = example
    result = provider.compare_per_layer(model, q, evals, samples=2)   # onnxruntime: the outputs agree
    assert result["read_changes"] is None
    assert not any("differs around" in line for line in provider.table(result))
