"""QModel: an onnx-graphsurgeon graph plus the quantization table, facts and model-level fields.

All loading, saving and copying goes through this module so the gs seam stays in one place.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError
from onnx import external_data_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from ..errors import ModelError, first_line
from .analyses import GRAPH, AnalysisCache, analysis
from .annotations import QuantTable
from .graphutil import DEFAULT_DOMAINS, holds_graph, proto_subgraphs, subgraphs, toposort, unique_name
from .metadata import DECISIONS_KEY, FACTS_KEY, KEYS, OBSERVED_KEY, QUANT_TABLE_KEY, RANGES_KEY, pack, read_saved
from .validate import max_ort_ir_version, validate_proto

EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # bytes of tensor data above which we save with external data


@contextlib.contextmanager
def relaxed_gc():
    """Fewer garbage-collector passes while big graphs are built, edited or exported.

    A graph is millions of long-lived Python objects; with the default thresholds, collections
    scanning them all took a third of the CPU time of a 50k-node quantization. Young objects are
    still collected (every 100k allocations). On exit, what the block allocated moves to the oldest
    generation unscanned (freeze + unfreeze): else the restored thresholds made the next
    allocation collect them all (7 s after a 200k-node quantization)."""
    old = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        if gc.get_freeze_count() == 0:  # never unfreeze what the caller froze
            gc.freeze()
            gc.unfreeze()


class QModel:
    """A model being compiled: ``graph`` (gs.Graph) plus side tables that gs cannot hold.

    Everything a later pass reads is saved with the model (``to_proto`` writes it into
    ``metadata_props``): the quantization table, facts, calibrated and observed ranges, and
    ``decisions`` (effective settings passes chose, e.g. the calibration method, whether biases
    were corrected, why tensors stay float). The run's config, data and findings are not here:
    they are the RunContext's."""

    def __init__(self, graph: gs.Graph, *, quant: QuantTable | None = None, facts=(),
                 ranges: dict | None = None, observed: dict | None = None, decisions: dict | None = None,
                 ir_version: int = 10, metadata: dict | None = None,
                 model_fields: dict | None = None, input_order: list[str] | None = None,
                 input_initializers: dict | None = None, base_dir: Path | None = None):
        self.graph = graph
        self.quant = quant if quant is not None else QuantTable()
        self.facts: set[str] = set(facts)
        self.ranges: dict[str, tuple[float, float]] = dict(ranges or {})  # calibrated [rmin, rmax]
        self.observed: dict[str, tuple[float, float]] = dict(observed or {})  # raw min/max seen
        self.decisions: dict = json.loads(json.dumps(decisions or {}))  # JSON values only
        self.ir_version = ir_version
        self.metadata: dict[str, str] = dict(metadata or {})
        self.model_fields: dict = dict(model_fields or {})  # producer, domain, model_version, doc
        self.input_order = list(input_order or [i.name for i in graph.inputs])
        self.input_initializers: dict[str, onnx.ValueInfoProto] = dict(input_initializers or {})
        self.base_dir = base_dir
        self.analyses = AnalysisCache()   # results of qpasses.ir.analyses' typed keys
        self.summary: str | None = None   # qpasses.quantize: what the command line would print

    # -- cached analyses -----------------------------------------------------------------
    def touch(self) -> None:
        """Mark the graph as changed mid-pass: every cached analysis is rebuilt on demand."""
        self.analyses.clear()

    def tensors(self) -> dict[str, gs.Tensor]:
        """Name -> tensor of the main graph, then of the If/Loop/Scan bodies (``model_tensor_map``)."""
        return model_tensors(self)

    def bodies(self) -> list[gs.Graph]:
        """Every If/Loop/Scan body of the graph (``body_graphs``)."""
        return model_bodies(self)

    @property
    def opset(self) -> int:
        return int(self.graph.opset)

    def raise_opset(self, opset: int) -> bool:
        """Raise the default-domain opset to at least ``opset``; returns True if it changed."""
        if self.opset >= opset:
            return False
        self.graph.opset = opset
        if self.graph.import_domains is not None:  # gs exports these, not graph.opset: new protos
            self.graph.import_domains = [              # (the imported ones belong to the user's proto)
                onnx.helper.make_opsetid(d.domain, opset if d.domain in DEFAULT_DOMAINS else d.version)
                for d in self.graph.import_domains]
        return True

    # -- conversion ----------------------------------------------------------------------
    @relaxed_gc()
    def to_proto(self, *, metadata: bool = True, weights: dict | None = None, packed: bool = True) -> onnx.ModelProto:
        """Export to a ModelProto with our metadata (``metadata=False``: the user's only, e.g. for
        an onnxruntime session; ``packed=False``: long entries as plain text, for a copy read back
        at once), the original signature and a capped IR version.

        With a ``weights`` dict, top-level constants of numpy types and at least 1 KiB are not
        copied into the proto: they are exported as external data at location IN_MEMORY and their
        arrays are put into ``weights`` (name -> array), e.g. for onnxruntime's
        ``add_external_initializers``: the weights of a large model are then held once."""
        tensors = tensor_map(self.graph)
        _pack_subbyte_constants(model_tensor_map(self.graph).values())   # int4 weights of bodies too
        stubs = _stub_out(tensors.values(), weights) if weights is not None else []
        try:
            proto = gs.export_onnx(self.graph, do_type_check=False)
        finally:
            for t, values in stubs:
                t._values = values
        _restore_input_initializers(proto, self.input_order, self.input_initializers)
        if self.bodies():
            _drop_outer_copies(proto.graph)
        for key, value in self.model_fields.items():
            setattr(proto, key, value)
        _raw_encoding(proto)
        opsets = [(o.domain, o.version) for o in proto.opset_import]
        proto.ir_version = choose_ir_version(self.ir_version, opsets)
        meta = dict(self.metadata)
        if metadata:
            meta[QUANT_TABLE_KEY] = self.quant.to_json()
            meta[FACTS_KEY] = json.dumps(sorted(self.facts))
            meta[RANGES_KEY] = _ranges_json(self.ranges)
            meta[OBSERVED_KEY] = _ranges_json(self.observed)
            meta[DECISIONS_KEY] = json.dumps(self.decisions, sort_keys=True, separators=(",", ":"))
        del proto.metadata_props[:]
        for key in sorted(meta):
            if key in KEYS and meta[key] in ("{}", "[]"):
                continue
            proto.metadata_props.add(key=key, value=pack(meta[key]) if packed and key in KEYS else meta[key])
        return proto

    def copy(self, *, share_weights: bool = False) -> "QModel":
        """A deep copy (through a ModelProto: gs.Graph.copy shares arrays and is slow).
        ``share_weights``: constants of 1 KiB and more keep the same (read-only) arrays, for a
        scratch copy that passes rewrite without holding the weights twice."""
        if share_weights:
            return self.copier()()
        return from_proto(self.to_proto(packed=False), base_dir=self.base_dir)

    def copier(self):
        """``copy(share_weights=True)`` for many scratch copies of a model that does not change
        meanwhile (trials): exported once, each call of the returned function only imports."""
        weights: dict = {}
        proto = self.to_proto(weights=weights, packed=False)   # read back by every call: not zlib-packed
        _share_constants(self.graph, weights)   # both hold the exported arrays

        def fresh() -> "QModel":
            new = from_proto(proto, base_dir=self.base_dir, trusted=True)
            _share_constants(new.graph, weights)
            return new
        return fresh

    def reload(self) -> None:
        """Become what saving and loading this model gives (``--verify-each reload``)."""
        fresh = from_proto(self.to_proto(), base_dir=self.base_dir)
        _own_constants(fresh.graph, self.base_dir or Path("."))
        self.__dict__.update(fresh.__dict__)   # a new graph: no cached analysis left


