"""`qpasses compare float.onnx q.onnx --data eval.npz --per-layer [--provider ort-int8|openvino]`.

Three runs of the same feeds: the float model, the simulation (the QDQ model in onnxruntime with
graph optimizations off: every Q/DQ as written) and the provider (backends.py). Per quantized
activation, the provider's integers against the simulation's: the difference in LSBs (steps of
that tensor's own grid), its SNR against the float tensor in both, and for the first tensor more
than 1 LSB apart the likely cause. A later tensor whose quantized inputs already differ by more
than 1 LSB inherits that divergence; its own cause would be guesswork.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import QpassesError
from ..evaluation.evaluate import snr_from_sums
from . import LAYER_SAMPLES as SAMPLES
from .backends import INT_KERNELS, OpenVino, OrtInt8, with_outputs
from .layers import upstream
from .localise import lines as localised, localise

PROVIDERS = {"ort-int8": OrtInt8, "openvino": OpenVino}


@dataclass
class Row:
    tensor: str
    q_output: str           # the QuantizeLinear output read from both runs
    producer: str           # the op writing the tensor in the QDQ model
    order: int
    qtype: str
    scale: float
    zero_point: int
    kernel: str = ""        # what the provider runs to write the integers
    max_lsb: int = 0
    mean_lsb: float = 0.0
    values: int = 0
    over_1: int = 0             # values more than 1 LSB apart
    share_off: float = 0.0      # share of values that differ at all
    share_over_1: float = 0.0
    sim_snr: float = math.nan       # dB against the float tensor
    provider_snr: float = math.nan
    upstream: list = field(default_factory=list)   # quantized tensors read on the way here
    dropped: bool = False
    cause: str = ""


def has_vnni() -> bool | None:
    """Whether this CPU has VNNI (u8 x s8 products summed in int32 without int16 saturation);
    None where /proc/cpuinfo cannot tell."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"})


def compare_per_layer(float_model, qdq_model, data, *, provider: str = "ort-int8", samples: int = SAMPLES) -> dict:
    """The per-layer comparison as a JSON-able dict (see the module docstring)."""
    from ..evaluation.evaluate import checked_feeds, session
    from ..ir.model import load
    from .layers import quantized_activations, quantized_names

    fmodel = load(float_model) if isinstance(float_model, (str, Path)) else float_model
    qmodel = load(qdq_model) if isinstance(qdq_model, (str, Path)) else qdq_model
    fproto, qproto = fmodel.to_proto(metadata=False), qmodel.to_proto(metadata=False)
    found = {n: v for n, v in quantized_activations(fproto, qmodel, qproto).items() if len(v[0].scale) == 1}
    q_of = quantized_names(qproto, found)
    fsess = session(with_outputs(fproto, list(found)))
    feeds = checked_feeds(fsess, data, samples)   # against the session's inputs, as `qpasses compare` does
    if not feeds:
        raise QpassesError("--data holds no samples")
    backend = PROVIDERS[provider](qproto, [q_of[n] for n in found])
    rows = {n: Row(n, q_of[n], op, order, tq.qtype, float(tq.scale[0]), int(tq.zero_point[0]),
                   kernel=backend.kernel(q_of[n]), dropped=q_of[n] in backend.dropped)
            for n, (tq, op, order) in found.items() if q_of[n] in backend.readable}
    outputs = [o.name for o in qproto.graph.output]
    ssess = session(with_outputs(qproto, [r.q_output for r in rows.values()]), optimize=False)
    fnames, snames = [o.name for o in fsess.get_outputs()], [o.name for o in ssess.get_outputs()]
    sums = {n: np.zeros(7) for n in rows}   # values, off, over 1, sum |d|, signal, sim error, provider error
    out_sums = {o: np.zeros(5) for o in outputs}   # signal, sim, deployed, exposed errors, max |exposed - deployed|
    refs = []   # per feed, the float outputs (for the localisation)
    for feed in feeds:
        ref = {**dict(zip(fnames, fsess.run(fnames, feed))), **feed}
        refs.append([ref[o] for o in outputs])
        sim = dict(zip(snames, ssess.run(snames, feed)))
        got, deployed = backend.run(feed), backend.deployed(feed)
        for n, row in rows.items():
            a, b = sim[row.q_output].astype(np.int64), np.asarray(got[row.q_output]).astype(np.int64)
            d = np.abs(b - a).ravel()
            x = np.asarray(ref[n], np.float64).ravel()
            e_sim = (a.ravel() - row.zero_point) * row.scale - x
            e_prov = (b.ravel() - row.zero_point) * row.scale - x
            sums[n] += (d.size, np.count_nonzero(d), np.count_nonzero(d > 1), d.sum(), x @ x, e_sim @ e_sim, e_prov @ e_prov)
            row.max_lsb = max(row.max_lsb, int(d.max(initial=0)))
        for o, dep in zip(outputs, deployed):
            x = np.asarray(ref[o], np.float64).ravel()
            s, e, dp = (np.asarray(v, np.float64).ravel() - x for v in (sim[o], got[o], dep))
            out_sums[o][:4] += (x @ x, s @ s, dp @ dp, e @ e)
            out_sums[o][4] = max(out_sums[o][4], float(np.max(np.abs(e - dp), initial=0)))
    for n, row in rows.items():
        count, off, over, total, signal, es, ep = sums[n]
        row.values, row.over_1 = int(count), int(over)
        row.share_off, row.share_over_1 = off / max(count, 1), over / max(count, 1)
        row.mean_lsb = total / max(count, 1)
        row.sim_snr, row.provider_snr = snr_from_sums(signal, es), snr_from_sums(signal, ep)
    first = _explain(rows, upstream(qproto, {n: r.q_output for n, r in rows.items()}), backend)
    snrs = {o: {"sim_snr_db": snr_from_sums(v[0], v[1]), "provider_snr_db": snr_from_sums(v[0], v[2]),
                "provider_read_snr_db": snr_from_sums(v[0], v[3]), "read_vs_deployed_max_abs": v[4]} for o, v in out_sums.items()}
    read = [r.q_output for r in sorted(rows.values(), key=lambda r: (r.order, r.tensor))]
    changes = localise(backend, read, feeds, refs, min(v["provider_snr_db"] for v in snrs.values()),
                       min(v["provider_read_snr_db"] for v in snrs.values())) if snrs else None
    if changes:   # name the tensors, not their QuantizeLinear outputs
        tensor_of = {r.q_output: r.tensor for r in rows.values()}
        for hit in changes["found"]:
            hit["tensor"] = tensor_of[hit["tensor"]]
    return {"provider": backend.name, "samples": len(feeds), "notes": backend.notes, "vnni": has_vnni(),
            "outputs": snrs, "read_changes": changes,
            "tensors": [asdict(r) for r in sorted(rows.values(), key=lambda r: (r.order, r.tensor))],
            "unread": sorted(n for n in found if n not in rows),
            "first_divergence": asdict(first) if first else None}


