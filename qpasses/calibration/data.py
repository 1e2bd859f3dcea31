"""Calibration data: every accepted source becomes a re-iterable stream of ``{input_name: array}`` feeds.

Sources (``open_data``):
- ``.npz`` file: keys are input names, the first axis of every array indexes samples
  (sample ``i`` is ``{k: npz[k][i]}``). Loaded without pickle: object arrays are refused.
- a folder of ``.npz`` files (sorted by name), each holding one or more samples as above;
- a folder in the ONNX test-data layout: ``test_data_set_*/input_*.pb`` (TensorProto files; one
  sample per ``test_data_set``). A tensor without a name is matched to the graph input at its
  position (``input_3.pb`` -> the 4th graph input);
- a mapping ``{input_name: array}`` (like the content of an .npz);
- any iterable of dicts: lists and other re-iterable containers are read again on every pass; a
  one-shot iterator (generator) can be read once;
- an onnxruntime ``CalibrationDataReader`` (``get_next()`` until ``None``; ``rewind()`` is called
  before reading it again, if it has one).

``validate(feed, inputs, index)`` checks one feed against the model's inputs and returns it
normalised. What it accepts beyond an exact match (everything else is a one-line error):
- a feed missing a leading batch dimension of 1 (model dim 1 or symbolic): the dimension is added;
- float arrays of another float width are cast (float64 -> float32, the usual case of numpy data);
- integer arrays are cast to another integer type when every value fits.
Integers are never cast to floats nor floats to integers; NaN and Inf are refused.
"""
from __future__ import annotations

import re
import stat
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import CalibrationDataError, first_line

Feed = dict


class CalibrationData:
    """Re-iterable calibration feeds. ``source`` names them in messages; ``count`` is the number of
    samples when known without reading them (else None)."""

    def __init__(self, make_iter, source: str, count: int | None = None, *, one_shot: bool = False,
                 rereadable: bool = True):
        self._make_iter = make_iter
        self.source = source
        self.count = count
        self._one_shot = one_shot
        self._used = False
        # a pass reading the feeds before calibrate must know it leaves them whole
        self.rereadable = rereadable and not one_shot

    def __iter__(self) -> Iterator[Feed]:
        if self._one_shot and self._used:
            raise CalibrationDataError(f"{self.source}: a one-shot iterator was already read; "
                                       f"pass a list, a path or a reader with rewind() to read it again")
        first, self._used = not self._used, True
        return self._make_iter(first)

    def validated(self, inputs: list["InputSpec"], max_samples: int = 0) -> Iterator[Feed]:
        """The feeds checked and normalised by ``validate`` (e.g. for running a model on them)."""
        for index, feed in enumerate(self):
            if max_samples and index >= max_samples:
                return
            yield validate(feed, inputs, index, self.source)

    def __repr__(self) -> str:
        return f"CalibrationData({self.source}, count={self.count})"


def open_data(source) -> CalibrationData:
    """Wrap any supported source (see the module docstring) as a CalibrationData."""
    if isinstance(source, CalibrationData):
        return source
    if isinstance(source, (str, Path)):
        return _open_path(Path(source))
    if callable(getattr(source, "get_next", None)):
        return _open_reader(source)
    if isinstance(source, Mapping):
        return _open_arrays(dict(source), "calibration arrays")
    if isinstance(source, Iterable):
        return _open_iterable(source)
    raise CalibrationDataError(f"calibration data: unsupported source of type {type(source).__name__} "
                               f"(expected a path, a list of dicts or a CalibrationDataReader)")


# -- paths ------------------------------------------------------------------------------------
def _open_path(path: Path) -> CalibrationData:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise CalibrationDataError(f"{path}: no such file or folder") from None
    except OSError as exc:   # a name too long, a loop of symlinks, a parent that is a file
        raise CalibrationDataError(f"{path}: cannot read it ({exc.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):   # a FIFO is never opened: it would block
        raise CalibrationDataError(f"{path}: not a regular file or folder (a FIFO or device; refused)")
    if stat.S_ISREG(mode):
        if path.suffix.lower() != ".npz":
            raise CalibrationDataError(f"{path}: expected an .npz file, a folder of .npz files or an "
                                       f"ONNX test-data folder")
        return _open_npz_files([path], str(path))
    sets = _test_data_sets(path)
    if sets:
        return CalibrationData(lambda first: _iter_test_sets(sets), str(path), len(sets))
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".npz" and p.is_file())
    if not files:
        raise CalibrationDataError(f"{path}: folder holds no .npz files and no test_data_set_* folders")
    return _open_npz_files(files, str(path))