# -- loading ---------------------------------------------------------------------------------
def load(src, *, base_dir: str | Path | None = None) -> QModel:
    """Load a model from a path or ModelProto. External data must stay inside the model's folder."""
    if isinstance(src, onnx.ModelProto):
        return from_proto(src, base_dir=Path(base_dir) if base_dir else None)
    path = Path(src)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise ModelError(f"{path}: no such file") from None
    except OSError as exc:   # a name too long, a loop of symlinks
        raise ModelError(f"{path}: cannot read it ({exc.strerror})") from None
    if stat.S_ISDIR(mode):
        raise ModelError(f"{path}: is a directory, expected an .onnx file")
    if not stat.S_ISREG(mode):   # a FIFO would block the read: refused from its stat alone
        raise ModelError(f"{path}: not a regular file (a FIFO or device; refused)")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeWarning, ValueError, OSError) as exc:
        raise ModelError(f"{path}: not a readable ONNX model ({first_line(exc)})") from None
    except Exception as exc:  # protobuf raises assorted types on garbage input
        raise ModelError(f"{path}: not a readable ONNX model ({type(exc).__name__})") from None
    try:
        files = check_external_data(proto, path.parent)
        model = from_proto(proto, base_dir=path.parent)
        _own_constants(model.graph, path.parent)  # external data is read here, straight into arrays
    except ModelError as exc:  # name the file in graph-level messages
        raise ModelError(f"{path}: {exc}") from None
    model.external_files = files   # the files its weights were read from (the CLI never writes them)
    return model


