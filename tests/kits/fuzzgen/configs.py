"""``configs()``: a random QuantConfig as a dict, with ``overrides()`` (TensorQuantOverrides)."""
from __future__ import annotations

from hypothesis import strategies as st

ACTIVATION_TYPES = ("uint8", "int8", "uint16", "int16", "uint4", "int4")
WEIGHT_TYPES = ("int8", "uint8", "int16", "uint16", "int4", "uint4")
CALIBRATION = ("minmax", "percentile", "entropy", "mse", "pow2")
QUANTIZED_OPS = ("Conv", "Gemm", "MatMul", "Add", "Mul", "Concat", "Relu", "Clip", "Sigmoid", "Softmax",
                 "MaxPool", "AveragePool", "Reshape", "Transpose", "LayerNormalization", "Where", "Resize",
                 "Gather", "Split")


FOUR_BIT = ("uint4", "int4")


@st.composite
def configs(draw, activations: list[str] = (), nodes: list[str] = (), weights: list[str] = (),
            four_bit: bool = False):
    """A random QuantConfig as a dict (only keys that differ from the defaults, some of the time).
    ``four_bit``: 4-bit activation or weight types (or 4-bit overrides) in every config."""
    cfg: dict = {}
    if four_bit:
        return draw(_four_bit(activations, nodes, weights))
    if nodes and draw(st.integers(0, 9)) == 9:
        cfg["nodes_to_exclude"] = [nodes[draw(st.integers(0, len(nodes) - 1))]]
    if nodes and draw(st.integers(0, 14)) == 14:
        cfg["nodes_to_quantize"] = sorted({nodes[draw(st.integers(0, len(nodes) - 1))] for _ in range(3)})
    if draw(st.integers(0, 9)) == 9:
        cfg["scale_type"] = "float16"
    if draw(st.integers(0, 9)) == 9:
        cfg["minimum_real_range"] = draw(st.sampled_from((1e-4, 0.01, 1.0)))
    if draw(st.integers(0, 9)) == 9:
        cfg["force_quantize_no_input_check"] = True
    if draw(st.integers(0, 14)) == 14:
        cfg["op_types_to_exclude_output_quantization"] = sorted(
            draw(st.sets(st.sampled_from(QUANTIZED_OPS), min_size=1, max_size=3)))
    if draw(st.integers(0, 14)) == 14:
        cfg["target"] = "qnn"
    if draw(st.integers(0, 14)) == 14:
        ops = draw(st.sets(st.sampled_from(QUANTIZED_OPS), min_size=1, max_size=6))
        cfg["op_types_to_quantize"] = sorted(ops)
    if draw(st.booleans()):
        cfg["activation_type"] = draw(st.sampled_from(ACTIVATION_TYPES))
    if draw(st.booleans()):
        cfg["weight_type"] = draw(st.sampled_from(WEIGHT_TYPES))
    if draw(st.integers(0, 2)) == 2:
        cfg["per_channel"] = draw(st.booleans())
    for key in ("activation_symmetric", "reduce_range", "keep_removable_activations"):
        if draw(st.integers(0, 3)) == 3:
            cfg[key] = True
    if draw(st.integers(0, 4)) == 4:
        cfg["activation_restricted_asymmetric"] = True
    if draw(st.integers(0, 3)) == 3:
        cfg["weight_symmetric"] = draw(st.booleans())
    if draw(st.integers(0, 9)) == 9:
        cfg["quantize_bias"] = False
    method = draw(st.sampled_from(("default",) + CALIBRATION))
    if method != "default":
        cal = {"method": method}
        if method == "entropy":
            cal["num_bins"] = draw(st.sampled_from((16, 128)))
        if method == "percentile":
            cal["percentile"] = draw(st.sampled_from((99.0, 99.999, 100.0)))
            cal["symmetric"] = draw(st.booleans())
        if method == "minmax" and draw(st.booleans()):
            cal["moving_average"] = True
        cfg["calibration"] = cal
    if activations and draw(st.integers(0, 3)) == 3:
        base = cfg.get("activation_type", "uint8")
        wide = ("uint16", "int16") if base in ("uint8", "int8", "uint4", "int4") else ("uint8", "int8")
        mp = {}
        qt = draw(st.sampled_from(wide))
        for _ in range(draw(st.integers(1, 2))):
            name = activations[draw(st.integers(0, len(activations) - 1))]
            qt = draw(st.sampled_from(wide)) if draw(st.integers(0, 3)) == 3 else qt
            mp[name] = qt if draw(st.booleans()) else {"quant_type": qt, "symmetric": draw(st.booleans())}
        cfg["mixed_precision"] = mp
    if (activations or weights) and draw(st.integers(0, 5)) == 5:
        cfg["tensor_overrides"] = draw(overrides(activations, weights, cfg.get("activation_type", "uint8")))
    return cfg