def data_files(path: Path) -> list[Path]:
    """The files a data folder is read from: its test-data sets' ``input_*.pb``, else its .npz files
    (every entry so named: the caller refuses the ones that are not regular files)."""
    sets = _test_data_sets(path)
    if sets:
        return [f for folder in sets for f in sorted(folder.glob("input_*.pb"), key=_number)]
    return sorted(p for p in path.iterdir() if p.suffix.lower() == ".npz")


KEEP_NPZ_BYTES = 256 * 2**20   # .npz data up to this size is decompressed once per run, not per reading


def _open_npz_files(files: list[Path], source: str) -> CalibrationData:
    sizes = [_npz_count(f) for f in files]
    total = sum(n for n, _ in sizes)
    if total == 0:
        raise CalibrationDataError(f"{source}: no samples (every array has 0 rows)")
    kept: dict[Path, dict] = {}   # each pass re-reads the data: ddddocr_det's 66 MB took 0.17 s a reading
    keep = sum(b for _, b in sizes) <= KEEP_NPZ_BYTES

    def iterate(first):
        for f, (n, _) in zip(files, sizes):
            if n:
                arrays = kept.get(f) or _npz_arrays(f)
                if keep:
                    kept[f] = arrays
                yield from _split(arrays, n)

    return CalibrationData(iterate, source, total)


def _npz_count(path: Path) -> tuple[int, int]:
    """Number of samples in an .npz and the bytes of its arrays, from the array headers only (no
    data is read)."""
    try:
        with zipfile.ZipFile(path) as zf:
            shapes, nbytes = {}, 0
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                key = info.filename[:-4]
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    reader = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                              else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = reader(f)
                if dtype.hasobject:
                    raise CalibrationDataError(f"{path}: array '{key}' holds Python objects (needs pickle, "
                                               f"refused); save plain numeric arrays")
                shapes[key] = shape
                nbytes += dtype.itemsize * int(np.prod(shape))
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise CalibrationDataError(f"{path}: not a readable .npz file ({first_line(exc)})") from None
    except (RuntimeError, NotImplementedError) as exc:   # an encrypted member, an unknown compression
        raise CalibrationDataError(f"{path}: cannot read a member of the .npz file ({first_line(exc)})") from None
    return _sample_count(shapes, str(path)), nbytes


def _sample_count(shapes: dict, source: str) -> int:
    if not shapes:
        raise CalibrationDataError(f"{source}: holds no arrays")
    for key, shape in shapes.items():
        if len(shape) == 0:
            raise CalibrationDataError(f"{source}: array '{key}' is a scalar; the first axis must index samples")
    lengths = {key: shape[0] for key, shape in shapes.items()}
    if len(set(lengths.values())) > 1:
        detail = ", ".join(f"'{k}' has {n}" for k, n in lengths.items())
        raise CalibrationDataError(f"{source}: arrays disagree on the number of samples ({detail})")
    return next(iter(lengths.values()))


def _npz_arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except ValueError as exc:  # object arrays that slipped past the header check
        raise CalibrationDataError(f"{path}: cannot load without pickle ({first_line(exc)}); refused") from None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise CalibrationDataError(f"{path}: not a readable .npz file ({first_line(exc)})") from None
    except (RuntimeError, NotImplementedError) as exc:   # an encrypted member, an unknown compression
        raise CalibrationDataError(f"{path}: cannot read a member of the .npz file ({first_line(exc)})") from None


def _split(arrays: dict[str, np.ndarray], n: int) -> Iterator[Feed]:
    for i in range(n):
        yield {key: value[i] for key, value in arrays.items()}


