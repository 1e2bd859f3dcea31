"""quantize-weights: weight-only block-wise quantization of MatMul/Gemm weights (mode: weight_only)."""
from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from ..core.facts import claim
from ..core.pipeline import Pass, PassResult
from ..core.registry import register
from ..errors import CalibrationDataError
from ..ir.decisions import leave_float
from ..ir.model import QModel
from ..quant.qdq import new_namer, require_opset
from ..weightonly import awq
from ..weightonly.emit import QDQ_OPSET, drop_dead_nodes, is_rewrite, output_arrays, to_dequantize, to_matmulnbits
from ..weightonly.gptq import quantize_gptq, quantize_gptq_shared
from ..weightonly.hessian import input_stats
from ..weightonly.hqq import quantize_hqq
from ..weightonly.mx import ELEMENTS, quantize_mx
from ..executors.threads import in_order
from ..weightonly.rtn import quantize_rtn
from ..weightonly.scaling import divide_input
from ..weightonly.targets import find_targets

NAME = "quantize-weights"
DECISIONS = "weight_only"
FACT = "weights-quantized"
# arithmetic per weight value against RTN's, for the thread pool's threshold (parallel.MIN_VALUES):
# HQQ's updates took 26 ms where RTN took 3 on encoder_block's 0.79 M values
WORK = {"hqq": 8}
EXAMPLE = """
g (float[2,32] x) => (float[2,2] y) <float[32,2] w = {%s}>
{
  y = MatMul(x, w)
}
""" % ", ".join(f"{((i * 37) % 101 - 50) / 40:g}" for i in range(32 * 2))


@claim(FACT)
def weights_in_graph(model: QModel) -> list[str]:
    """Every weight ``decisions["weight_only"]`` names is read as float by no node, and the graph
    holds a rewrite (MatMulNBits or block-wise DequantizeLinear) for each."""
    claimed = model.decisions.get(DECISIONS, {})
    readers, rewrites = {}, 0
    for node in model.graph.nodes:
        rewrites += is_rewrite(node)
        for t in node.inputs:
            readers.setdefault(t.name, node)
    problems = [f"weight '{w}' is reported quantized but node '{readers[w].name}' ({readers[w].op}) "
                f"reads it as float" for w in claimed if w in readers]
    if rewrites < len(claimed):
        problems.append(f"{len(claimed)} weights are reported quantized; the graph holds {rewrites} "
                        f"(MatMulNBits or block-wise DequantizeLinear)")
    return problems


