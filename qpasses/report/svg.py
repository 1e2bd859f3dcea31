"""Small hand-written SVG plots for the HTML report (no plotting dependency: three chart kinds,
a few hundred points each, are less code than a library's set-up and keep the file self-contained)."""
from __future__ import annotations

import math
from html import escape

W, H = 720, 260            # the plot's size in user units (the page scales it to its width)
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 16, 40
COLORS = {"float": "#9aa0a6", "uint8": "#1a73e8", "int8": "#174ea6", "uint16": "#e37400",
          "int16": "#e37400", "uint4": "#a142f4", "int4": "#a142f4"}


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _num(v: float) -> str:
    return f"{v:.4g}"


class _Frame:
    """Maps data coordinates to the plot area and draws the axes."""

    def __init__(self, x0, x1, y0, y1, title: str, xlabel: str, ylabel: str):
        self.x0, self.x1 = x0, x1 if x1 > x0 else x0 + 1
        self.y0, self.y1 = y0, y1 if y1 > y0 else y0 + 1
        self.parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" role="img" '
                      f'class="plot"><title>{escape(title)}</title>',
                      f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{H - TOP - BOTTOM}" '
                      f'fill="#fff" stroke="#ccc"/>']
        for t in _ticks(self.y0, self.y1):
            y = self.y(t)
            self.parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                              f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end" class="tick">{_num(t)}</text>')
        for t in _ticks(self.x0, self.x1, 8):
            x = self.x(t)
            self.parts.append(f'<text x="{x:.1f}" y="{H - BOTTOM + 14}" text-anchor="middle" class="tick">{_num(t)}</text>')
        self.parts.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 6}" text-anchor="middle" class="label">'
                          f'{escape(xlabel)}</text><text x="12" y="{(TOP + H - BOTTOM) / 2}" class="label" '
                          f'transform="rotate(-90 12 {(TOP + H - BOTTOM) / 2})" text-anchor="middle">{escape(ylabel)}</text>')

    def x(self, v: float) -> float:
        return LEFT + (v - self.x0) / (self.x1 - self.x0) * (W - LEFT - RIGHT)

    def y(self, v: float) -> float:
        v = min(max(v, self.y0), self.y1)
        return H - BOTTOM - (v - self.y0) / (self.y1 - self.y0) * (H - TOP - BOTTOM)

    def done(self) -> str:
        return "".join(self.parts) + "</svg>"


def line_plot(series: dict[str, list[tuple[float, float, str]]], *, title: str, xlabel: str, ylabel: str,
              colors: dict[str, str] | None = None, cap: float = 80.0) -> str:
    """Lines of (x, y, tooltip) points per series name; y values above ``cap`` are drawn at it."""
    ys = _finite(min(p[1], cap) for pts in series.values() for p in pts)
    xs = _finite(p[0] for pts in series.values() for p in pts)
    if not ys:
        return f'<p class="empty">{escape(title)}: no finite values</p>'
    frame = _Frame(min(xs), max(xs), math.floor(min(ys) / 5) * 5, math.ceil(max(ys) / 5) * 5, title, xlabel, ylabel)
    palette = colors or {}
    for k, (name, points) in enumerate(series.items()):
        color = palette.get(name, ("#1a73e8", "#d93025", "#188038")[k % 3])
        pts = [(frame.x(x), frame.y(min(y, cap)), tip) for x, y, tip in points if y is not None and math.isfinite(min(y, cap))]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in pts)
        frame.parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        frame.parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"><title>{escape(tip)}</title></circle>'
                        for x, y, tip in pts]
        frame.parts.append(f'<text x="{W - RIGHT - 4}" y="{TOP + 14 + 14 * k}" text-anchor="end" '
                           f'class="label" style="fill:{color}">{escape(name)}</text>')
    return frame.done()


def histogram(counts: list[int], edges: list[float], *, title: str, marks: dict[str, float]) -> str:
    """Bars of ``counts`` between ``edges`` (log-scaled counts), with vertical lines at ``marks``."""
    if not counts or not edges:
        return f'<p class="empty">{escape(title)}: no values</p>'
    heights = [math.log10(c + 1) for c in counts]
    frame = _Frame(edges[0], edges[-1], 0, max(max(heights), 1), title, "value", "log10(count + 1)")
    for c, h, a, b in zip(counts, heights, edges, edges[1:]):
        x0, x1, y = frame.x(a), frame.x(b), frame.y(h)
        frame.parts.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0 - 0.5, 0.5):.1f}" '
                           f'height="{H - BOTTOM - y:.1f}" fill="#8ab4f8"><title>{_num(a)} .. {_num(b)}: {c}</title></rect>')
    for k, (name, value) in enumerate(marks.items()):
        if value is None or not math.isfinite(value):
            continue
        x = frame.x(min(max(value, edges[0]), edges[-1]))
        color = "#d93025" if "clip" in name else "#188038"
        frame.parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{H - BOTTOM}" stroke="{color}" '
                           f'stroke-dasharray="4 3"><title>{escape(name)} {_num(value)}</title></line>')
    return frame.done()


def precision_map(cells: list[tuple[str, str]], *, title: str, per_row: int = 60) -> str:
    """One square per (label, precision) in order, coloured by precision, ``per_row`` to a row."""
    size = (W - 20) / per_row
    rows = max(1, math.ceil(len(cells) / per_row))
    height = rows * size + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {height:.0f}" role="img" class="plot">'
             f'<title>{escape(title)}</title>']
    for i, (label, precision) in enumerate(cells):
        x, y = 10 + (i % per_row) * size, 4 + (i // per_row) * size
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{size - 1:.1f}" height="{size - 1:.1f}" '
                     f'fill="{COLORS.get(precision, "#5f6368")}"><title>{escape(label)}: {escape(precision)}</title></rect>')
    x = 10
    for precision in sorted({p for _, p in cells}):
        parts.append(f'<rect x="{x}" y="{height - 18:.0f}" width="10" height="10" fill="{COLORS.get(precision, "#5f6368")}"/>'
                     f'<text x="{x + 14}" y="{height - 9:.0f}" class="label">{escape(precision)}</text>')
        x += 90
    return "".join(parts) + "</svg>"
