"""Bad input: one table of cases, each a one-line builder.

A row of BAD is ``(id, build, fragment)``. ``build(d)`` writes the bad model/data/config into the
input folder ``d`` and returns the ``qpasses run`` arguments (``-o <out>/q.onnx`` is appended
unless the row gives its own ``-o``). Every row must: exit 2; print exactly one stderr line,
starting with ``qpasses: error:`` and containing ``fragment``; leave the output folder as it was
(no output, no temporary files, a previous output intact); leave every input byte-identical; and
the Python API (run_pipeline + save) raises a QpassesError subclass with the same text.

A row of GOOD is ``(id, build)``: exit 0, a checker-clean output that onnxruntime loads, and a
finite SNR in the --report JSON.

Environment-dependent rows are simulated in-process (``patch`` column), because the tests run as
root, for whom chmod does not make a folder read-only: a read-only folder is an output folder
where creating files raises PermissionError; a full disk is a write raising ENOSPC.
"""
from __future__ import annotations

import builtins
import errno
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qpasses import QpassesError
from qpasses.api import run_pipeline
from qpasses.cli import main
from qpasses.cli.examples import example_data, example_model
from qpasses.ir.model import save

F32 = TensorProto.FLOAT


# -- model builders --------------------------------------------------------------------------------
def mlp(elem=F32, *, opset=17, batch=1, nodes=None, inits=None, domains=(), ir_version=10,
        input_init=False) -> onnx.ModelProto:
    """x[batch,4] -> MatMul(w) -> Add(b) -> Relu -> y: the smallest model qpasses quantizes."""
    npt = helper.tensor_dtype_to_np_dtype(elem)
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.5, (4, 4)).astype(np.float32)
    b = rng.normal(0, 0.1, 4).astype(np.float32)
    default_inits = [_init(w, "w", elem, npt), _init(b, "b", elem, npt)]
    default_nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="matmul"),
                     helper.make_node("Add", ["mm", "b"], ["add"], name="add"),
                     helper.make_node("Relu", ["add"], ["y"], name="relu")]
    inputs = [helper.make_tensor_value_info("x", elem, [batch, 4])]
    if input_init:
        inputs.append(helper.make_tensor_value_info("b", elem, [4]))
    graph = helper.make_graph(default_nodes if nodes is None else nodes, "mlp", inputs,
                              [helper.make_tensor_value_info("y", elem, [batch, 4])],
                              default_inits if inits is None else inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]
                              + [helper.make_opsetid(d, 1) for d in domains])
    model.ir_version = ir_version
    return model


def _init(arr, name, elem, npt):
    if elem == TensorProto.BFLOAT16:
        return helper.make_tensor(name, elem, arr.shape, arr.ravel().tolist())
    return numpy_helper.from_array(arr.astype(npt), name)


def edited(model: onnx.ModelProto, fn) -> onnx.ModelProto:
    fn(model)
    return model


def _cycle(m):
    m.graph.node[0].input[0] = "y"   # MatMul reads Relu's output: matmul -> add -> relu -> matmul


def _bad_bytes(m):
    m.graph.initializer[0].raw_data = m.graph.initializer[0].raw_data[:-4]


def _external(m, location):
    t = m.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "64")):
        entry = t.external_data.add()
        entry.key, entry.value = key, value


def _short_float_data(m):
    t = m.graph.initializer[0]
    values = numpy_helper.to_array(t).ravel()[:10].tolist()
    t.ClearField("raw_data")
    t.float_data.extend(values)


def _sparse(m):
    values = helper.make_tensor("s", F32, [1], [1.0])
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(
        values, helper.make_tensor("s_indices", TensorProto.INT64, [1], [0]), [4]))
    m.graph.node.append(helper.make_node("Add", ["y", "s"], ["z"], name="sparse_add"))
    m.graph.output[0].name = "z"


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _npz(path: Path, arrays: dict) -> Path:
    np.savez(path, **arrays)
    return path


def _npy(d: Path) -> Path:
    np.save(d / "c.npy", feeds()["x"])
    return d / "c.npy"