@st.composite
def overrides(draw, activations, weights, act_type: str):
    """onnxruntime-style TensorQuantOverrides for a few random activations and weights."""
    out = {}
    for _ in range(draw(st.integers(1, 2))):
        if weights and (not activations or draw(st.booleans())):
            name = weights[draw(st.integers(0, len(weights) - 1))]
            kind = draw(st.sampled_from(("quant_type", "symmetric", "reduce_range", "axis")))
            value = {"quant_type": st.sampled_from(WEIGHT_TYPES), "symmetric": st.booleans(),
                     "reduce_range": st.just(True), "axis": st.integers(-1, 1)}[kind]
            out[name] = [{kind: draw(value)}]
            continue
        name = activations[draw(st.integers(0, len(activations) - 1))]
        kind = draw(st.sampled_from(("quant_type", "symmetric", "range", "scale", "convert")))
        if kind == "range":
            entry = {"rmin": -draw(st.sampled_from((0.0, 0.5, 4.0))),
                     "rmax": draw(st.sampled_from((0.5, 1.0, 4.0)))}
        elif kind == "scale":
            qt = ACTIVATION_TYPES.index(act_type)
            lo, hi = ((0, 255), (-128, 127), (0, 65535), (-32768, 32767), (0, 15), (-8, 7))[qt]
            entry = {"scale": draw(st.sampled_from((0.01, 0.1, 1.0))),
                     "zero_point": draw(st.integers(lo, hi))}
        elif kind == "convert":
            wide = ("uint16", "int16") if act_type.endswith("8") else ("uint8", "int8")
            entry = {"convert": {"quant_type": draw(st.sampled_from(wide))}}
        else:
            entry = {kind: draw(st.sampled_from(ACTIVATION_TYPES) if kind == "quant_type" else st.booleans())}
        out[name] = [entry]
    return out


@st.composite
def _four_bit(draw, activations, nodes, weights):
    """A config of ``configs()`` with 4 bits somewhere: the activation type, the weight type, both,
    or a 4-bit override of one activation or weight (onnxruntime's fused kernels lack 4-bit types)."""
    cfg = draw(configs(activations, nodes, weights))
    where = draw(st.sampled_from(("activations", "weights", "both", "override")))
    if where in ("activations", "both"):
        cfg["activation_type"] = draw(st.sampled_from(FOUR_BIT))
        if draw(st.booleans()):
            cfg.pop("mixed_precision", None)
    if where in ("weights", "both"):
        cfg["weight_type"] = draw(st.sampled_from(FOUR_BIT))
    if where == "override" and (activations or weights):
        pool = list(activations) + list(weights)
        name = pool[draw(st.integers(0, len(pool) - 1))]
        cfg.setdefault("tensor_overrides", {})[name] = [{"quant_type": draw(st.sampled_from(FOUR_BIT))}]
    elif where == "override":
        cfg["activation_type"] = draw(st.sampled_from(FOUR_BIT))
    if "tensor_overrides" in cfg and cfg.get("activation_type") in FOUR_BIT:
        # fixed scales/zero points drawn for another activation type may not fit 4 bits
        cfg["tensor_overrides"] = {k: v for k, v in cfg["tensor_overrides"].items()
                                   if "zero_point" not in v[0]} or cfg.pop("tensor_overrides")
    if "tensor_overrides" in cfg and not cfg["tensor_overrides"]:
        del cfg["tensor_overrides"]
    return cfg