def _external_file(tensor: onnx.TensorProto, root: Path) -> Path:
    """The file holding ``tensor``'s external data, refusing locations outside ``root``."""
    entries = {e.key: e.value for e in tensor.external_data}
    for key in ("offset", "length"):
        try:
            if int(entries.get(key) or 0) < 0:
                raise ModelError(f"tensor '{tensor.name}': negative external data {key} ({entries[key]})")
        except ValueError:
            raise ModelError(f"tensor '{tensor.name}': external data {key} '{entries[key]}' is not an integer") from None
    info = external_data_helper.ExternalDataInfo(tensor)
    location = info.location
    try:
        target = (root / location).resolve()
        if os.path.isabs(location) or root not in target.parents:
            raise ModelError(f"tensor '{tensor.name}': external data location '{location}' "
                             f"is outside the model's folder (refused)")
        # as written, as onnxruntime opens it: 'sub/../w.bin' needs a folder 'sub'
        st = os.stat(root / location)
    except (FileNotFoundError, NotADirectoryError):
        raise ModelError(f"tensor '{tensor.name}': external data file '{location}' not found") from None
    except OSError as exc:   # a name too long, a loop of symlinks
        raise ModelError(f"tensor '{tensor.name}': external data file '{location}': {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"tensor '{tensor.name}': external data file '{location}' is not a regular file (refused)")
    return target


def check_external_data(proto: onnx.ModelProto, base_dir: Path) -> list[Path]:
    """Check every external data location of the proto (see ``_external_file``); returns the files."""
    root = base_dir.resolve()
    files = {}
    for tensor in external_data_helper._get_all_tensors(proto):
        if external_data_helper.uses_external_data(tensor):
            path = _external_file(tensor, root)
            files[str(path)] = path
    return list(files.values())


def load_external_data(proto: onnx.ModelProto, base_dir: Path) -> None:
    """Read external tensor data into the proto, refusing locations outside ``base_dir``."""
    root = base_dir.resolve()
    for tensor in external_data_helper._get_all_tensors(proto):
        if not external_data_helper.uses_external_data(tensor):
            continue
        _external_file(tensor, root)
        external_data_helper.load_external_data_for_tensor(tensor, str(root))
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]


def _own_constants(graph: gs.Graph, base_dir: Path) -> None:
    """gs imports constants lazily: they point into the loaded ModelProto (as do the graphs'
    opset lists), which keeps all of it alive. Give every constant its own values, reading
    external data straight from its file, so that the proto is freed once loaded and the
    weights are held once (loading the data into the proto first held them twice)."""
    root = base_dir.resolve()
    graphs = [graph, *graph.subgraphs(recursive=True)]
    for function in graph.functions or ():
        graphs += [function, *function.subgraphs(recursive=True)]
    for g in graphs:
        if g.import_domains is not None:
            g.import_domains = [onnx.helper.make_opsetid(d.domain, d.version) for d in g.import_domains]
        constants = [t for t in tensor_map(g).values() if isinstance(t, gs.Constant)]
        constants += [v for node in g.nodes for v in node.attrs.values() if isinstance(v, gs.Constant)]
        for t in constants:
            if isinstance(t._values, LazyValues):
                t._values = _own_values(t._values.tensor, root)
                t.data_location = None