def _symlinked_external(d: Path) -> list:
    """The weights file is a symlink inside the folder that points outside it."""
    outside = d.parent / "outside.bin"
    outside.write_bytes(bytes(64))
    (d / "w.bin").symlink_to(outside)
    return run(d, edited(mlp(), lambda m: _external(m, "w.bin")))


def _custom_op(domain, op, **attrs):
    return mlp(domains=(domain,), nodes=[
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="matmul"),
        helper.make_node(op, ["mm"], ["g"], name="custom", domain=domain, **attrs),
        helper.make_node("Add", ["g", "b"], ["add"], name="add"),
        helper.make_node("Relu", ["add"], ["y"], name="relu")])


# -- writing the inputs ------------------------------------------------------------------------------
def write_model(d: Path, model, name="model.onnx") -> Path:
    path = d / name
    if isinstance(model, bytes):
        path.write_bytes(model)
    else:
        path.write_bytes(model.SerializeToString())
    return path


def feeds(n=8, batch=1, dtype=np.float32, name="x", shape=None) -> dict:
    rng = np.random.default_rng(1)
    return {name: rng.normal(0, 1, (n,) + (shape or (batch, 4))).astype(dtype)}


def run(d: Path, model=None, *, calib=None, config=None, extra=()) -> list:
    """Write ``model`` (default mlp()), the calibration arrays and the config; return CLI args."""
    args = ["run", write_model(d, mlp() if model is None else model)]
    if calib is not None:
        path = d / "calib.npz"
        if isinstance(calib, bytes):
            path.write_bytes(calib)
        else:
            np.savez(path, **calib)
        args += ["--calib", path]
    if config is not None:
        path = d / ("config.yaml" if isinstance(config, str) and config.startswith("%yaml") else "config.json")
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        args += ["--config", path]
    return args + list(extra)


def with_nan(value):
    data = feeds()
    data["x"][3, 0, 2] = value
    return data


def object_npz() -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, x=np.array([np.zeros((1, 4), np.float32)] * 2 + [None], dtype=object))
    return buf.getvalue()


def _previous_output(d: Path, out: Path) -> list:
    """Disk-full case: an earlier output exists and must survive the failed save byte for byte."""
    out.write_bytes(b"previous output")
    return run(d, calib=feeds())


# -- in-process simulations (patch column) ------------------------------------------------------------
def _read_only_folder(monkeypatch, out_dir: Path):
    """Root ignores permissions, so creating anything in ``out_dir`` raises EACCES instead."""
    import tempfile

    real_mkdtemp, real_open = tempfile.mkdtemp, builtins.open

    def mkdtemp(*a, dir=None, **k):
        if dir is not None and Path(dir).resolve() == out_dir.resolve():
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real_mkdtemp(*a, dir=dir, **k)

    def open_(file, mode="r", *a, **k):
        if any(c in mode for c in "wax") and Path(file).resolve().parent == out_dir.resolve():
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(builtins, "open", open_)


