"""Nothing lost (issue 14), classes 3 and 4: bad input is a user error (exit 2, one line naming the
file, tensor or key) before any work, never an internal error (exit 1) and never silently accepted.

- typed validation: config values and containers, nested pipeline text, the ``qpasses.*`` metadata
  a saved model carries (for run and explain);
- model and data edges: initializer types and shapes, external data entries, file names too long,
  npz members that cannot be read, compare on models that do not match, undefined types, subgraphs
  reading nothing, NaN/Inf/huge weights (refused, naming the tensor: see README).
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.kits.nothing_lost_kit import (Workspace, assert_refused, convs, mlp, set_external, with_initializer,
                              with_raw_data, write_model, write_npz)
from qpasses.testing import parse


# -- config: every value typed and in range ------------------------------------------------------------
CONFIGS = [
    ("percentile not a number", {"calibration": {"percentile": "abc"}}, "calibration.percentile"),
    ("num_bins not a number", {"calibration": {"num_bins": "many"}}, "calibration.num_bins"),
    ("averaging_constant not a number", {"calibration": {"averaging_constant": "x"}}, "calibration.averaging_constant"),
    ("minimum_real_range not a number", {"minimum_real_range": "abc"}, "minimum_real_range"),
    ("calibration a string", {"calibration": "minmax"}, "calibration"),
    ("extra_options a string", {"extra_options": "abc"}, "extra_options"),
    ("extra_options a list", {"extra_options": [1]}, "extra_options"),
    ("minimum_real_range NaN", "{\"minimum_real_range\": NaN}", "minimum_real_range"),
    ("minimum_real_range negative", {"minimum_real_range": -1}, "minimum_real_range"),
    ("minimum_real_range Infinity", "{\"minimum_real_range\": Infinity}", "minimum_real_range"),
    ("percentile NaN", "{\"calibration\": {\"percentile\": NaN}}", "calibration.percentile"),
    ("percentile above 100", {"calibration": {"percentile": 101}}, "calibration.percentile"),
    ("percentile zero", {"calibration": {"percentile": 0}}, "calibration.percentile"),
    ("num_bins fractional", {"calibration": {"num_bins": 3.5}}, "calibration.num_bins"),
    ("num_bins boolean", {"calibration": {"num_bins": True}}, "calibration.num_bins"),
    ("averaging_constant above 1", {"calibration": {"averaging_constant": 2}}, "calibration.averaging_constant"),
    ("per_channel_axes a list", {"per_channel_axes": [0]}, "per_channel_axes"),
    ("per_channel_axes axis text", {"per_channel_axes": {"Conv": "0"}}, "per_channel_axes"),
    ("per_channel_axes axis out of rank", {"per_channel_axes": {"Conv": 7}}, "axis 7 for Conv is outside the rank"),
    ("per_channel_axes negative out of rank", {"per_channel_axes": {"Conv": -5}}, "axis -5 for Conv is outside the rank"),
    ("activation_type a number", {"activation_type": 8}, "activation_type"),
    ("per_channel a string", {"per_channel": "yes"}, "per_channel"),
    ("mixed_precision a list", {"mixed_precision": ["c1"]}, "mixed_precision"),
    ("two problems in one line", {"calibration": {"percentile": "abc", "num_bins": "many"}},
     "calibration.percentile"),
    ("yaml integer key", "%yaml\n1: 2\n", "1"),
    ("yaml list key", "%yaml\n? [a, b]\n: 2\n", "a"),
]


@pytest.mark.parametrize("config, fragment", [pytest.param(c, f, id=i) for i, c, f in CONFIGS])
def test_config_values_are_typed(config, fragment, tmp_path, capsys):
    ws = Workspace(tmp_path, convs())
    if isinstance(config, str) and config.startswith("%yaml"):
        path = ws / "cfg.yaml"
        path.write_text(config.removeprefix("%yaml\n"))
    else:
        path = ws.config
        path.write_text(config if isinstance(config, str) else json.dumps(config))
    line = assert_refused(capsys, tmp_path, ws.run("--config", path, "--report", ws.report), fragment)
    if "two problems" in line or "percentile\": \"abc\", \"num" in json.dumps(config):
        assert "calibration.num_bins" in line


# -- nested pipeline text ---------------------------------------------------------------------------------
NESTED = [
    ("unknown nested pass", 'select-by-snr{then=bogus-pass}', "unknown pass 'bogus-pass'"),
    ("misspelt nested pass", 'select-by-snr{then="compute-qparam,insert-qdq"}', "did you mean 'compute-qparams'"),
    ("nested option unknown", 'search-precision{then="compute-qparams{bogus=1}"}', "has no option 'bogus'"),
    ("nested option value", 'select-by-snr{then="compute-qparams,insert-qdq{opset=many}"}', "option"),
    ("nested text empty", 'select-by-snr{then=""}', "empty pipeline text"),
    ("nested quote unclosed", 'select-by-snr{then="compute-qparams}', "unclosed"),
    ("nested brace unclosed", 'select-by-snr{then="compute-qparams{bits=8"}', "unclosed"),
]


@pytest.mark.parametrize("text, fragment", [pytest.param(t, f, id=i) for i, t, f in NESTED])
def test_nested_pipeline_text_is_checked_before_any_work(text, fragment, tmp_path, capsys):
    ws = Workspace(tmp_path)
    passes = f"fold-constants,annotate-types,calibrate,{text},compute-qparams,insert-qdq"
    assert_refused(capsys, tmp_path, ws.run("--passes", passes, "--dump-after", ws.out_dir / "d"), fragment)


# -- the qpasses.* metadata of a saved model ----------------------------------------------------------------
GOOD_ENTRY = {"qtype": "uint8", "role": "activation", "scale": [0.1], "zero_point": [3]}
METADATA = [
    ("table not JSON", {"qpasses.quant_table": "{not json"}, "metadata 'qpasses.quant_table' is not JSON"),
    ("table a list", {"qpasses.quant_table": "[1, 2]"}, "'qpasses.quant_table' must be a JSON object"),
    ("entry unknown type", {"qpasses.quant_table": json.dumps({"x": {**GOOD_ENTRY, "qtype": "uint9"}})},
     "entry 'x': qtype \"uint9\""),
    ("entry scale text", {"qpasses.quant_table": json.dumps({"x": {**GOOD_ENTRY, "scale": "abc"}})},
     "entry 'x': scale must be a list of numbers"),
    ("entry lengths differ", {"qpasses.quant_table": json.dumps({"x": {**GOOD_ENTRY, "scale": [0.1, 0.2]}})},
     "2 scales but 1 zero points"),
    ("entry role unknown", {"qpasses.quant_table": json.dumps({"x": {**GOOD_ENTRY, "role": "bias2"}})},
     "role must be activation, weight or bias"),
    ("entry convert malformed", {"qpasses.quant_table": json.dumps({"x": {**GOOD_ENTRY, "convert": {"qtype": 3}}})},
     "convert must be"),
    ("entry not an object", {"qpasses.quant_table": json.dumps({"x": 5})}, "entry 'x': must be a JSON object"),
    ("facts not a list", {"qpasses.facts": '{"a": 1}'}, "'qpasses.facts' must be a list"),
    ("facts not text", {"qpasses.facts": "[1]"}, "'qpasses.facts' must be a list"),
    ("ranges malformed", {"qpasses.ranges": '{"x": [1]}'}, "'qpasses.ranges' must map tensor names"),
    ("observed not JSON", {"qpasses.observed": "nan nan"}, "metadata 'qpasses.observed' is not JSON"),
    ("decisions a list", {"qpasses.decisions": "[1]"}, "'qpasses.decisions' must be a JSON object"),
    ("float decision malformed", {"qpasses.decisions": '{"float": {"x": "because"}}'}, "float['x'] must be"),
    ("calibration decision a number", {"qpasses.decisions": '{"calibration": 3}'}, "'calibration' must be a JSON object"),
]


@pytest.mark.parametrize("command", ["run", "explain"])
@pytest.mark.parametrize("meta, fragment", [pytest.param(m, f, id=i) for i, m, f in METADATA])
def test_saved_metadata_is_checked_for_run_and_explain(meta, fragment, command, tmp_path, capsys):
    model = mlp()
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=value)
    ws = Workspace(tmp_path, model)
    args = ws.run("--report", ws.report) if command == "run" else ["explain", ws.model]
    line = assert_refused(capsys, tmp_path, args, fragment)
    assert "model.onnx" in line


# -- model and data edges -----------------------------------------------------------------------------------
def _string_bias(ws):
    m = convs()
    for t in m.graph.initializer:
        if t.name == "b1":
            t.CopyFrom(helper.make_tensor("b1", TensorProto.STRING, [4], [b"a", b"b", b"c", b"d"]))
    write_model(ws.model, m)
    return ws.run(), "input 2 'b1' is a string initializer, which Conv does not accept"


def _dims(dims, raw=b""):
    def build(ws):
        m = mlp()
        t = m.graph.initializer[0]
        t.ClearField("float_data")
        del t.dims[:]
        t.dims.extend(dims)
        t.raw_data = raw
        write_model(ws.model, m)
        return ws.run(), "initializer 'w'"
    return build


def _external_entry(fragment, **entries):
    def build(ws):
        m = set_external(with_raw_data(mlp()), "w", **{"location": "w.bin", "offset": 0, "length": 64, **entries})
        (ws / "w.bin").write_bytes(np.ones(16, np.float32).tobytes())
        write_model(ws.model, m)
        return ws.run(), fragment
    return build


def _long_name(which):
    def build(ws):
        long = "n" * 300
        if which == "model":
            return ws.run(model=ws / f"{long}.onnx"), "File name too long"
        if which == "-o":
            return ws.run(out=ws.out_dir / f"{long}.onnx"), "File name too long"
        if which == "--report":
            return ws.run("--report", ws.out_dir / f"{long}.json"), "File name too long"
        if which == "--calib":
            return ws.run("--calib", ws / f"{long}.npz", calib=False), "File name too long"
        if which == "--config":
            return ws.run("--config", ws / f"{long}.json"), "File name too long"
        if which == "--eval":
            return ws.run("--eval", ws / f"{long}.npz"), "File name too long"
        if which == "--dump-after":
            return ws.run("--dump-after", ws.out_dir / long), "File name too long"
        if which == "--reproducer":
            return ws.run("--reproducer", ws.out_dir / long / "r"), "File name too long"
        if which == "example":
            return ["example", ws / long], "File name too long"
        if which == "explain":
            return ["explain", ws / f"{long}.onnx"], "File name too long"
        raise AssertionError(which)
    return build


def _npz_bytes(arrays) -> bytearray:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return bytearray(buf.getvalue())


def _npz_member(how, option="--calib"):
    def build(ws):
        data = _npz_bytes(dict(np.load(ws.calib)))
        local, central = data.find(b"PK\x03\x04"), data.find(b"PK\x01\x02")
        if how == "encrypted":
            data[local + 6] |= 1
            data[central + 8] |= 1
            fragment = "is encrypted"
        elif how == "unknown compression":
            data[local + 8] = data[central + 10] = 99
            fragment = "cannot read a member"
        else:   # a corrupt member: its CRC does not match
            data[central + 16] ^= 0xFF
            data[local + 14] ^= 0xFF
            fragment = "not a readable .npz"
        path = ws / "bad.npz"
        path.write_bytes(bytes(data))
        args = ws.run(option, path, calib=option != "--calib")
        return args, fragment
    return build


def _compare(float_model, quant_model, fragment, data=None):
    def build(ws):
        a = write_model(ws / "a.onnx", float_model)
        b = write_model(ws / "b.onnx", quant_model)
        d = write_npz(ws / "d.npz", data or {"x": np.ones((2, 1, 4), np.float32)})
        return ["compare", a, b, "--data", d], fragment
    return build


def _rank3():
    return parse("m (float[1,1,4] x) => (float[1,4] y) <int64[2] s = {1, 4}> { y = Reshape (x, s) }")


def _reshaped():
    return parse("m (float[1,4] x) => (float[2,2] y) <int64[2] s = {2, 2}> { y = Reshape (x, s) }")


def _float16():
    return parse("m (float16[1,4] x) => (float16[1,4] y) { y = Relu (x) }")


def _identity():
    return parse("m (float[1,4] x) => (float[1,4] y) { y = Relu (x) }")


def _scaled():
    return parse("m (float[1,4] x) => (float[1,4] y) <float k = {10}> { y = Mul (x, k) }")


def _undefined_input(ws):
    m = mlp()
    m.graph.input[0].type.tensor_type.elem_type = TensorProto.UNDEFINED
    write_model(ws.model, m)
    return ws.run(calib=False), "graph input 'x' has no element type"


def _if_reads_nothing(ws):
    then = helper.make_graph([helper.make_node("Identity", ["ghost"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 4])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 4])])
    nodes = [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(True))),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="branch")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    write_model(ws.model, m)
    return ws.run(calib=False), "reads 'ghost', which nothing produces"


def _weights(name, value, model=convs, fragment=None):
    def build(ws):
        m = with_initializer(model(), name, lambda a: np.where(np.arange(a.size).reshape(a.shape) == 1, value, a)
                             .astype(np.float32))
        write_model(ws.model, m)
        write_npz(ws.calib, {"x": np.random.default_rng(0).standard_normal((8, 1, 3, 8, 8)).astype(np.float32)}
                  if model is convs else dict(np.load(ws.calib)))
        what = fragment or ("holds NaN" if np.isnan(value) else "holds Inf" if np.isinf(value) else "overflows float32")
        return ws.run("--report", ws.report), f"tensor '{name}" if fragment is None else fragment, what
    return build


def _bn_nan(ws):
    m = parse("""
        m (float[1,3,8,8] x) => (float[1,2,8,8] y) <float[2,3,1,1] w = {1,2,3,4,5,6}, float[2] s = {1,1},
          float[2] b = {0,0}, float[2] mu = {0,0}, float[2] v = {1,NaN}> {
            c = Conv (x, w)
            y = BatchNormalization (c, s, b, mu, v)
        }""")
    write_model(ws.model, m)
    write_npz(ws.calib, {"x": np.ones((4, 1, 3, 8, 8), np.float32)})
    return ws.run(), "holds NaN"


EDGES = {
    "STRING Conv bias": _string_bias,
    "dims overflow to 0": _dims([2**32, 2**32]),
    "dims overflow int64": _dims([2**62, 16]),
    "negative dim": _dims([-1, 4]),
    "external offset negative": _external_entry("negative external data offset (-64)", offset=-64),
    "external length negative": _external_entry("negative external data length (-1)", length=-1),
    "external offset past the end": _external_entry("external data file 'w.bin' ends before", offset=1000),
    "external offset not a number": _external_entry("external data offset 'abc' is not an integer", offset="abc"),
    "external sub/../ location": _external_entry("external data file 'sub/../w.bin' not found", location="sub/../w.bin"),
    "external data a folder": _external_entry("location '.' is outside the model's folder", location="."),
    "undefined input type": _undefined_input,
    "If branch reads nothing": _if_reads_nothing,
    "BatchNorm variance NaN": _bn_nan,
    **{f"300-character name: {w}": _long_name(w) for w in ("model", "-o", "--report", "--calib", "--config", "--eval",
                                                           "--dump-after", "--reproducer", "example", "explain")},
    **{f"npz {how} ({opt})": _npz_member(how, opt) for how in ("encrypted", "unknown compression", "corrupt")
       for opt in ("--calib", "--eval")},
    "compare: input ranks differ": _compare(mlp(), _rank3(), "does not take the reference model's inputs"),
    "compare: output shapes differ": _compare(_identity(), _reshaped(), "output 'y' has shape (2, 2)"),
    "compare: input types differ": _compare(_identity(), _float16(), "does not take the reference model's inputs"),
    "compare: float model gives Inf": _compare(_scaled(), _scaled(), "the float model's output 'y' holds Inf",
                                               {"x": np.full((2, 1, 4), 3e38, np.float32)}),
}


@pytest.mark.parametrize("case", EDGES)
def test_model_and_data_edges_are_user_errors(case, tmp_path, capsys):
    ws = Workspace(tmp_path)
    built = EDGES[case](ws)
    args, fragment = built[:2]
    line = assert_refused(capsys, tmp_path, args, fragment)
    if len(built) > 2:
        assert built[2] in line


WEIGHTS = [(n, v, m) for n, m in (("w1", convs), ("b2", convs), ("w", mlp)) for v in
           (np.nan, np.inf, -np.inf, 3e38, -3e38)]


@pytest.mark.parametrize("name, value, model", [pytest.param(n, v, m, id=f"{n}={v}") for n, v, m in WEIGHTS])
def test_weights_that_cannot_be_quantized_are_refused_naming_the_tensor(name, value, model, tmp_path, capsys):
    """README: a weight, bias or constant operand that is quantized must be finite and within
    FLT_MAX / 2 (its range must fit float32): else exit 2 naming it, before calibration."""
    ws = Workspace(tmp_path)
    args, fragment, what = _weights(name, value, model)(ws)
    line = assert_refused(capsys, tmp_path, args, fragment)
    assert what in line


def test_an_example_folder_that_cannot_be_written(tmp_path, capsys, monkeypatch):
    import errno
    import tempfile

    real = tempfile.mkdtemp

    def denied(*a, dir=None, **k):
        if dir is not None and "ro" in str(dir):
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    (tmp_path / "ro").mkdir()
    assert_refused(capsys, tmp_path, ["example", tmp_path / "ro"], "cannot write the example")