def _own_values(tensor, root: Path):
    """A numpy array of ``tensor`` (external data read from its file), or a LazyValues over a
    standalone copy for types numpy does not hold (gs would cast them)."""
    external = isinstance(tensor, onnx.TensorProto) and external_data_helper.uses_external_data(tensor)
    if external and tensor.data_type in _NUMPY_TYPES:
        return _read_external(tensor, root)
    if not external and isinstance(tensor, onnx.TensorProto) and tensor.data_type in _NUMPY_TYPES:
        return onnx.numpy_helper.to_array(tensor)
    copy = type(tensor)()
    copy.CopyFrom(tensor)
    if external:
        external_data_helper.load_external_data_for_tensor(copy, str(root))
        copy.data_location = onnx.TensorProto.DEFAULT
        del copy.external_data[:]
    return LazyValues(copy)


def _read_external(tensor: onnx.TensorProto, root: Path) -> np.ndarray:
    info = external_data_helper.ExternalDataInfo(tensor)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    expected = count * dtype.itemsize
    if info.length and info.length != expected:
        raise ModelError(f"initializer '{tensor.name}': {info.length} bytes of external data for shape "
                         f"{list(tensor.dims)} (expected {expected})")
    values = np.fromfile(_external_file(tensor, root), dtype=dtype, count=count, offset=info.offset or 0)
    if values.size != count:
        raise ModelError(f"initializer '{tensor.name}': external data file '{info.location}' ends before "
                         f"its {expected} bytes")
    return values.astype(dtype.newbyteorder("="), copy=False).reshape(tuple(tensor.dims))


@relaxed_gc()
def from_proto(proto: onnx.ModelProto, *, base_dir: Path | None = None, trusted: bool = False) -> QModel:
    """Wrap a ModelProto (not modified) as a QModel; ``trusted``: one QModel.to_proto made, so its
    validation and its saved entries' checks are skipped (a trial's copy: 9 of its 35 ms)."""
    if not trusted:
        validate_proto(proto)
    initializer_names = {t.name for t in proto.graph.initializer}
    input_order = [i.name for i in proto.graph.input]
    # IR < 4 had to list every initializer as an input; only from IR 4 on can the user feed them
    input_inits = ({i.name: i for i in proto.graph.input if i.name in initializer_names}
                   if proto.ir_version >= 4 else {})
    try:
        graph = gs.import_onnx(proto)
    except Exception as exc:
        raise ModelError(f"cannot import graph: {first_line(exc)}") from None
    for g in (graph, *(graph.functions or ())):   # gs's export appends the domains nodes use to
        if g.import_domains is not None:           # these lists: not to the user's proto's own
            g.import_domains = list(g.import_domains)
    _name_nodes(graph)
    _share_body_constants(graph)
    toposort(graph)  # an unsorted (acyclic) model is sorted; a cycle is a ModelError naming a node
    meta = {p.key: p.value for p in proto.metadata_props}
    saved = read_saved(meta, entries_checked=not trusted)   # the qpasses.* entries, their JSON schema checked (one ModelError line)
    fields = {k: getattr(proto, k) for k in ("producer_name", "producer_version", "domain",
                                             "model_version", "doc_string")}
    return QModel(graph, quant=saved["quant"], facts=saved["facts"], ranges=saved["ranges"],
                  observed=saved["observed"], decisions=saved["decisions"],
                  ir_version=proto.ir_version,
                  metadata=meta, model_fields=fields, input_order=input_order,
                  input_initializers={k: _copy_value_info(v) for k, v in input_inits.items()},
                  base_dir=base_dir)