def _explain(rows: dict[str, Row], ups: dict[str, list[str]], backend) -> Row | None:
    """Fill ``upstream`` and ``cause`` of the rows more than 1 LSB apart; the first such row."""
    vnni, first = has_vnni(), None
    for row in sorted(rows.values(), key=lambda r: (r.order, r.tensor)):
        row.upstream = [u for u in ups.get(row.tensor, []) if u in rows]
        if row.max_lsb <= 1:
            continue
        bad = [u for u in row.upstream if rows[u].max_lsb > 1]
        if bad and not row.dropped:
            row.cause = f"inherits the divergence of {bad[0]}"
            continue
        row.cause = backend.cause(row.q_output)
        near = [rows[u] for u in row.upstream if rows[u].max_lsb == 1]
        if near:   # 1-LSB steps of the inputs, summed by a Conv or on a coarser grid, can exceed 1 LSB here
            worst = max(near, key=lambda u: u.share_off)
            ratio = max(u.scale for u in near) / row.scale
            row.cause += (f"; its input {worst.tensor} already differs by 1 LSB on {_pct(worst.share_off)} "
                          f"of its values" + (f" (on a {ratio:.1f}x coarser grid)" if ratio >= 1.5 else ""))
        if vnni is False and row.qtype == "uint8" and row.kernel.split(" ")[0] in INT_KERNELS:
            row.cause += "; u8s8 saturation possible (no VNNI on this CPU: int16 pair sums)"
        first = first or row
    return first


def table(result: dict) -> list[str]:
    """The comparison as text lines: one row per tensor, then the first divergence and the outputs."""
    head = ("tensor", "op", "provider kernel", "max LSB", ">1 LSB", "differ", "SNR sim", "SNR prov", "cause")
    cells = [head] + [(_short(r["tensor"]), r["producer"], r["kernel"], str(r["max_lsb"]),
                       _pct(r["share_over_1"]), _pct(r["share_off"]), _db(r["sim_snr"]),
                       _db(r["provider_snr"]), (r["cause"] or "") + (" [dropped as deployed]" if r["dropped"] else ""))
                      for r in result["tensors"]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head) - 1)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(widths))) + "  " + c[-1] for c in cells]
    lines = [line.rstrip() for line in lines]
    first = result["first_divergence"]
    lines.append(f"provider {result['provider']}, {result['samples']} samples, {len(result['tensors'])} quantized "
                 f"tensors read" + (f" ({len(result['unread'])} not readable)" if result["unread"] else ""))
    if first:
        lines.append(f"first tensor more than 1 LSB apart: {first['tensor']} ({first['producer']} -> "
                     f"{first['kernel']}), up to {first['max_lsb']} LSB, {first['over_1']} of {first['values']} "
                     f"values more than 1 LSB apart: {first['cause']}")
    else:
        lines.append("no tensor is more than 1 LSB apart from the simulation")
    for name, o in result["outputs"].items():
        lines.append(f"output {name}: SNR vs float {_db(o['sim_snr_db'])} simulated, {_db(o['provider_snr_db'])} "
                     f"on the provider ({_db(o['provider_read_snr_db'])} with the tensors read; "
                     f"max |difference| {o['read_vs_deployed_max_abs']:.3g})")
    return lines + localised(result.get("read_changes")) + [f"note: {n}" for n in result["notes"]]


def _db(value: float) -> str:
    return "inf" if value == math.inf else f"{value:.1f}"


def _pct(share: float) -> str:
    return "0" if share == 0 else f"{100 * share:.2g}%" if share < 1e-3 else f"{100 * share:.1f}%"


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3):]
