"""The report page: one self-contained HTML file (inline CSS, SVG and a few lines of script; no
network access)."""
from __future__ import annotations

import math
from html import escape

from ..evaluation.vs_ort import line as vs_ort_line
from . import svg

WORST = 6   # histograms for this many tensors with the lowest local SNR
CAP = 30    # rows a long table shows until its "show all" button is pressed

CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#202124;max-width:1200px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}
th{background:#f1f3f4;position:sticky;top:0}th.sort{cursor:pointer}td.n{text-align:right;font-variant-numeric:tabular-nums}
.plot{width:100%;height:auto;max-width:900px}.tick{font-size:12px;fill:#5f6368}.label{font-size:13px;fill:#202124}
.why{color:#5f6368;font-size:11px}.bad{color:#d93025}.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:8px}
.empty{color:#5f6368}code{font-size:12px;overflow-wrap:anywhere}td.name{min-width:16em;max-width:28em;overflow-wrap:anywhere}
table.capped tbody tr:nth-child(n+CAP1){display:none}button.all{margin:4px 0;font-size:12px}
"""

# click a column header to sort by it (numbers by value; again: the other way)
SCRIPT = """
document.querySelectorAll('table.sortable th.sort').forEach(function (th) {
  th.addEventListener('click', function () {
    var col = Array.prototype.indexOf.call(th.parentNode.children, th);
    var body = th.closest('table').tBodies[0];
    var down = th.dataset.dir !== 'down';
    th.dataset.dir = down ? 'down' : 'up';
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = a.cells[col].dataset.v, y = b.cells[col].dataset.v;
      var nx = parseFloat(x), ny = parseFloat(y);
      var c = (isNaN(nx) || isNaN(ny)) ? String(x).localeCompare(String(y)) : nx - ny;
      return down ? c : -c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
// long tables show their first rows (in the current sort order) until "show all" is pressed
document.querySelectorAll('table[data-cap]').forEach(function (table) {
  var cap = +table.dataset.cap, n = table.tBodies[0].rows.length;
  if (n <= cap) return;
  var button = document.createElement('button');
  button.type = 'button';
  button.className = 'all';
  var label = function () {
    button.textContent = table.classList.contains('capped') ? 'show all ' + n + ' rows (' + cap + ' shown)'
                                                            : 'show the first ' + cap + ' rows';
  };
  table.classList.add('capped');
  label();
  button.addEventListener('click', function () { table.classList.toggle('capped'); label(); });
  table.parentNode.insertBefore(button, table.nextSibling);
});
"""


def _db(value) -> str:
    if isinstance(value, str):
        return value
    if value is None or math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.2f}"


def _sortkey(value) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "1e9" if value > 0 else "-1e9"
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def _short(values, n: int = 3) -> str:
    values = list(values or [])
    text = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in values[:n])
    return text + (f", ... ({len(values)})" if len(values) > n else "")


def _confirmation(confirmed) -> str:
    """search-precision's confirmation on the calibration feeds after the checked ones, in words."""
    if not confirmed:
        return ""
    if "skipped" in confirmed:
        return f", not confirmed ({escape(confirmed['skipped'])})"
    added = f" ({confirmed['added']} of them then added to the checks)" if confirmed["added"] else ""
    read = (f"{escape(str(confirmed['score']))}, " if "score" in confirmed else "")
    verdict = {True: "met", False: "missed", None: "no evaluation left to read it again"}[confirmed["met"]]
    return f", confirmed on {confirmed['feeds']} calibration feeds{added}: {read}{verdict}"


def _table(headers: list[str], rows: list[list], *, sortable: bool = False, numeric=(), names=(0,),
           cap: int | None = None) -> str:
    """A table; columns ``numeric`` right-aligned, ``names`` (tensor names) wrapped anywhere; with
    ``cap``, the page's script shows that many rows until "show all" is pressed (without
    scripts, every row shows)."""
    head = "".join(f'<th class="sort">{escape(h)}</th>' if sortable else f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            shown, key = cell if isinstance(cell, tuple) else (cell, cell)
            cls = ' class="n"' if i in numeric else ' class="name"' if i in names else ""
            cells.append(f'<td{cls} data-v="{escape(_sortkey(key))}">{shown if isinstance(cell, tuple) else escape(str(shown))}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    cls = (' class="sortable"' if sortable else "") + (f' data-cap="{cap}"' if cap and len(rows) > cap else "")
    return f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _summary(info: dict) -> list[str]:
    acc = info["accuracy"]
    out = ["<h2>Summary</h2>"]
    if info.get("headline"):   # the objective (the worst output component) first
        out.append(f'<p class="headline"><b>{escape(info["headline"])}</b>{escape(info.get("spread", ""))}</p>')
    out.append(f"<p>{escape(info['summary'])}</p>")
    out.append(f"<p>Measured on {acc['samples']} samples of <code>{escape(info['data'])}</code>; "
               f"the per-layer numbers on the first {info['layer_samples']}.</p>")
    rows = [[name, (_db(r["snr_db"]), r["snr_db"]), f"{r['max_abs_error']:.4g}"] for name, r in acc["outputs"].items()]
    out.append(_table(["output", "SNR (dB)", "max abs error"], rows, numeric=(1, 2)))
    objective = info.get("objective")
    if objective:
        metric = objective.get("metric", "snr")
        comps = [[name, f"{value:.4g}", objective.get("slices", {}).get(name, "")]
                 for name, value in objective.get("components", {}).items()]
        overall = objective.get("overall", math.nan)
        out.append(f"<p>Objective ({escape(str(metric))}, worst component): <b>{overall:.4g}</b></p>")
        out.append(_table(["component", str(metric), "where"], comps, numeric=(1,)))
    versus = info.get("vs_onnxruntime")
    out.append(f"<p class=\"headline\">Speed and size {escape(vs_ort_line(versus))}.</p>" if versus else
               "<p>Speed and size against onnxruntime's own QDQ model: not measured here "
               "(<code>qpasses run ... --html --vs-onnxruntime</code> measures them).</p>")
    passes = info.get("passes")
    if passes:
        total = sum(p["seconds"] for p in passes) or 1.0
        rows = [[p["pass"], (f"{p['seconds']:.3f}", p["seconds"]), f"{100 * p['seconds'] / total:.1f}",
                 "yes" if p["modified"] else "no", ", ".join(f"{k}={v}" for k, v in p["stats"].items())] for p in passes]
        out += ["<h3>Time per pass</h3>", _table(["pass", "seconds", "%", "modified", "stats"], rows, numeric=(1, 2))]
    else:
        out.append("<p>Time per pass: not recorded here (<code>qpasses run ... --html</code> records it).</p>")
    search = info.get("decisions", {}).get("precision_search")
    if search:
        promoted = search.get("promoted", [])
        left = f", {100 * search['int8_share']:.0f} % left" if "int8_share" in search else ""
        share = (f" with {100 * search['keep_8bit']:.0f} % of the weighted ops' int8 latency gain 8-bit"
                 if "keep_8bit" in search else "")   # absent when the aim was not chased
        aim = (f" (aim {escape(str(search['aim']))}{share}{left}, {'met' if search.get('aim_met') else 'not met'}: "
               f"{escape(str(search.get('aimed')))})" if "aimed" in search else "")
        out.append(f"<p>search-precision: target {escape(str(search.get('target')))} {escape(str(search.get('metric')))}{aim}, "
                   f"quantized {escape(str(search.get('quantized')))}, reached {escape(str(search.get('reached')))} "
                   f"on {escape(str(search.get('feeds')))} check feeds{_confirmation(search.get('confirmed'))}; "
                   f"{len(promoted)} tensors promoted to {escape(str(search.get('fallback')))}"
                   + (": " + escape(", ".join(promoted)) if promoted else "")
                   + ("; target missed, next in the ranking: " + escape(", ".join(search["blocking"]))
                      if search.get("blocking") else "") + "</p>")
    floats = info.get("floats", {})
    rows = [[name, row.get("pass", ""), row.get("reason", "")] for name, row in floats.items()]
    constants = info.get("floats_recorded", len(rows)) - len(rows)
    also = (f" (and {constants} constant{'s' if constants > 1 else ''}: weights, biases, shapes, parameters)"
            if constants > 0 else "")
    out.append(f"<details><summary>{len(rows)} tensors left float, and why{also}</summary>"
               f"{_table(['tensor', 'pass', 'reason'], rows, sortable=True, cap=CAP)}</details>")
    return out


def _pair_sums(view: dict) -> list[str]:
    """The target's view: which layers' int16 pair sums saturate on which CPU (analysis.saturation)."""
    record = view.get("record") or {}
    fixed = record.get("layers", {}) if record.get("protected") else {}
    out = ["<h2>int16 pair sums by CPU</h2>",
           f"<p>onnxruntime's uint8 x int8 kernels on x86-64 CPUs without VNNI (AVX2, AVX-512 without VNNI) sum "
           f"products in pairs in int16, which saturates when both weights of a pair are large and of one sign; "
           f"with VNNI and on ARM64 the sums are int32. {view['checked']} layers run such kernels"
           + (f"; the model was quantized for cpu <code>{escape(str(record['cpu']))}</code>" if record else "") + ".</p>"]
    now = {r.node: r for r in view["risks"]}
    by_node = {row["node"]: row for row in fixed.values()}
    nodes = list(dict.fromkeys(list(by_node) + list(now)))
    if not nodes:
        return out + ['<p class="empty">No layer can saturate on any CPU.</p>']
    rows = []
    for node in nodes:
        risk, fix = now.get(node), by_node.get(node)
        x86 = f"saturates: {len(risk.channels)} of {risk.of} output channels ({risk.pairs} weight pairs)" if risk else "safe"
        how = ""
        if fix:
            words = {"uint8": "weights stored as uint8 (uint8 x uint8 kernel)", "int8": "left int8",
                     "grid": f"int8 grid no pair can saturate on (scale x{fix.get('widened', 1):.3g} at most)"}
            how = words.get(fix.get("fix"), escape(str(fix.get("fix")))) + (f": {escape(fix['why'])}" if fix.get("why") else "")
        rows.append([node, risk.op if risk else fix["op"], x86, "safe", "safe", how])
    return out + [_table(["layer", "op", "x86-64 without VNNI", "x86-64 with VNNI", "ARM64", "protect-pair-sums"],
                         rows, sortable=True, cap=CAP)]


def _layer_table(layers) -> list[str]:
    rows = []
    for r in layers:
        why = "<br>".join(f'<span class="why">{escape(w)}</span>' for w in r.why)
        rows.append([r.tensor, r.producer, r.qtype, (escape(_short(r.scale)), r.scale[0]),
                     (escape(_short(r.zero_point)), r.zero_point[0]),
                     (_db(r.local_snr), r.local_snr), (_db(r.accumulated_snr), r.accumulated_snr),
                     (_db(r.sensitivity), r.sensitivity), (why, len(r.why)), r.order])
    return ["<h2>Per-layer table</h2>",
            "<p>Quantized activations of the main graph. Local SNR: the float tensor against its own grid; "
            "accumulated SNR: against what the QDQ model's readers see (every quantized tensor before it "
            "counts); sensitivity: RMS error of its grid relative to its typical value (dB, higher is worse; "
            "search-precision ranks by it). Click a header to sort (all rows; long tables then show the first "
            f"{CAP}).</p>",
            _table(["tensor", "producer", "type", "scale", "zero point", "local SNR (dB)", "accumulated SNR (dB)",
                    "sensitivity (dB)", "why", "order"], rows, sortable=True, numeric=(3, 4, 5, 6, 7, 9), cap=CAP)]


def _growth(layers) -> list[str]:
    """The accumulated-SNR plot and the tensors where it drops most."""
    acc = [(r.order, r.accumulated_snr, f"{r.tensor} ({r.producer}): {_db(r.accumulated_snr)} dB") for r in layers]
    loc = [(r.order, r.local_snr, f"{r.tensor} ({r.producer}): local {_db(r.local_snr)} dB") for r in layers]
    plot = svg.line_plot({"accumulated SNR": acc, "local SNR": loc}, title="SNR along the graph",
                         xlabel="node index in the QDQ graph (topological order)", ylabel="SNR (dB)",
                         colors={"accumulated SNR": "#d93025", "local SNR": "#1a73e8"})
    by_name = {r.tensor: r for r in layers if math.isfinite(r.accumulated_snr)}
    drops = []   # along the data flow: from the worst quantized input of a tensor's producer to it
    for b in by_name.values():
        inputs = [by_name[u] for u in b.upstream if u in by_name]
        if inputs:
            a = min(inputs, key=lambda r: r.accumulated_snr)
            drops.append((a.accumulated_snr - b.accumulated_snr, a, b))
    drops.sort(key=lambda d: -d[0])
    items = "".join(f"<li><code>{escape(b.tensor)}</code> ({escape(b.producer)}): -{d:.1f} dB to {_db(b.accumulated_snr)} dB "
                    f"from <code>{escape(a.tensor)}</code> (local {_db(b.local_snr)} dB)</li>" for d, a, b in drops[:5] if d > 0)
    return ["<h2>Where the error grows</h2>", plot,
            "<p>Largest drops of the accumulated SNR from a tensor's quantized inputs (the worst of them, "
            f"through float ops) to it:</p><ol>{items}</ol>"]


def _histograms(layers) -> list[str]:
    worst = sorted((r for r in layers if r.counts and math.isfinite(r.local_snr)), key=lambda r: r.local_snr)[:WORST]
    plots = []
    for r in worst:
        marks = {"clip min": r.clip[0], "clip max": r.clip[1]}
        if r.calibrated:
            marks |= {"calibrated min": r.calibrated[0], "calibrated max": r.calibrated[1]}
        plots.append(f"<div><p><code>{escape(r.tensor)}</code> ({escape(r.producer)}, {escape(r.qtype)}): local "
                     f"{_db(r.local_snr)} dB</p>{svg.histogram(r.counts, r.edges, title=r.tensor, marks=marks)}</div>")
    return ["<h2>Value histograms of the worst tensors</h2>",
            "<p>Lowest local SNR first; red dashes: the grid's clip range, green: the calibrated range.</p>",
            f'<div class="grid">{"".join(plots)}</div>']


def page(info: dict, layers, cells) -> str:
    """The whole report: ``info`` (summary numbers), the per-layer rows, the precision map cells."""
    body = [f"<h1>qpasses report: {escape(info['model'])}</h1>",
            f"<p>float model <code>{escape(info['float'])}</code>, quantized model <code>{escape(info['quantized'])}</code></p>"]
    body += _summary(info)
    body += _pair_sums(info["pair_sums"]) if "pair_sums" in info else []
    body += _growth(layers) if layers else ["<p>No quantized activation to compare per layer.</p>"]
    body += _histograms(layers) if layers else []
    counts = {}
    for _, p in cells:
        counts[p] = counts.get(p, 0) + 1
    body += ["<h2>Mixed-precision map</h2>",
             "<p>Every compute node in graph order, coloured by the type it reads through DequantizeLinear "
             "(weighted ops: their weight's): " + escape(", ".join(f"{k} {v}" for k, v in sorted(counts.items()))) + ".</p>",
             svg.precision_map(cells, title="precision per node")]
    body += _layer_table(layers)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>qpasses report: {escape(info['model'])}</title><style>{CSS.replace('CAP1', str(CAP + 1))}</style>"
            "</head><body>"
            + "\n".join(body) + f"<script>{SCRIPT}</script></body></html>\n")