def _name_nodes(graph: gs.Graph) -> None:
    """Give unnamed (or duplicate-named) nodes unique, deterministic names: ``<op>_<index>``, unique
    across the main graph and its If/Loop/Scan bodies (the main graph's nodes keep theirs first)."""
    graphs = [graph, *body_graphs(graph)]
    taken = {n.name for g in graphs for n in g.nodes if n.name}   # and the names given here (unique_name adds them)
    seen: set[str] = set()
    for g in graphs:
        for index, node in enumerate(g.nodes):
            if node.name and node.name not in seen:
                seen.add(node.name)
                continue
            node.name = unique_name(f"{node.name or node.op}_{index}", taken)
            seen.add(node.name)


def _share_body_constants(graph: gs.Graph) -> None:
    """gs exports a constant that several If/Loop/Scan bodies read (and the main graph does not) into
    each of them, and imports each copy as its own tensor: make the bodies read one tensor per name
    again (copies with equal values only), as before the round trip."""
    first: dict[str, gs.Constant] = {}
    for body in body_graphs(graph):
        for node in body.nodes:
            for i, t in enumerate(node.inputs):
                if not isinstance(t, gs.Constant) or not t.name:
                    continue
                kept = first.setdefault(t.name, t)
                if kept is not t and _equal_values(kept, t):
                    node.inputs[i] = kept


def _equal_values(a: gs.Constant, b: gs.Constant) -> bool:
    try:
        x, y = np.asarray(a.values), np.asarray(b.values)
    except Exception:   # values gs cannot load as numpy
        return False
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)


def _ranges_json(ranges: dict) -> str:
    return json.dumps({k: [float(a), float(b)] for k, (a, b) in sorted(ranges.items())},
                      separators=(",", ":"))


_TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data")


def _raw_encoding(proto: onnx.ModelProto) -> None:
    """Tensors kept in typed fields (float_data, ...: e.g. Constant nodes the version converter
    made) are written as raw_data, as every constant qpasses owns is: a model exported before or
    after a save/load round trip then has the same bytes."""
    for tensor in external_data_helper._get_all_tensors(proto):
        if (tensor.data_type in _NUMPY_TYPES and any(len(getattr(tensor, f)) for f in _TYPED_FIELDS)
                and tensor.data_location != onnx.TensorProto.EXTERNAL
                and not tensor.raw_data):   # last: reading raw_data copies its bytes
            array = onnx.numpy_helper.to_array(tensor)
            for f in _TYPED_FIELDS:
                tensor.ClearField(f)
            tensor.raw_data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def _copy_value_info(vi: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    new = onnx.ValueInfoProto()
    new.CopyFrom(vi)
    return new


def _drop_outer_copies(graph: onnx.GraphProto, outer: frozenset = frozenset()) -> None:
    """gs exports every constant a body reads as an initializer of that body, also one of an
    enclosing graph (the same tensor: gs imports such a copy as the outer one); drop those copies,
    which held the weights once more per body."""
    names = outer | {t.name for t in graph.initializer}
    for node in graph.node:
        for _, sub in proto_subgraphs(node):
            for i in reversed(range(len(sub.initializer))):
                if sub.initializer[i].name in names:
                    del sub.initializer[i]
            _drop_outer_copies(sub, names)


def _restore_input_initializers(proto, input_order, input_inits) -> None:
    """Re-list initializers that the source model also declared as graph inputs (gs drops them)."""
    if not input_inits:
        return
    present = {i.name for i in proto.graph.input}
    inits = {t.name: t for t in proto.graph.initializer}
    extra = [vi for name, vi in input_inits.items()
             if name not in present and name in inits and inits[name].data_type
             == vi.type.tensor_type.elem_type]
    if not extra:
        return
    rank = {name: i for i, name in enumerate(input_order)}
    merged = sorted(list(proto.graph.input) + extra, key=lambda vi: rank.get(vi.name, len(rank)))
    del proto.graph.input[:]
    proto.graph.input.extend(merged)


# -- IR version ------------------------------------------------------------------------------
def choose_ir_version(current: int, opsets) -> int:
    """Keep the model's IR version, raised to what its opsets need and capped to what ORT runs."""
    needed = onnx.helper.find_min_ir_version_for(
        [onnx.helper.make_opsetid(d, v) for d, v in opsets], ignore_unknown=True)
    return min(max(current, needed), max_ort_ir_version())


# -- saving ----------------------------------------------------------------------------------
def tensor_bytes(proto: onnx.ModelProto) -> int:
    """Serialized size of the tensors held in the proto (ByteSize: reading raw_data would copy it)."""
    return sum(t.ByteSize() for t in external_data_helper._get_all_tensors(proto))


@relaxed_gc()
def save(model: QModel | onnx.ModelProto, path: str | Path, *, external_data: bool | None = None,
         atomic: bool = True) -> Path:
    """Write atomically: a temporary file in the target folder is renamed into place (``atomic=False``:
    written in place, for a path in a folder of its own that is committed whole, as the CLI's staging).

    Models whose tensor data exceed ~1.8 GB are written with one external data file
    ``<name>.data`` beside the model.
    """
    proto = model.to_proto() if isinstance(model, QModel) else model
    path = Path(path)
    if not path.parent.is_dir():
        state = "is not a folder" if path.parent.exists() else "does not exist"
        raise ModelError(f"{path}: output folder '{path.parent}' {state}")
    if external_data is None:
        external_data = tensor_bytes(proto) > EXTERNAL_DATA_THRESHOLD
    try:
        tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)) if atomic else path.parent
    except OSError as exc:
        raise ModelError(f"{path}: cannot write to '{path.parent}' ({exc.strerror})") from None
    try:
        tmp_model = tmpdir / path.name
        if external_data:
            location = path.name + ".data"
            onnx.save_model(proto, str(tmp_model), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=location, size_threshold=1024)
            _fsync(tmpdir / location)
            if atomic:
                os.replace(tmpdir / location, path.parent / location)
        else:
            with open(tmp_model, "wb") as f:
                f.write(proto.SerializeToString())
        _fsync(tmp_model)
        if atomic:
            os.replace(tmp_model, path)
    except OSError as exc:
        raise ModelError(f"{path}: write failed ({exc.strerror or exc}); previous file left intact") from None
    finally:
        if atomic:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return path


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


