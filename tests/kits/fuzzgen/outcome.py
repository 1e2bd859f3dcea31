"""``run_case``: quantize a :class:`FuzzCase` with the default pipeline and classify the outcome."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np
import onnx

from .cases import FuzzCase


@dataclass
class Outcome:
    """What the default pipeline did with a case: ``ok``, ``error`` (a QpassesError), ``crash``, or
    ``skip`` (the float model itself gives inf/NaN on the drawn feeds).

    ``kind`` groups outcomes for counting (the error class and message with names and numbers
    blanked, or the crash's stage and exception site); ``detail`` is the full message.
    """

    status: str
    kind: str
    detail: str = ""
    snr: dict = field(default_factory=dict)


SNR_FLOOR_DB = 0.0


def snr_floor(case: "FuzzCase") -> float | None:
    """The least SNR (dB) a correct quantizer reaches on every output of ``case``, or None.

    Only for unit-normal feeds and activations and weights of 8 bits or more, calibrated with
    minmax (no moving average) or pow2: the SNR is measured on the calibration feeds, so no value
    is clipped and every quantization adds at most half a step, 1/510 of the tensor's range. The
    drawn ops amplify that error by small factors only (weights ~ N(0, 1/fan_in), divisors >= 0.5,
    normalisations with eps = 1e-3 scale by at most ~32, the kinks of HardSwish/Clip/... sit at
    unit scale), so a typical output sits near 40 dB and only a cancellation of roughly 40 dB (an
    output ~100x smaller than its inputs on every sample) pushes it below 0 dB, the SNR of an
    all-zero output. Measured on thousands of eligible cases, the lowest SNR seen is 10-20 dB (a
    tiny Gemm whose output cancels); gross bugs (wrong scale, axis or zero point, a shared scale
    where ranges differ) land well below 0 dB. Without a floor (``no_floor_reasons``): 4-bit types,
    clipping calibrations (percentile, entropy, mse, moving average), tensor overrides (fixed
    ranges, scales), scaled or offset feeds (x100 feeds make HardSwish's output 1000x smaller
    than its input's range) and scaled weights/biases legitimately reach 0 dB.
    """
    return None if no_floor_reasons(case) else SNR_FLOOR_DB


def no_floor_reasons(case: "FuzzCase") -> list[str]:
    """Why ``snr_floor`` does not apply to ``case`` (empty: it applies)."""
    from qpasses import QpassesError, load_config

    try:
        config = load_config(case.config)
    except QpassesError:
        return ["invalid-config"]
    cal = config.calibration
    checks = {"4-bit": any(t.endswith("4") for t in (config.activation_type, config.weight_type)),
              cal.method: cal.method not in ("minmax", "pow2"), "moving-average": cal.moving_average,
              "overrides": config.tensor_overrides}
    return [why for why, applies in checks.items() if applies] + list(case.traits)


def run_case(case: FuzzCase, snr_floor=snr_floor) -> Outcome:
    """Quantize ``case`` with the default pipeline and check the result.

    ok: the model passes onnx.checker, loads and runs in onnxruntime with the float model's
    output shapes, no output's SNR (on the calibration feeds) is NaN, and the SNR is at least
    ``snr_floor(case)`` dB when that returns a number. The SNR is measured with
    ORT_DISABLE_ALL, i.e. the exact QDQ semantics: onnxruntime's QDQ fusions have bugs of their
    own (QLinearSoftmax over an inner axis; a float Conv bias dropped with 16-bit Q/DQ; QLinearConv
    refusing per-channel weight scales on another axis), so the default session is checked to load
    — a model it cannot load is a crash, as `qpasses run` would exit 1 on it (4-bit activations
    its fused kernels lack are refused up front: an error) — to run (except in fused QLinear
    kernels) and for NaN; the ``ORT_*`` outcomes mark those onnxruntime bugs.
    error: a one-line QpassesError. Anything else is a crash.
    """
    import qpasses
    from qpasses.evaluation.evaluate import session

    try:
        onnx.checker.check_model(case.model)
        ref_sess = session(case.model)
        refs = [ref_sess.run(None, f) for f in case.feeds]
    except Exception as exc:  # the strategy made an invalid model: a bug in this module
        return _crash("invalid-model", exc)
    if not all(np.all(np.isfinite(r)) for rs in refs for r in rs):  # large inputs through act x act products
        return Outcome("skip", "skip: the float model overflows on these feeds")
    before = case.model.SerializeToString()
    try:
        q = qpasses.quantize(case.model, case.feeds, config=case.config, passes=case.passes)
    except qpasses.QpassesError as exc:
        text = str(exc)
        if not text.strip() or "\n" in text.strip() or "Traceback" in text:
            return _crash("unclear-error", exc)
        return Outcome("error", f"{type(exc).__name__}: {_blank(text)}", text)
    except Exception as exc:
        return _crash("pipeline", exc)
    if case.model.SerializeToString() != before:
        return Outcome("crash", "input-mutated", "quantize() changed the ModelProto it was given")
    names = [o.name for o in ref_sess.get_outputs()]
    stage, kind = "export", "ok"
    try:
        proto = q.to_proto()
        stage = "checker"
        onnx.checker.check_model(proto)
        stage = "ort-load"   # at the default optimization level, as `qpasses run` checks before writing
        sess = session(proto)
        exact_sess = _session(proto, "ORT_DISABLE_ALL")
        stage = "ort-run"
        exact = [exact_sess.run(names, f) for f in case.feeds]
        try:
            fused = [sess.run(names, f) for f in case.feeds]
        except Exception as exc:
            if "QLinear" not in str(exc):   # only onnxruntime's fused kernels are excused
                raise
            fused, kind = None, ORT_RUN
    except Exception as exc:
        return _crash(stage, exc)
    for i, name in enumerate(names):
        if any(e[i].shape != r[i].shape for e, r in zip(exact, refs)):
            return Outcome("crash", "output-shape", f"output '{name}' changed shape")
    snr, fused_snr = _snr(names, refs, exact), _snr(names, refs, fused) if fused else {}
    for which, values in (("", snr), (" (onnxruntime optimizations on)", fused_snr)):
        if any(math.isnan(v) for v in values.values()):
            return Outcome("crash", "snr-nan" + which, f"NaN SNR{which}: {values}", snr)
    floor = snr_floor(case) if snr_floor else None
    if floor is not None and min(snr.values()) < floor:
        return Outcome("crash", "snr-low", f"SNR {min(snr.values()):.1f} dB < floor {floor} dB: {snr}", snr)
    if kind == "ok" and min(fused_snr.values()) < min(min(snr.values()) - 10, 20):
        kind = ORT_FUSION
    return Outcome("ok", kind, "", snr)


# outcomes that are onnxruntime's bugs, not qpasses': counted apart, never a failure
ORT_FUSION = "ok, >10 dB lost with onnxruntime's optimizations on only (a QDQ fusion bug)"
ORT_RUN = "ok, onnxruntime's fused QLinear kernel fails at run time (the exact QDQ model runs)"


def _snr(names: list[str], refs: list, outs: list) -> dict[str, float]:
    """SNR of each output over every feed."""
    from qpasses.evaluation.evaluate import snr_db

    return {name: snr_db(np.concatenate([np.ravel(r[i]) for r in refs]),
                         np.concatenate([np.ravel(o[i]) for o in outs])) for i, name in enumerate(names)}


def _session(proto: onnx.ModelProto, level: str):
    """An onnxruntime CPU session at graph optimization ``level`` (ORT_DISABLE_ALL: exact QDQ semantics)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _crash(stage: str, exc: BaseException) -> Outcome:
    """A crash outcome whose kind names the stage, the exception type and where it was raised."""
    import traceback

    inner = exc.__cause__ or exc
    frames = traceback.extract_tb(inner.__traceback__)
    ours = [f for f in frames if "/qpasses/" in f.filename] or frames
    where = f"{ours[-1].filename.rsplit('/qpasses/', 1)[-1]}:{ours[-1].lineno}" if ours else "?"
    first = (str(exc).strip().splitlines() or [""])[0]
    if stage in ("pipeline", "export"):
        kind = f"{stage}: {type(inner).__name__} at {where}"
    else:  # checker / onnxruntime: the message says what is wrong
        text = re.sub(r"^.*?(FAIL|INVALID_GRAPH|INVALID_ARGUMENT) : |\S+\.cc:\d+ [^)]*\) ", "", first)
        kind = f"{stage}: {_blank(text)}"
    return Outcome("crash", kind, f"{type(exc).__name__}: {first}")


def _blank(text: str) -> str:
    """A message with quoted names and numbers replaced, so errors of one kind count together."""
    text = re.sub(r"'[^']*'|\([A-Za-z_][^()]*\)", "'…'", text)
    return re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", text)[:120]
