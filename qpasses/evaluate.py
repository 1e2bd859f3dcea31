"""Numeric comparison of two models in onnxruntime: SNR and max error per output."""
from __future__ import annotations

import math

import numpy as np
import onnx

from .ir import QModel


def session(model):
    """An onnxruntime CPU session for a QModel, ModelProto, bytes or path."""
    import onnxruntime as ort

    if isinstance(model, QModel):
        model = model.to_proto()
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), opts,
                                providers=["CPUExecutionProvider"])


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """10*log10(sum(ref^2) / sum((ref-test)^2)); inf when identical."""
    ref = np.asarray(reference, dtype=np.float64)
    err = float(np.sum((ref - np.asarray(test, dtype=np.float64)) ** 2))
    signal = float(np.sum(ref**2))
    if err == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / err)


def compare(reference_model, test_model, feeds, max_samples: int | None = None) -> dict:
    """Run both models on every feed; per output: SNR over all samples and max abs error."""
    ref_sess, test_sess = session(reference_model), session(test_model)
    names = [o.name for o in ref_sess.get_outputs()]
    refs: dict[str, list] = {n: [] for n in names}
    tests: dict[str, list] = {n: [] for n in names}
    count = 0
    for feed in feeds:
        if max_samples is not None and count >= max_samples:
            break
        inputs = {i.name for i in ref_sess.get_inputs()}
        feed = {k: v for k, v in feed.items() if k in inputs}
        for n, r, t in zip(names, ref_sess.run(names, feed), test_sess.run(names, feed)):
            refs[n].append(np.ravel(r).astype(np.float64))
            tests[n].append(np.ravel(t).astype(np.float64))
        count += 1
    out = {}
    for n in names:
        if not refs[n]:
            continue
        r, t = np.concatenate(refs[n]), np.concatenate(tests[n])
        out[n] = {"snr_db": snr_db(r, t), "max_abs_error": float(np.max(np.abs(r - t))) if r.size else 0.0}
    return {"samples": count, "outputs": out,
            "snr_db": min((v["snr_db"] for v in out.values()), default=math.inf)}