_SUBBYTE = ("int4", "uint4")
_NUMPY_TYPES = frozenset({  # ONNX types numpy holds as they are (gs would cast the others on load)
    onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BOOL,
    onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64})


IN_MEMORY = "qpasses-in-memory"  # external data location of weights handed over as arrays


def _share_constants(graph: gs.Graph, weights: dict) -> None:
    """Constants named in ``weights`` hold those arrays (a copy imported them as in-memory external data)."""
    if not weights:
        return
    for t in tensor_map(graph).values():
        if isinstance(t, gs.Constant) and t.name in weights:
            t._values = weights[t.name]
            t.data_location = None


def _stub_out(tensors, weights: dict) -> list:
    """Swap big numpy constants for external-data stubs (see QModel.to_proto); returns what to restore."""
    swapped = []
    for t in tensors:
        if not isinstance(t, gs.Constant):
            continue
        values = t._values
        array = values.load() if isinstance(values, LazyValues) and values.tensor.data_type in _NUMPY_TYPES \
            and values.nbytes >= 1024 else values
        if not isinstance(array, np.ndarray) or array.nbytes < 1024 or array.dtype.kind not in "fiub":
            continue
        stub = onnx.TensorProto(name=t.name, dims=array.shape, data_location=onnx.TensorProto.EXTERNAL,
                                data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype))
        for key, value in (("location", IN_MEMORY), ("offset", "0"), ("length", str(array.nbytes))):
            stub.external_data.add(key=key, value=value)
        weights[t.name] = np.ascontiguousarray(array)
        swapped.append((t, values))
        t._values = LazyValues(stub)
    return swapped


def _pack_subbyte_constants(tensors) -> None:
    """gs exports constants one byte per value: hand int4/uint4 arrays over as packed TensorProtos."""
    for t in tensors:
        if isinstance(t, gs.Constant) and isinstance(t._values, np.ndarray) and t._values.dtype.name in _SUBBYTE:
            t._values = LazyValues(onnx.numpy_helper.from_array(t._values, t.name))


