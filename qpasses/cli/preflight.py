"""`qpasses check`: what quantizing a model will do, before any calibration.

The op selection is not re-derived here: the type-deciding head of the default pipeline
(``TYPE_PIPELINE``) runs on the loaded model with the user's config, through ``run_pipeline``,
so the opset upgrade and the up-front refusals (core/prechecks.py) run exactly as in ``qpasses run``.
What stays float and why is then read from the saved decisions (ir/decisions.py), as ``explain`` does.
"""
from __future__ import annotations

import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import PassFailure, QpassesError, first_line
from ..ir.graphutil import in_default_domain
from .paths import escape

# the passes of the default pipeline up to the final types (calibration needs data: not run)
TYPE_PIPELINE = "fold-constants,fold-batchnorm,cleanup,annotate-types,propagate-mixed-precision"
_CONTRIB = "com.microsoft"
_BIG = 2**30   # calibration runs models with this many bytes of weights one segment at a time


@dataclass
class Preflight:
    lines: list[str] = field(default_factory=list)      # the report, in order
    problems: list[str] = field(default_factory=list)   # what stops quantization, each with its fix
    quantized: dict[str, list[str]] = field(default_factory=dict)   # op type -> an entry per quantized node

    @property
    def ok(self) -> bool:
        return not self.problems


def check(path, config=None) -> Preflight:
    """Inspect the model at ``path`` under ``config`` (a path, dict or None). A model or config
    that cannot even be read raises the usual one-line QpassesError."""
    from ..core.context import RunContext
    from ..ir.model import constant_bytes, load

    ctx = RunContext(config)   # a bad config is a user error before anything else
    model = load(path)
    out = Preflight()
    _model_lines(out, Path(path), model, constant_bytes(model.graph))
    _input_lines(out, model)
    _body_lines(out, model)
    _domain_lines(out, model)
    _runs_in_onnxruntime(out, Path(path))
    _types(out, model, ctx)
    out.lines.append(f"verdict: {'can be quantized' if out.ok else 'cannot be quantized'}")
    out.lines += [f"  problem: {p}" for p in out.problems]
    return out


def cmd_check(args) -> int:
    result = check(args.model, args.config)
    print("\n".join(escape(line) for line in result.lines))
    if result.ok:
        return 0
    more = f" (and {len(result.problems) - 1} more, above)" if len(result.problems) > 1 else ""
    print(escape(f"qpasses: error: {args.model} cannot be quantized: {result.problems[0]}{more}"), file=sys.stderr)
    return 2


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def _model_lines(out: Preflight, path: Path, model, weights: int) -> None:
    files = list(getattr(model, "external_files", ()))
    extra = sum(f.stat().st_size for f in files if f.exists())
    data = f", external data: {len(files)} file(s), {_mb(extra)}" if files else ", no external data"
    out.lines.append(f"model: {path.name}, {_mb(path.stat().st_size)}{data}; {len(model.graph.nodes)} nodes")
    if max(weights, extra) >= _BIG:
        out.lines.append(f"  weights over {_mb(_BIG)}: calibration runs the model one segment at a time "
                         f"(budget about 1.3x the weights in RAM)")
    domains = {d.domain or "ai.onnx": d.version for d in (model.graph.import_domains or [])}
    domains["ai.onnx"] = model.opset
    listed = ", ".join(f"{d} {v}" for d, v in sorted(domains.items()))
    out.lines.append(f"  IR version {model.ir_version}; opsets: {listed}")


def _input_lines(out: Preflight, model) -> None:
    for t in model.graph.inputs:
        shape = t.shape
        dims = "?" if shape is None else "[" + ", ".join(str(d) if isinstance(d, int) else f"'{d}'" if d else "?"
                                                         for d in shape) + "]"
        dynamic = shape is None or any(not isinstance(d, int) for d in shape)
        note = " (dynamic: each calibration sample fixes it; samples may differ)" if dynamic else ""
        out.lines.append(f"input: {t.name} {np.dtype(t.dtype).name if t.dtype is not None else '?'} {dims}{note}")


def _body_lines(out: Preflight, model) -> None:
    from ..ir.model import body_graphs

    bodies = body_graphs(model.graph)
    if not bodies:
        out.lines.append("subgraphs: none")
        return
    owners = Counter(n.op for n in model.graph.nodes if n.op in ("If", "Loop", "Scan"))
    inner = sum(len(g.nodes) for g in bodies)
    out.lines.append(f"subgraphs: {len(bodies)} bodies ({', '.join(f'{k} x{v}' for k, v in sorted(owners.items()))}), "
                     f"{inner} nodes: calibrated through the outer runs and quantized like the main graph")


def _domain_lines(out: Preflight, model) -> None:
    from ..analysis.scopes import all_nodes

    foreign = Counter((n.domain, n.op) for n in all_nodes(model) if not in_default_domain(n))
    for (domain, op), count in sorted(foreign.items()):
        what = ("contrib op: runs in onnxruntime, stays float" if domain == _CONTRIB
                else "custom op: stays float; onnxruntime must be able to run it for calibration")
        out.lines.append(f"op {domain}.{op} x{count}: {what}")


def _runs_in_onnxruntime(out: Preflight, path: Path) -> None:
    """Calibration runs the float model in onnxruntime: it must load there."""
    from ..evaluation.evaluate import session

    try:
        session(path, optimize=False)
    except Exception as exc:   # onnxruntime raises its own types
        out.problems.append(f"onnxruntime cannot load the float model ({first_line(exc)}); calibration "
                            f"runs it there: replace or remove the ops it cannot run")
        return
    out.lines.append("onnxruntime: loads the float model (calibration can run it)")