def _open_arrays(arrays: dict, source: str) -> CalibrationData:
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    for key, value in arrays.items():
        if value.dtype.hasobject:
            raise CalibrationDataError(f"{source}: array '{key}' is not numeric (dtype {value.dtype})")
    n = _sample_count({k: v.shape for k, v in arrays.items()}, source)
    if n == 0:
        raise CalibrationDataError(f"{source}: no samples (every array has 0 rows)")
    return CalibrationData(lambda first: _split(arrays, n), source, n)


# -- ONNX test-data folders -------------------------------------------------------------------
def _number(path: Path) -> tuple:
    match = re.search(r"(\d+)$", path.stem)
    return (int(match.group(1)) if match else -1, path.name)


def _test_data_sets(path: Path) -> list[Path]:
    sets = sorted((p for p in path.glob("test_data_set_*") if p.is_dir()), key=_number)
    if not sets and any(path.glob("input_*.pb")):
        sets = [path]  # the folder is itself one test_data_set
    return sets


def _iter_test_sets(sets: list[Path]) -> Iterator[Feed]:
    for folder in sets:
        files = sorted(folder.glob("input_*.pb"), key=_number)
        if not files:
            raise CalibrationDataError(f"{folder}: no input_*.pb files")
        feed = {}
        for position, f in enumerate(files):
            tensor = onnx.TensorProto()
            try:
                tensor.ParseFromString(f.read_bytes())
                array = numpy_helper.to_array(tensor)
            except Exception as exc:  # protobuf raises assorted types on garbage
                raise CalibrationDataError(f"{f}: not a TensorProto file ({first_line(exc)})") from None
            number = _number(f)[0]
            feed[tensor.name or (number if number >= 0 else position)] = array
        yield feed


# -- Python objects -----------------------------------------------------------------------------
def _open_iterable(source) -> CalibrationData:
    one_shot = iter(source) is source
    count = len(source) if hasattr(source, "__len__") else None
    if count == 0:
        raise CalibrationDataError("calibration data: no samples (empty sequence)")
    name = f"calibration {type(source).__name__}"
    return CalibrationData(lambda first: iter(source), name, count, one_shot=one_shot)


def _open_reader(reader) -> CalibrationData:
    def iterate(first):
        if not first:
            rewind = getattr(reader, "rewind", None)
            if not callable(rewind):
                raise CalibrationDataError(f"{type(reader).__name__}: the reader has no rewind(), "
                                           f"so it cannot be read twice")
            rewind()
        while True:
            feed = reader.get_next()
            if not feed:
                return
            yield feed

    try:
        count = len(reader)
    except Exception:
        count = None
    return CalibrationData(iterate, type(reader).__name__, count,
                           rereadable=callable(getattr(reader, "rewind", None)))


# -- validation -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputSpec:
    """A graph input: numpy dtype (None if unknown), shape (ints, dim names or None; None if
    unknown rank) and whether it may be omitted (an initializer also listed as an input)."""

    name: str
    dtype: np.dtype | None
    shape: tuple | None
    optional: bool = False


def model_inputs(model) -> list[InputSpec]:
    """The inputs of a QModel or ModelProto in graph order (initializer-backed ones are optional)."""
    if isinstance(model, onnx.ModelProto):
        inits = {t.name for t in model.graph.initializer}
        return [_spec_from_value_info(vi, vi.name in inits) for vi in model.graph.input]
    variables = {v.name: v for v in model.graph.inputs}
    specs = []
    for name in model.input_order:
        if name in variables:
            v = variables[name]
            dtype = _np_dtype(v.dtype)
            shape = None if v.shape is None else tuple(d if isinstance(d, (int, str)) else None for d in v.shape)
            specs.append(InputSpec(name, dtype, shape))
        elif name in model.input_initializers:
            specs.append(_spec_from_value_info(model.input_initializers[name], True))
    return specs


def _spec_from_value_info(vi: onnx.ValueInfoProto, optional: bool) -> InputSpec:
    if not vi.type.HasField("tensor_type"):
        return InputSpec(vi.name, None, None, optional)
    tt = vi.type.tensor_type
    shape = None
    if tt.HasField("shape"):
        # dim_value <= 0 (some exporters write -1 for a dynamic batch) is as dynamic as a dim_param
        shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or None)
                      for d in tt.shape.dim)
    return InputSpec(vi.name, _np_dtype(tt.elem_type), shape, optional)