def read_values(t: gs.Constant) -> np.ndarray:
    """A constant's array to read, not write: one copy of the imported bytes (read-only), where
    gs's ``values`` copies twice and keeps the array in the graph."""
    lazy = t._values
    tensor = getattr(lazy, "tensor", None) if isinstance(lazy, LazyValues) else None
    if (isinstance(tensor, onnx.TensorProto) and tensor.data_type in _NUMPY_TYPES and tensor.HasField("raw_data")
            and not external_data_helper.uses_external_data(tensor)):
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")
        array = np.frombuffer(tensor.raw_data, dtype).reshape(tuple(tensor.dims))
        return array.astype(dtype.newbyteorder("="), copy=False)
    return t.values


def raw_bytes(t: gs.Constant):
    """A constant's bytes (the imported raw data as is; a view of a large array: no copy)."""
    values = t._values
    raw = values.tensor.raw_data if isinstance(values, LazyValues) else b""   # a copy: read once
    if raw:
        return raw
    array = np.ascontiguousarray(t.values)
    if array.nbytes <= 65536:
        return array.tobytes()
    return memoryview(array.reshape(-1).view(np.uint8))  # byte view: works for int4 (ml_dtypes) too


def is_sparse(t: gs.Constant) -> bool:
    """Whether a constant holds sparse values (neither an array nor imported tensor data)."""
    return not isinstance(t._values, (np.ndarray, LazyValues))


def constant_dtype(t: gs.Constant) -> str | None:
    """The numpy dtype name of a constant's values (not loaded when numpy holds its type)."""
    lazy = t._values
    if isinstance(lazy, LazyValues) and getattr(lazy.tensor, "data_type", None) in _NUMPY_TYPES:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(lazy.tensor.data_type)).name
    dtype = getattr(t.values, "dtype", None)
    return None if dtype is None else np.dtype(dtype).name


def constant_bytes(graph: gs.Graph) -> int:
    """Bytes held by the top-level graph's constants."""
    return sum(getattr(t._values, "nbytes", 0) for t in tensor_map(graph).values() if isinstance(t, gs.Constant))


def body_graphs(graph: gs.Graph) -> list[gs.Graph]:
    """Every If/Loop/Scan body of ``graph``, nested ones too, in preorder (each body before the
    bodies inside it)."""
    out: list[gs.Graph] = []
    for node in graph.nodes:
        if any(holds_graph(v) for v in node.attrs.values()):  # cheap test first
            for sub in subgraphs(node):
                out.append(sub)
                out.extend(body_graphs(sub))
    return out


@analysis(GRAPH)
def model_bodies(model: QModel) -> list[gs.Graph]:
    """``body_graphs`` of the model's graph (``QModel.bodies``)."""
    return body_graphs(model.graph)


@analysis(GRAPH)
def model_tensors(model: QModel) -> dict[str, gs.Tensor]:
    """``model_tensor_map`` of the model's graph (``QModel.tensors``)."""
    return model_tensor_map(model.graph)


def model_tensor_map(graph: gs.Graph) -> dict[str, gs.Tensor]:
    """``tensor_map`` of the main graph, then the tensors of its If/Loop/Scan bodies whose names it
    does not hold (a body reads outer tensors as the same objects; qpasses.analysis.scopes says
    which names several bodies define)."""
    out = tensor_map(graph)
    for body in body_graphs(graph):
        for name, t in tensor_map(body).items():
            out.setdefault(name, t)
    return out


def tensor_map(graph: gs.Graph) -> dict[str, gs.Tensor]:
    """Name -> tensor of the graph's inputs, node inputs/outputs and outputs: what gs's
    ``graph.tensors()`` returns (same order, a later tensor of the same name wins), twice as fast."""
    out: dict[str, gs.Tensor] = {}
    for t in graph.inputs:
        if t.name:
            out[t.name] = t
    for node in graph.nodes:
        for t in node.inputs:
            if t.name:
                out[t.name] = t
        for t in node.outputs:
            if t.name:
                out[t.name] = t
    for t in graph.outputs:
        if t.name:
            out[t.name] = t
    return out


def make_constant(name: str, values) -> gs.Constant:
    """A gs.Constant from any array-like (numpy scalars are wrapped: gs rejects them)."""
    return gs.Constant(name, np.asarray(values, order="C"))  # keeps 0-d (ascontiguousarray makes it 1-d)