def _disk_full(monkeypatch, out_dir: Path):
    """Every write of a file under ``out_dir`` (temporary or final) raises ENOSPC."""
    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def open_(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        if any(c in mode for c in "wax") and out_dir.resolve() in Path(file).resolve().parents:
            return Full(f)
        return f

    monkeypatch.setattr(builtins, "open", open_)


# -- the table --------------------------------------------------------------------------------------
# (id, build(input folder, output folder) -> args, fragment[, {"patch": fn(monkeypatch, out_dir), "api": False}])
CLI_ONLY = {"api": False}   # checks the CLI makes before calling the API
BAD = [
    ("missing file", lambda d, o: ["run", d / "nope.onnx"], "nope.onnx: no such file"),
    ("model is a folder", lambda d, o: ["run", d], "is a directory"),
    ("not onnx", lambda d, o: run(d, b"this is plain text, not a protobuf\n"), "not a readable ONNX model"),
    ("truncated protobuf", lambda d, o: run(d, mlp().SerializeToString()[:150]), "model.onnx: not a readable ONNX"),
    ("corrupt protobuf", lambda d, o: run(d, b"\x0a\xff\xff\xff\xff\x0f" + mlp().SerializeToString()[6:]),
     "model.onnx: not a readable ONNX"),
    ("no graph", lambda d, o: run(d, edited(mlp(), lambda m: m.ClearField("graph"))), "model has no graph"),
    ("empty graph", lambda d, o: run(d, edited(mlp(), lambda m: m.graph.ClearField("node"))), "graph is empty"),
    ("cycle", lambda d, o: run(d, edited(mlp(), _cycle)), "cycle"),
    ("duplicate tensor", lambda d, o: run(d, edited(mlp(), lambda m: m.graph.node[1].output.__setitem__(0, "mm"))),
     "tensor 'mm' is produced twice"),
    ("duplicate initializer", lambda d, o: run(d, edited(mlp(), lambda m: m.graph.initializer.append(
        numpy_helper.from_array(np.zeros(4, np.float32), "b")))), "'b'"),
    ("dangling input", lambda d, o: run(d, edited(mlp(), lambda m: m.graph.node[1].input.__setitem__(1, "ghost"))),
     "node 'add' reads 'ghost'"),
    ("output not produced", lambda d, o: run(d, edited(mlp(), lambda m: setattr(m.graph.output[0], "name", "zz"))),
     "graph output 'zz'"),
    ("initializer values", lambda d, o: run(d, edited(mlp(), _short_float_data)), "initializer 'w': 10 values"),
    ("sparse initializer", lambda d, o: run(d, edited(mlp(), _sparse)), "initializer 's' is sparse"),
    ("initializer bytes", lambda d, o: run(d, edited(mlp(), _bad_bytes)), "initializer 'w'"),
    ("opset 6", lambda d, o: run(d, mlp(opset=6)), "opset 6 is too old"),
    ("opset 99", lambda d, o: run(d, mlp(opset=99)), "opset 99"),
    ("no default opset", lambda d, o: run(d, edited(mlp(), lambda m: m.opset_import.__delitem__(0))),
     "no default-domain opset"),
    ("unknown op", lambda d, o: run(d, edited(mlp(), lambda m: setattr(m.graph.node[2], "op_type", "Relux")),
                                    calib=feeds()), "node 'relu': 'Relux' is not an ONNX operator in opset 17"),
    ("op newer than opset", lambda d, o: run(d, edited(mlp(), lambda m: setattr(m.graph.node[2], "op_type", "Gelu"))),
     "'Gelu' is not an ONNX operator in opset 17 (it needs opset 20)"),
    ("custom domain op", lambda d, o: run(d, _custom_op("com.example", "Frobnicate"), calib=feeds()),
     "node 'custom' is op 'Frobnicate' of domain 'com.example'"),
    ("custom domain op, only inputs observed", lambda d, o: run(  # calibrate runs nothing: search-precision says it
        d, _custom_op("com.example", "Frobnicate"), calib=feeds(),
        config={"op_types_to_exclude_output_quantization": ["MatMul"]}),
     "node 'custom' is op 'Frobnicate' of domain 'com.example'"),
    ("bfloat16 calibration", lambda d, o: run(d, mlp(TensorProto.BFLOAT16, opset=21), calib=feeds()),
     "the model expects bfloat16"),
    ("external data ../", lambda d, o: run(d, edited(mlp(), lambda m: _external(m, "../secret.bin"))),
     "outside the model's folder"),
    ("external data absolute", lambda d, o: run(d, edited(mlp(), lambda m: _external(m, "/etc/passwd"))),
     "outside the model's folder"),
    ("external data symlink out", lambda d, o: _symlinked_external(d), "outside the model's folder"),
    ("external data missing", lambda d, o: run(d, edited(mlp(), lambda m: _external(m, "w.bin"))), "'w.bin' not found"),
    ("calib missing input", lambda d, o: run(d, calib={"other": feeds()["x"]}), "'other' is not an input"),
    ("calib missing one input", lambda d, o: run(d, _two_inputs(), calib=feeds()), "input 'x2' is missing"),
    ("calib extra input", lambda d, o: run(d, calib={**feeds(), "extra": feeds()["x"]}), "'extra' is not an input"),
    ("calib wrong rank", lambda d, o: run(d, calib=feeds(shape=(1, 2, 4))), "input 'x' has shape (1, 2, 4)"),
    ("calib wrong shape", lambda d, o: run(d, calib=feeds(shape=(1, 5))), "input 'x' has shape (1, 5)"),
    ("calib wrong dtype", lambda d, o: run(d, calib={"x": np.ones((4, 1, 4), np.int64)}), "dtype int64"),
    ("calib NaN", lambda d, o: run(d, calib=with_nan(np.nan)), "input 'x' contains NaN"),
    ("calib Inf", lambda d, o: run(d, calib=with_nan(np.inf)), "input 'x' contains Inf"),
    ("calib zero samples", lambda d, o: run(d, calib=feeds(n=0)), "no samples"),
    ("calib needs pickle", lambda d, o: run(d, calib=object_npz()), "needs pickle"),
    ("calib not npz", lambda d, o: run(d, calib=b"garbage"), "not a readable .npz"),
    ("calib empty folder", lambda d, o: run(d, extra=["--calib", _mkdir(d / "calib")]), "holds no .npz files"),
    ("calib .npy file", lambda d, o: run(d, extra=["--calib", _npy(d)]), "c.npy: expected an .npz file"),
    ("calib scalar array", lambda d, o: run(d, calib={"x": np.float32(1)}), "array 'x' is a scalar"),
    ("calib overflows float16", lambda d, o: run(d, mlp(TensorProto.FLOAT16), calib=feeds(n=2) | {
        "x": np.full((2, 1, 4), 1e6, np.float32)}), "Inf after casting float32 to float16"),
    ("eval data wrong shape", lambda d, o: run(d, calib=feeds(), extra=[
        "--eval", _npz(d / "e.npz", feeds(shape=(1, 5)))]),
     "e.npz: sample 0: input 'x' has shape (1, 5)", CLI_ONLY),
    ("calib missing file", lambda d, o: ["run", write_model(d, mlp()), "--calib", d / "none.npz"], "none.npz"),
    ("override unknown tensor", lambda d, o: run(d, calib=feeds(), config={
        "tensor_overrides": {"ghost": [{"quant_type": "uint16"}]}}), "ghost"),
    ("override contradiction", lambda d, o: run(d, calib=feeds(), config={
        "tensor_overrides": {"mm": [{"scale": 0.1, "zero_point": 0, "symmetric": True}]}}), "contradict"),
    ("override rmin > rmax", lambda d, o: run(d, calib=feeds(), config={
        "tensor_overrides": {"mm": [{"rmin": 1.0, "rmax": -1.0}]}}), "rmin 1.0 is greater than rmax"),
    ("override not a list", lambda d, o: run(d, calib=feeds(), config={
        "tensor_overrides": {"mm": {"quant_type": "uint16"}}}), "tensor_overrides['mm']: expected a list"),
    ("mixed precision unknown tensor", lambda d, o: run(d, calib=feeds(), config={
        "mixed_precision": {"ghost": "uint16"}}), "mixed_precision: unknown tensor 'ghost'"),
    ("exclude unknown node", lambda d, o: run(d, calib=feeds(), config={"nodes_to_exclude": ["matmull"]}),
     "did you mean 'matmul'"),
    ("config not json", lambda d, o: run(d, config="{not json"), "config.json: not valid JSON"),
    ("config not yaml", lambda d, o: run(d, config="%yaml 1.2\n---\na: [1, 2\n"), "config.yaml: not valid YAML"),
    ("config not a mapping", lambda d, o: run(d, config="[1, 2]"), "expected a mapping"),
    ("config unknown key", lambda d, o: run(d, config={"activaton_type": "uint8"}),
     "unknown key 'activaton_type' (did you mean 'activation_type'?)"),
    ("config unknown nested key", lambda d, o: run(d, config={"calibration": {"metod": "minmax"}}),
     "did you mean 'calibration.method'"),
    ("config bad value", lambda d, o: run(d, config={"activation_type": "uint9"}), "activation_type"),
    ("config unknown cpu", lambda d, o: run(d, calib=feeds(), config={"cpu": "x86"}),
     "cpu: 'x86' is not one of x86-64, x86-64-vnni, arm"),
    ("config not text", lambda d, o: run(d, extra=["--config", _bytes(d / "c.json", b"\xff\xfe\x00")]),
     "c.json: not a UTF-8 text file"),
    ("config is a folder", lambda d, o: run(d, extra=["--config", d]), "is a folder, expected a JSON or YAML file"),
    ("missing config", lambda d, o: run(d, extra=["--config", d / "none.json"]), "none.json"),
    ("unknown pass", lambda d, o: run(d, extra=["--passes", "fold-constant"]), "did you mean 'fold-constants'"),
    ("pass before its facts", lambda d, o: run(d, extra=["--passes", "insert-qdq"]), "run 'compute-qparams' before it"),
    ("dump-after under a file", lambda d, o: run(d, extra=["--dump-after", d / "model.onnx" / "dump"]),
     "cannot create the --dump-after folder"),
    ("reproducer under a file", lambda d, o: run(d, extra=["--reproducer", d / "model.onnx" / "r"]),
     "cannot create the --reproducer folder"),
    ("output folder missing", lambda d, o: run(d, extra=["-o", o / "missing" / "q.onnx"]), "does not exist"),
    ("output under a file", lambda d, o: run(d, extra=["-o", d / "model.onnx" / "q.onnx"]),
     "model.onnx' is not a folder"),
    ("report folder missing", lambda d, o: run(d, extra=["--report", o / "missing" / "r.json"]), "does not exist",
     CLI_ONLY),
    ("output is a folder", lambda d, o: run(d, extra=["-o", o]), "out: is a folder", CLI_ONLY),
    ("output is input", lambda d, o: run(d, extra=["-o", d / "model.onnx"]), "overwrite the input", CLI_ONLY),
    ("compare missing model", lambda d, o: ["compare", write_model(d, mlp()), d / "q.onnx", "--data",
                                           _npz(d / "e.npz", feeds())], "q.onnx: no such file", CLI_ONLY),
    ("compare different inputs", lambda d, o: ["compare", write_model(d, mlp()), write_model(
        d, _two_inputs(), "q.onnx"), "--data", _npz(d / "e.npz", feeds())], "different inputs", CLI_ONLY),
    ("compare bad data", lambda d, o: ["compare", write_model(d, mlp()), write_model(d, mlp(), "q.onnx"), "--data",
                                       _npz(d / "e.npz", feeds(shape=(2, 4)))], "input 'x' has shape (2, 4)", CLI_ONLY),
    ("explain not onnx", lambda d, o: ["explain", _bytes(d / "m.onnx", b"text")], "not a readable ONNX model",
     CLI_ONLY),
    ("output folder read-only", lambda d, o: run(d, calib=feeds()), "Permission denied", {"patch": _read_only_folder}),
    ("disk full", lambda d, o: _previous_output(d, o / "q.onnx"), "No space left on device", {"patch": _disk_full}),
]


def _two_inputs():
    m = mlp(nodes=[helper.make_node("Add", ["x", "x2"], ["s"], name="sum"),
                   helper.make_node("MatMul", ["s", "w"], ["mm"], name="matmul"),
                   helper.make_node("Add", ["mm", "b"], ["add"], name="add"),
                   helper.make_node("Relu", ["add"], ["y"], name="relu")])
    m.graph.input.append(helper.make_tensor_value_info("x2", F32, [1, 4]))
    return m


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def _cli_args(args: list, out: Path) -> list:
    args = [str(a) for a in args]
    return args if "-o" in args or args[0] != "run" else args + ["-o", str(out)]


def _api(args: list) -> None:
    """What the CLI does, through the Python API: run_pipeline, then save."""
    opts = dict(zip(args[2::2], args[3::2]))
    model, _ = run_pipeline(args[1], opts.get("--passes"), config=opts.get("--config"),
                            calibration_data=opts.get("--calib"), dump_after=opts.get("--dump-after"),
                            reproducer=opts.get("--reproducer"))
    save(model, opts["-o"])


@pytest.mark.parametrize("build, fragment, opts", [
    pytest.param(row[1], row[2], row[3] if len(row) > 3 else {}, id=row[0]) for row in BAD])
def test_bad_input(build, fragment, opts, tmp_path, capsys, monkeypatch):
    d, out_dir = tmp_path / "in", tmp_path / "out"
    d.mkdir()
    out_dir.mkdir()
    args = _cli_args(build(d, out_dir), out_dir / "q.onnx")
    inputs, outputs = _snapshot(d), _snapshot(out_dir)
    if "patch" in opts:
        opts["patch"](monkeypatch, out_dir)
    code = main(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("qpasses: error: "), err
    assert fragment in lines[0], lines[0]
    assert _snapshot(out_dir) == outputs, "the output folder changed"
    assert _snapshot(d) == inputs, "an input file changed"

    if opts.get("api", True):   # the Python API raises the same text
        with pytest.raises(QpassesError) as info:
            _api(args)
        assert str(info.value) == lines[0][len("qpasses: error: "):]
        assert type(info.value) is not QpassesError, "raise a specific subclass (ModelError, ConfigError, ...)"
        assert _snapshot(out_dir) == outputs and _snapshot(d) == inputs


# -- inputs that must work ------------------------------------------------------------------------
def _unsorted():
    m = mlp()
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(reversed(nodes))
    return m


def _symbolic():
    m = mlp()
    for vi in (m.graph.input[0], m.graph.output[0]):
        vi.type.tensor_type.shape.dim[0].dim_param = "batch"
    return m


def _symbolic_seq():
    m = mlp()
    for vi in (m.graph.input[0], m.graph.output[0]):
        dims = vi.type.tensor_type.shape.dim
        dims[0].dim_param = "batch"
        dims.insert(1, onnx.TensorShapeProto.Dimension(dim_param="seq"))
    return m


def _unknown_dims(m):
    for vi in (m.graph.input[0], m.graph.output[0]):
        for dim in vi.type.tensor_type.shape.dim:
            dim.Clear()


GOOD = [
    ("example", lambda d: run(d, example_model(), calib=example_data(8))),
    ("symbolic batch", lambda d: run(d, _symbolic(), calib=feeds(batch=3))),
    ("symbolic batch and sequence", lambda d: run(d, _symbolic_seq(), calib=feeds(shape=(2, 5, 4)))),
    ("unknown dims", lambda d: run(d, edited(mlp(), _unknown_dims), calib=feeds(batch=2))),
    ("unsorted graph", lambda d: run(d, _unsorted(), calib=feeds())),
    ("float16 model", lambda d: run(d, mlp(TensorProto.FLOAT16), calib=feeds(dtype=np.float16))),
    ("float16 model, 16-bit per-channel", lambda d: run(d, mlp(TensorProto.FLOAT16), calib=feeds(dtype=np.float16),
                                                       config={"activation_type": "uint16", "weight_type": "int16",
                                                               "per_channel": True})),
    ("float64 calib for float16", lambda d: run(d, mlp(TensorProto.FLOAT16), calib=feeds(dtype=np.float64))),
    ("input also initializer", lambda d: run(d, mlp(input_init=True), calib=feeds())),
    ("ir_version 3 inputs as initializers", lambda d: run(d, mlp(input_init=True, ir_version=3, opset=10),
                                                          calib=feeds())),
    ("contrib Gelu", lambda d: run(d, _custom_op("com.microsoft", "Gelu"), calib=feeds())),
    ("custom op defined by a local function", lambda d: run(d, _local_function(), calib=feeds())),
    ("contrib FusedMatMul", lambda d: run(d, mlp(domains=("com.microsoft",), nodes=[
        helper.make_node("FusedMatMul", ["x", "w"], ["mm"], name="fused", domain="com.microsoft", alpha=0.5),
        helper.make_node("Add", ["mm", "b"], ["add"], name="add"),
        helper.make_node("Relu", ["add"], ["y"], name="relu")]), calib=feeds(),
        config='{"op_types_to_quantize": "all"}')),   # the contrib op stays float, the Add is quantized
    ("opset 10", lambda d: run(d, mlp(opset=10), calib=feeds())),
    ("calib without batch axis", lambda d: run(d, calib={"x": feeds()["x"][:, 0]})),
    ("yaml config", lambda d: run(d, calib=feeds(), config="%yaml 1.2\n---\nper_channel: true\n")),
    ("external data inside folder", lambda d: _inside_external(d)),
    ("ir_version newer than onnxruntime", lambda d: run(d, edited(mlp(), lambda m: setattr(m, "ir_version", 99)),
                                                        calib=feeds())),
    ("initializer as graph output", lambda d: run(d, edited(mlp(), lambda m: m.graph.output.append(
        helper.make_tensor_value_info("w", F32, [4, 4]))), calib=feeds())),
    ("input as graph output", lambda d: run(d, edited(mlp(), lambda m: m.graph.output.append(
        helper.make_tensor_value_info("x", F32, [1, 4]))), calib=feeds())),
    ("unnamed nodes, odd tensor names", lambda d: run(d, edited(mlp(), _odd_names), calib=feeds())),
]


def _local_function():
    """A com.example op that the model defines itself (a FunctionProto): onnxruntime inlines it."""
    m = _custom_op("com.example", "Swish")
    m.functions.append(helper.make_function(
        "com.example", "Swish", ["a"], ["o"],
        [helper.make_node("Sigmoid", ["a"], ["s"]), helper.make_node("Mul", ["a", "s"], ["o"])],
        [helper.make_opsetid("", 17)]))
    return m


def _odd_names(m):
    renames = {"mm": "model/dense/MatMul:0", "add": "model/dense/BiasAdd:0"}
    for node in m.graph.node:
        node.name = ""
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]


def _inside_external(d: Path) -> list:
    m = mlp()
    onnx.save_model(m, str(d / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    np.savez(d / "calib.npz", **feeds())
    return ["run", d / "model.onnx", "--calib", d / "calib.npz"]


@pytest.mark.parametrize("build", [pytest.param(row[1], id=row[0]) for row in GOOD])
def test_must_work(build, tmp_path, capsys):
    import onnxruntime as ort

    d, out = tmp_path / "in", tmp_path / "q.onnx"
    d.mkdir()
    args = [str(a) for a in build(d)]
    inputs = _snapshot(d)
    code = main(args + ["-o", str(out), "--report", str(tmp_path / "report.json"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert _snapshot(d) == inputs
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto)
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert "qdq-inserted" in report["facts"]
    assert any(n.op_type == "DequantizeLinear" for n in proto.graph.node)
    snr = report["accuracy"]["snr_db"]
    assert isinstance(snr, float) and math.isfinite(snr) and snr > 10, snr


# -- inputs that must work without calibration (left float: no Q/DQ) ------------------------------
FLOAT_ONLY = [
    ("custom domain op", lambda d: run(d, _custom_op("com.example", "Frobnicate"))),
    ("bfloat16 model", lambda d: run(d, mlp(TensorProto.BFLOAT16, opset=21))),
    ("contrib Gelu", lambda d: run(d, _custom_op("com.microsoft", "Gelu"))),
    ("unsorted graph", lambda d: run(d, _unsorted())),
]


@pytest.mark.parametrize("build", [pytest.param(row[1], id=row[0]) for row in FLOAT_ONLY])
def test_float_only(build, tmp_path, capsys):
    d, out = tmp_path / "in", tmp_path / "q.onnx"
    d.mkdir()
    args = [str(a) for a in build(d)]
    source = onnx.load(args[1])
    code = main(args + ["-o", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto)
    assert sorted(n.op_type for n in proto.graph.node) == sorted(n.op_type for n in source.graph.node)


def test_api_leaves_the_model_proto_untouched():
    import qpasses

    proto = example_model()
    before = proto.SerializeToString()
    model = qpasses.quantize(proto, [{"input": x} for x in example_data(4)["input"]])
    assert proto.SerializeToString() == before
    assert any(n.op == "QuantizeLinear" for n in model.graph.nodes)