@register
class QuantizeWeights(Pass):
    """Quantize MatMul/Gemm weights per block along K (RTN, HQQ, GPTQ or AWQ; QDQ or MatMulNBits).

    Reads: the config's ``weight_only`` block (bits, block_size, symmetric, algorithm, format,
    exclude, damping, act_order, scheme: int or an MX format with power-of-two block scales) and, for gptq and awq, the calibration data (X^T X and mean |x| of
    every weight's input, one streamed float run). Writes: each constant 2-D weight of a MatMul (or a
    Gemm with alpha = beta = 1) read by nothing else becomes int4/int8 codes with a scale (and zero
    point) per block of ``block_size`` input channels: a DequantizeLinear(axis, block_size) feeding
    the node (opset 21), or the node becomes com.microsoft.MatMulNBits; an MX scheme gives int8 or
    float8 elements with a power-of-two scale per 32 (weightonly/mx.py). awq also divides each input
    by its channel scales (folded into a LayerNormalization that only those weights read, else a
    Mul). ``model.decisions["weight_only"]`` holds what each weight became; weights left float are
    in ``model.decisions["float"]`` with the reason. Weights are quantized on a thread pool (one per
    CPU not busy with other work, from 4 M weight values; HQQ from 0.5 M), at most threads + 1 in flight, and
    edited into the graph in order (the same bytes as on one thread; each float weight is dropped
    once quantized). Invariants: codes within 2^bits levels; outputs run in onnxruntime; a second
    run finds nothing left to quantize.
    """

    name: ClassVar[str] = NAME
    establishes: ClassVar[frozenset] = frozenset({FACT})
    example: ClassVar[str] = EXAMPLE
    example_config: ClassVar[dict] = {"mode": "weight_only", "weight_only": {"block_size": 16}}

    def run(self, model: QModel, ctx) -> PassResult:
        cfg = ctx.config.weight_only
        targets, skipped = find_targets(model.graph, cfg.exclude)
        known = model.decisions.get("float", {})
        news = {w: why for w, why in skipped.items() if known.get(w, {}).get("reason") != why}
        leave_float(model, news, NAME)
        if not targets:
            return PassResult(model, bool(news), {"quantized": 0, "left_float": len(skipped)})
        if cfg.format == "qdq" and require_opset(model, QDQ_OPSET):   # the converter may give a new graph
            targets, _ = find_targets(model.graph, cfg.exclude)
        stats = self._statistics(model, ctx, targets) if cfg.algorithm in ("gptq", "awq") else {}
        namer = new_namer(model)
        prepared = self._awq(model, targets, stats, cfg, namer) if cfg.algorithm == "awq" else {}
        replaced, added = {}, {}
        done = model.decisions.setdefault(DECISIONS, {})

        def quantize(group):   # on a worker thread: no graph edits
            return [(t, b, output_arrays(t, b, cfg.format)) for t, b in zip(group, self._quantize_group(
                group, stats, cfg, prepared))]

        values = sum(math.prod(t.weight.shape) for t in targets) * WORK.get(cfg.algorithm, 1)
        results, ready = in_order(self._jobs(targets, stats, cfg), quantize, values), {}
        for target in targets:
            while id(target) not in ready:   # graph edits in target order, whatever the jobs
                ready.update((id(t), (b, a)) for t, b, a in next(results))
            blocked, arrays = ready.pop(id(target))
            name = target.weight.name
            prepared.pop(name, None)
            if cfg.format == "matmulnbits":
                replaced[id(target.node)] = to_matmulnbits(target, blocked, namer, arrays)
            else:
                added.setdefault(id(target.node), []).append(to_dequantize(target, blocked, namer, arrays))
            target.weight.values = np.zeros(0, np.float32)   # drop the float weight now
            kind = cfg.scheme if cfg.scheme != "int" else f"{'u' if not blocked.symmetric else ''}int{cfg.bits}"
            done[name] = f"{NAME}: {cfg.algorithm} {kind} block {cfg.block_size} along K -> {cfg.format}"
        results.close()
        nodes = []
        for node in model.graph.nodes:
            nodes.extend(added.get(id(node), []))
            nodes.append(replaced.get(id(node), node))
        model.graph.nodes = nodes
        drop_dead_nodes(model.graph)
        model.decisions[DECISIONS] = dict(sorted(done.items()))
        return PassResult(model, True, {"quantized": len(targets), "left_float": len(skipped)})

    @staticmethod
    def _statistics(model, ctx, targets) -> dict:
        if ctx.calibration_data is None:
            raise CalibrationDataError(f"weight_only.algorithm {ctx.config.weight_only.algorithm} "
                                       "needs calibration data (--calib)")
        return input_stats(model, ctx.calibration_data, {t.activation.name for t in targets})

    @staticmethod
    def _jobs(targets, stats, cfg) -> list[list]:
        """Targets quantized together: for gptq, those reading the same input (one Hessian, same
        float type); else one by one. In the order of each job's first target."""
        if cfg.algorithm != "gptq":
            return [[t] for t in targets]
        jobs: dict = {}
        for t in targets:
            key = (t.activation.name, t.dtype) if t.activation.name in stats else id(t)
            jobs.setdefault(key, []).append(t)
        return list(jobs.values())

    def _quantize_group(self, group, stats, cfg, prepared) -> list:
        if len(group) == 1:
            return [prepared.get(group[0].weight.name) or self._quantize(group[0], stats, cfg)]
        element = ELEMENTS.get(cfg.scheme)
        return quantize_gptq_shared([t.matrix for t in group], stats[group[0].activation.name].hessian, cfg.bits,
                                    cfg.block_size, cfg.symmetric or element is not None, cfg.damping, cfg.act_order,
                                    element=element, dtype=group[0].dtype)

    @staticmethod
    def _quantize(target, stats, cfg):
        w = target.matrix
        dtype = target.dtype
        st = stats.get(target.activation.name)
        if cfg.scheme != "int":
            if cfg.algorithm == "gptq" and st is not None:
                return quantize_gptq(w, st.hessian, cfg.bits, cfg.block_size, True, cfg.damping, cfg.act_order,
                                     element=ELEMENTS[cfg.scheme], dtype=dtype)
            return quantize_mx(w, cfg.scheme, dtype)
        if cfg.algorithm == "hqq":
            return quantize_hqq(w, cfg.bits, cfg.block_size, integer_zero_points=cfg.format == "qdq")
        if cfg.algorithm == "gptq" and st is not None:
            return quantize_gptq(w, st.hessian, cfg.bits, cfg.block_size, cfg.symmetric, cfg.damping, cfg.act_order)
        return quantize_rtn(w, cfg.bits, cfg.block_size, cfg.symmetric, pack=cfg.format == "matmulnbits")

    @staticmethod
    def _awq(model, targets, stats, cfg, namer) -> dict:
        """Search each input's channel scales over the weights reading it; rewire the input."""
        groups: dict[str, list] = {}
        for t in targets:
            groups.setdefault(t.activation.name, []).append(t)
        out = {}
        for act, members in groups.items():
            st = stats.get(act)
            if st is None:
                continue
            mx = None
            if cfg.scheme != "int":
                dtype = members[0].dtype

                def mx(w, channel_weights, dtype=dtype):
                    return quantize_mx(w, cfg.scheme, dtype, channel_weights)
            scales, quantized, _ = awq.search([t.matrix for t in members], st.hessian, st.mean_abs,
                                              cfg.bits, cfg.block_size, cfg.symmetric, quantize=mx)
            if not np.allclose(scales, 1.0):
                divide_input(model, members[0].activation, [t.node for t in members], scales, namer)
            out.update((t.weight.name, q) for t, q in zip(members, quantized))
        return out