def _np_dtype(dtype) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        if isinstance(dtype, (int, np.integer)):
            return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(dtype))) if dtype else None
        return np.dtype(dtype)
    except Exception:
        return None


def validate(feed, inputs: list[InputSpec], index: int = 0, source: str = "") -> Feed:
    """Check one feed against the model's inputs; return it normalised (see the module docstring)."""
    where = f"{source}: sample {index}" if source else f"sample {index}"
    if not isinstance(feed, Mapping):
        raise CalibrationDataError(f"{where}: expected a dict of input name -> array, got {type(feed).__name__}")
    specs = {s.name: s for s in inputs}
    out = {}
    for key, value in feed.items():
        name = key
        if isinstance(key, (int, np.integer)):  # unnamed tensor: matched by position
            if not 0 <= key < len(inputs):
                raise CalibrationDataError(f"{where}: unnamed tensor #{key} but the model has {len(inputs)} inputs")
            name = inputs[key].name
        if name not in specs:
            raise CalibrationDataError(f"{where}: '{name}' is not an input of the model "
                                       f"(inputs: {', '.join(specs) or 'none'})")
        out[name] = _check_array(value, specs[name], where)
    for spec in inputs:
        if not spec.optional and spec.name not in out:
            raise CalibrationDataError(f"{where}: input '{spec.name}' is missing "
                                       f"(the sample has: {', '.join(map(str, feed)) or 'nothing'})")
    return {s.name: out[s.name] for s in inputs if s.name in out}


def _check_array(value, spec: InputSpec, where: str) -> np.ndarray:
    what = f"{where}: input '{spec.name}'"
    try:
        arr = np.asarray(value)
    except Exception as exc:
        raise CalibrationDataError(f"{what}: not an array ({first_line(exc)})") from None
    if arr.dtype.hasobject or arr.dtype.kind not in "biuf":
        raise CalibrationDataError(f"{what}: not a numeric array (dtype {arr.dtype})")
    if arr.dtype.kind == "f":
        _check_finite(arr, what)
    if spec.dtype is not None and arr.dtype != spec.dtype:
        arr = _cast(arr, spec.dtype, what)
    if spec.shape is not None:
        arr = _check_shape(arr, spec.shape, what)
    return arr


def _check_finite(arr: np.ndarray, what: str, after: str = "") -> None:
    if not np.isfinite(arr).all():
        kind = "NaN" if np.isnan(arr).any() else "Inf"
        raise CalibrationDataError(f"{what} contains {kind}{after}")


def _cast(arr: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    src, dst = arr.dtype, np.dtype(dtype)
    if src.kind == "f" and dst.kind == "f":
        with np.errstate(over="ignore"):
            out = arr.astype(dst)
        _check_finite(out, what, f" after casting {src} to {dst} (values too large)")
        return out
    if src.kind in "iu" and dst.kind in "iu":
        info = np.iinfo(dst)
        if arr.size == 0 or (arr.min() >= info.min and arr.max() <= info.max):
            return arr.astype(dst)
        raise CalibrationDataError(f"{what} has {src} values outside the range of {dst}, the model's type")
    hint = " (integers are never cast to floats)" if src.kind in "iub" and dst.kind == "f" else ""
    raise CalibrationDataError(f"{what} has dtype {src}, the model expects {dst}{hint}")


def _check_shape(arr: np.ndarray, dims: tuple, what: str) -> np.ndarray:
    def fits(shape, want):
        return len(shape) == len(want) and all(d is None or isinstance(d, str) or d == s
                                               for s, d in zip(shape, want))

    if fits(arr.shape, dims):
        return arr
    if dims and (dims[0] in (1, None) or isinstance(dims[0], str)) and fits((1,) + arr.shape, dims):
        return arr[np.newaxis]
    want = "(" + ", ".join("?" if d is None else str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"
    raise CalibrationDataError(f"{what} has shape {tuple(arr.shape)} but the model expects {want}")
