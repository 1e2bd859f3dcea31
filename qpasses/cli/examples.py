"""A bundled example: a small float CNN and calibration data, so `qpasses run` needs no user data."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import QpassesError


def example_model(seed: int = 0) -> onnx.ModelProto:
    """Conv-BN-Relu x2, a residual Add, global pooling and a Gemm classifier (opset 17)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def weight(name, *shape, scale=None):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        arr = rng.normal(0, scale or np.sqrt(2.0 / fan_in), shape).astype(np.float32)
        inits.append(numpy_helper.from_array(arr, name))
        return name

    def bn(prefix, channels, x, y):
        inits.extend([
            numpy_helper.from_array(rng.uniform(0.5, 1.5, channels).astype(np.float32), f"{prefix}_gamma"),
            numpy_helper.from_array(rng.normal(0, 0.1, channels).astype(np.float32), f"{prefix}_beta"),
            numpy_helper.from_array(rng.normal(0, 0.1, channels).astype(np.float32), f"{prefix}_mean"),
            numpy_helper.from_array(rng.uniform(0.5, 2.0, channels).astype(np.float32), f"{prefix}_var"),
        ])
        nodes.append(helper.make_node("BatchNormalization", [x, f"{prefix}_gamma", f"{prefix}_beta",
                                                             f"{prefix}_mean", f"{prefix}_var"], [y], name=prefix))

    nodes.append(helper.make_node("Conv", ["input", weight("conv1_w", 16, 3, 3, 3), weight("conv1_b", 16, scale=0.1)],
                                  ["conv1"], name="conv1", pads=[1, 1, 1, 1]))
    bn("bn1", 16, "conv1", "bn1")
    nodes.append(helper.make_node("Relu", ["bn1"], ["relu1"], name="relu1"))
    nodes.append(helper.make_node("Conv", ["relu1", weight("conv2_w", 16, 16, 3, 3), weight("conv2_b", 16, scale=0.1)],
                                  ["conv2"], name="conv2", pads=[1, 1, 1, 1]))
    bn("bn2", 16, "conv2", "bn2")
    nodes.append(helper.make_node("Add", ["bn2", "relu1"], ["res"], name="residual"))
    nodes.append(helper.make_node("Relu", ["res"], ["relu2"], name="relu2"))
    nodes.append(helper.make_node("MaxPool", ["relu2"], ["pool"], name="pool", kernel_shape=[2, 2], strides=[2, 2]))
    nodes.append(helper.make_node("GlobalAveragePool", ["pool"], ["gap"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"))
    nodes.append(helper.make_node("Gemm", ["flat", weight("fc_w", 10, 16), weight("fc_b", 10, scale=0.1)],
                                  ["logits"], name="fc", transB=1))
    graph = helper.make_graph(
        nodes, "qpasses_example",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="qpasses-example")
    model.ir_version = 10
    return model


def example_data(samples: int = 32, seed: int = 1) -> dict[str, np.ndarray]:
    """Smooth random images (sum of low-frequency waves plus noise), shape (N, 1, 3, 32, 32)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:32, 0:32] / 32.0
    out = np.empty((samples, 1, 3, 32, 32), np.float32)
    for i in range(samples):
        for c in range(3):
            fx, fy, phase = rng.uniform(0.5, 3, 3)
            out[i, 0, c] = np.sin(2 * np.pi * (fx * xx + fy * yy) + phase * 6) + rng.normal(0, 0.2, (32, 32))
    return {"input": out}


def write_example(folder, *, force: bool = False) -> tuple[Path, Path, Path]:
    """Write model.onnx, calib.npz and eval.npz into ``folder``; returns their paths.

    Refuses to overwrite any of them unless ``force`` (then only regular files are replaced); the
    three are staged beside their targets and renamed into place together (outputs.py), so a
    failure leaves the folder as it was. A folder that cannot be written is a one-line error.
    """
    from .outputs import Staging
    from .paths import PathError, PathGuard

    folder = Path(folder)
    paths = model_path, calib_path, eval_path = folder / "model.onnx", folder / "calib.npz", folder / "eval.npz"
    try:
        if folder.exists() and not folder.is_dir():
            raise QpassesError(f"{folder}: is not a folder")
        present = [p.name for p in paths if p.exists() or p.is_symlink()]
    except OSError as exc:   # a name too long, a loop of symlinks
        raise QpassesError(f"{folder}: cannot write the example ({exc.strerror or exc})") from None
    if present and not force:
        raise QpassesError(f"{folder}: {', '.join(present)} already there; remove them, pass --force or "
                           f"choose another folder")
    guard = PathGuard()
    guard.write_folder("example", folder, [p.name for p in paths])   # regular files or new paths only
    with Staging(guard) as staging:
        target = folder
        try:
            staged = staging.folder(folder, "example")
            for path, write in ((model_path, lambda p: onnx.save(example_model(), p)),
                                (calib_path, lambda p: np.savez(p, **example_data(32, seed=1))),
                                (eval_path, lambda p: np.savez(p, **example_data(16, seed=2)))):
                target = path
                write(staged / path.name)
        except OSError as exc:
            raise QpassesError(f"{target}: cannot write the example ({exc.strerror or exc})") from None
        except PathError as exc:   # the folder itself cannot be written
            raise QpassesError(str(exc).replace(": cannot write to", ": cannot write the example to", 1)) from None
        staging.commit()
    return model_path, calib_path, eval_path


def cmd_example(args) -> int:
    model, calib, evald = write_example(args.folder, force=args.force)
    print(f"wrote {model}, {calib}, {evald}\n"
          f"next: qpasses run {model} -o {Path(args.folder) / 'model.qdq.onnx'} --calib {calib} --eval {evald}")
    return 0