def _types(out: Preflight, model, ctx) -> None:
    """Run the type-deciding passes; report what is quantized, what stays float, what refuses."""
    from ..api import run_pipeline
    from ..ir.model import constant_bytes

    notices: list[str] = []
    try:
        model, _ = run_pipeline(model, TYPE_PIPELINE, ctx=ctx, notify=notices.append)
    except (QpassesError, PassFailure) as exc:
        out.lines += [f"  {n.removeprefix('qpasses: note: ')}" for n in notices]
        out.problems.append(str(exc))
        return
    out.lines += [f"opset: {n.removeprefix('qpasses: note: ')}" for n in notices]
    out.lines.append(f"after folding ({TYPE_PIPELINE.split(',annotate')[0]}): {len(model.graph.nodes)} nodes, "
                     f"weights {_mb(constant_bytes(model.graph))}")
    _opset_line(out, model)
    quantized, floats = _node_states(model, ctx.config)
    out.quantized = dict(quantized)
    if not any(quantized.values()):
        out.problems.append("no op would be quantized under this config (op_types_to_quantize: all, "
                            "or a list of op types, selects more)")
    out.lines.append("quantized (annotate-types on a copy" + (", with the config" if ctx.config.given else "")
                     + "; run's accuracy search may keep some float to meet its target)")
    for op, names in sorted(quantized.items()):
        if names:
            types = Counter(model.quant[n].qtype for n in names)
            out.lines.append(f"  {op} x{len(names)}: " + ", ".join(f"{k} {v}" for k, v in sorted(types.items())))
    if floats:
        out.lines.append("stays float")
    for op, reasons in sorted(floats.items()):
        (_, example), count = reasons.most_common(1)[0]
        first = f" (the first of {count})" if count > 1 and "'" in example else ""
        more = f" (and {sum(reasons.values()) - count} for other reasons)" if len(reasons) > 1 else ""
        out.lines.append(f"  {op} x{sum(reasons.values())}: {example}{first}{more}")
    _pair_sums(out, model, ctx.config)


def _pair_sums(out: Preflight, model, config) -> None:
    """The layers whose int16 pair sums can saturate (from the weights alone: activations reach every code)."""
    from ..analysis.saturation import risks, table_layers, verdict

    layers = table_layers(model, config)
    if layers:
        out.lines.append(verdict(risks(layers), config.cpu, len(layers)))


def _opset_line(out: Preflight, model) -> None:
    """The opset the Q/DQ nodes will need (insert-qdq raises it when a type needs more)."""
    from ..quant.qdq import QParams, float_dtype, min_opset
    from ..quant.qtypes import qtype

    tensors = model.tensors()
    need, why = model.opset, ""
    for name, tq in model.quant.items():
        t = tensors.get(name)
        qp = QParams(qtype(tq.qtype), (1.0,), (0,), tq.axis if tq.per_channel else None)
        n = min_opset(qp, float_dtype(t) if t is not None else np.float32)
        if n > need:
            need, why = n, f"{tq.qtype}{' per-channel' if tq.per_channel else ''} '{name}'"
    if why:
        out.lines.append(f"opset: raised from {model.opset} to {need} when Q/DQ are inserted (for {why})")


def _node_states(model, config) -> tuple[dict[str, list[str]], dict[str, Counter]]:
    """Per op type: the table entries of its quantized nodes (a node the config selects whose
    quantized output has an entry; a weighted op: whose data input and weight have one, as run's
    summary counts it), and for the other nodes a count of their reasons (the saved reason that
    names the node, else why a node of its kind is left float), each reason once as its shape
    (quoted names aside) with the first node's own words."""
    from ..analysis.dtypes import float_tensors
    from ..analysis.requests import selected_nodes   # the selection annotate-types makes
    from ..analysis.scopes import all_nodes
    from ..evaluation.summary import reason_shape
    from ..ir.decisions import float_reasons
    from ..quant.oprules import QDQ_OPS, WEIGHTED_OPS, rule_for

    reasons, floats_t = float_reasons(model), float_tensors(model)
    selected = {id(node) for node, _ in selected_nodes(model, config)}
    quantized: dict[str, list[str]] = defaultdict(list)
    floats: dict[str, Counter] = defaultdict(Counter)
    examples: dict[tuple, str] = {}
    for node in all_nodes(model):
        if node.op in QDQ_OPS or node.op == "Constant":
            continue
        rule = rule_for(node.op, model.opset)
        if node.op in WEIGHTED_OPS and len(node.inputs) > 1:   # integer kernels read Q/DQ inputs, whatever the output
            hit = node.inputs[0].name if all(t.name in model.quant for t in node.inputs[:2]) else None
        else:
            outs = [t.name for i, t in enumerate(node.outputs) if rule and (rule.outputs is None or i in rule.outputs)]
            hit = next((n for n in outs if n in model.quant), None)
        if hit is not None and id(node) in selected:
            quantized[node.op].append(hit)
            continue
        around = [t.name for t in [*node.outputs, *node.inputs]]
        named = f"'{node.name}'"
        why = next((reasons[n]["reason"] for n in around if n in reasons and named in reasons[n]["reason"]), None)
        if rule is None:
            why = "qpasses has no quantization rule for it"
        elif not floats_t.intersection(around):
            why = "it reads and writes no float tensor"
        elif why is None:
            why = ("not selected by the config (op_types_to_quantize, nodes_to_quantize, nodes_to_exclude)"
                   if id(node) not in selected else "quantized only when its input is, and its input stays float")
        own = why.replace(f" '{node.name}'", "")
        shape = reason_shape(own)
        floats[node.op][(shape, examples.setdefault((node.op, shape), own))] += 1
    return quantized, floats
