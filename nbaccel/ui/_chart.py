"""Line charts as a small inline SVG: one panel per metric, step on the x axis.

Why SVG by hand and not matplotlib: the live view redraws about once a second while
the workers train on the same cores, and a matplotlib figure costs tens of
milliseconds to render (bench/README.md, "monitor" row), this a few; the same string
is the live widget's content and, when the run ends, the static ``image/svg+xml``
output that saved notebooks, nbviewer and GitHub show; and it needs no package a
notebook may lack.

Lines: ``"ranks"`` draws one line per rank; ``"mean"`` draws the ranks' mean and a
band from their minimum to their maximum at each step (for many ranks); ``"auto"``
picks ``"ranks"`` up to :data:`MAX_RANK_LINES` ranks.

Example:
    >>> svg = render_svg({"loss": {0: [(0, 1.0), (1, 0.5)], 1: [(0, 1.1), (1, 0.6)]}})
    >>> svg.startswith("<svg") and svg.count("<polyline") == 2
    True
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

PANEL_W, PANEL_H = 320, 180
LEFT, RIGHT, TOP, BOTTOM = 60, 10, 22, 26
LEGEND_H = 20
TITLE_H = 16
TITLE_CHAR_W = 7.7  # px per character of the bold 11 px title (0.7 em), at most
MAX_RANK_LINES = 8
MAX_POINTS = 2 * PANEL_W  # drawn per line; more would not show at this width
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip

Points = list[tuple[float, float]]


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def _thin(points: Points) -> Points:
    """At most :data:`MAX_POINTS`, evenly spaced, always keeping the last one."""
    if len(points) <= MAX_POINTS:
        return points
    step = len(points) / (MAX_POINTS - 1)
    return [points[int(i * step)] for i in range(MAX_POINTS - 1)] + [points[-1]]


def _mean_band(ranks: dict[int, Points]) -> tuple[Points, Points, Points]:
    """Per step: the ranks' mean, minimum and maximum (over the ranks that logged it)."""
    by_step: dict[float, list[float]] = {}
    for points in ranks.values():
        for x, y in points:
            by_step.setdefault(x, []).append(y)
    steps = sorted(by_step)
    mean = [(x, sum(by_step[x]) / len(by_step[x])) for x in steps]
    low = [(x, min(by_step[x])) for x in steps]
    high = [(x, max(by_step[x])) for x in steps]
    return mean, low, high


def _panel(name: str, ranks: dict[int, Points], mode: str, ox: int, oy: int) -> str:
    # NaN/inf (a diverging loss) are marked in red at the top (bottom: -inf) and named in
    # the title from their first step, never dropped; the lines and scale use the rest
    bad = sorted((x, r, y) for r, p in ranks.items() for x, y in p if not math.isfinite(y))
    lines = {r: _thin([pt for pt in p if math.isfinite(pt[1])]) for r, p in ranks.items()}
    lines = {r: p for r, p in lines.items() if p}
    everything = [pt for pts in lines.values() for pt in pts]
    title = f"{name} ({bad[0][2]} at step {_fmt(bad[0][0])}, rank {bad[0][1]})" if bad else name
    parts = [
        f'<g class="nbaccel-chart" data-metric="{escape(name, {chr(34): "&quot;"})}" '
        f'transform="translate({ox},{oy})">',
        f'<rect x="0.5" y="0.5" width="{PANEL_W - 1}" height="{PANEL_H - 1}" fill="#fff" '
        'stroke="#ddd"/>',
        f'<text x="{LEFT}" y="15" font-weight="bold">{escape(title)}</text>',
    ]
    if not everything and not bad:
        return "".join(parts) + "</g>"
    steps = [p[0] for p in everything] + [x for x, _, _ in bad]
    x0, x1 = min(steps), max(steps)
    y0, y1 = (
        min((p[1] for p in everything), default=0.0),
        max((p[1] for p in everything), default=1.0),
    )
    if x1 == x0:
        x1 = x0 + 1
    span = max(abs(y0), abs(y1)) * 0.02 or 0.1  # a 0.3 % change must not fill the chart
    if y1 - y0 < span:
        middle = (y0 + y1) / 2
        y0, y1 = middle - span / 2, middle + span / 2
    width, height = PANEL_W - LEFT - RIGHT, PANEL_H - TOP - BOTTOM

    def xy(x: float, y: float) -> str:
        return (
            f"{LEFT + (x - x0) / (x1 - x0) * width:.1f},{TOP + (y1 - y) / (y1 - y0) * height:.1f}"
        )

    bottom = TOP + height
    parts += [
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}" stroke="#999"/>',
        f'<line x1="{LEFT}" y1="{bottom}" x2="{LEFT + width}" y2="{bottom}" stroke="#999"/>',
        f'<text x="{LEFT - 4}" y="{TOP + 4}" text-anchor="end">{_fmt(y1)}</text>',
        f'<text x="{LEFT - 4}" y="{bottom}" text-anchor="end">{_fmt(y0)}</text>',
        f'<text x="{LEFT}" y="{bottom + 15}">{_fmt(x0)}</text>',
        f'<text x="{LEFT + width}" y="{bottom + 15}" text-anchor="end">step {_fmt(x1)}</text>',
    ]
    for x, rank, y in bad[:: max(1, len(bad) // MAX_POINTS)]:
        at = xy(x, y0 if y < 0 else y1).split(",")
        parts.append(f'<text class="nbaccel-nonfinite" data-rank="{rank}" x="{at[0]}" '
                     f'y="{at[1]}" fill="#d62728" text-anchor="middle">×</text>')  # fmt: skip
    if mode == "mean" and lines:
        mean, low, high = _mean_band(lines)
        band = " ".join(xy(x, y) for x, y in low + high[::-1])
        parts.append(f'<polygon class="nbaccel-band" points="{band}" fill="{COLORS[0]}" '
                     'fill-opacity="0.2" stroke="none"/>')  # fmt: skip
        path = " ".join(xy(x, y) for x, y in mean)
        parts.append(f'<polyline data-rank="mean" points="{path}" fill="none" '
                     f'stroke="{COLORS[0]}" stroke-width="1.5"/>')  # fmt: skip
    else:
        for rank, points in sorted(lines.items()):
            path = " ".join(xy(x, y) for x, y in points)
            color = COLORS[rank % len(COLORS)]
            parts.append(f'<polyline data-rank="{rank}" points="{path}" fill="none" '
                         f'stroke="{color}" stroke-width="1.5"/>')  # fmt: skip
    return "".join(parts) + "</g>"


def _legend(ranks: list[int], mode: str) -> str:
    if mode == "mean":
        items = [(COLORS[0], "mean"), (COLORS[0] + "55", f"min-max of {len(ranks)} ranks")]
    else:
        items = [(COLORS[r % len(COLORS)], f"rank {r}") for r in ranks]
    parts, x = [], 8
    for color, label in items:
        parts.append(f'<rect x="{x}" y="6" width="14" height="4" fill="{color}"/>')
        parts.append(f'<text x="{x + 18}" y="13">{escape(label)}</text>')
        x += 26 + 7 * len(label)
    return "".join(parts)


def render_svg(
    data: dict[str, dict[int, Points]], *, lines: str = "auto", columns: int = 3, title: str = ""
) -> str:
    """One SVG with a panel per metric of ``data`` (``{metric: {rank: [(step, value)]}}``).

    Args:
        data: the points (see :meth:`nbaccel.ui._history.History.data`).
        lines: ``"ranks"``, ``"mean"`` or ``"auto"`` (see the module docstring).
        columns: panels per row.
        title: written at the right of the legend line (which run these charts are).
    """
    if lines not in ("auto", "ranks", "mean"):
        raise ValueError(f"lines={lines!r}: choose 'auto', 'ranks' or 'mean'.")
    ranks = sorted({r for per_rank in data.values() for r in per_rank})
    mode = lines if lines != "auto" else ("ranks" if len(ranks) <= MAX_RANK_LINES else "mean")
    names = list(data)
    cols = max(1, min(columns, len(names) or 1))
    rows = -(-len(names) // cols) if names else 0
    top = TITLE_H if title else 0  # the title has a line of its own, above the legend
    # a bold 11 px character is up to 0.7 em wide (DejaVu Sans, the usual Linux face): at
    # 6 px a character, "..., finished" was cut off at the image's edge
    width = max(cols * PANEL_W, 16 + math.ceil(TITLE_CHAR_W * len(title)))
    height = top + LEGEND_H + rows * PANEL_H
    panels = [
        _panel(name, data[name], mode, (i % cols) * PANEL_W, LEGEND_H + (i // cols) * PANEL_H)
        for i, name in enumerate(names)
    ]
    heading = (
        f'<text class="nbaccel-title" x="8" y="13" font-weight="bold">{escape(title)}</text>'
        if title
        else ""
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="nbaccel-charts" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" '
        f'font-size="11" fill="#333">{heading}<g transform="translate(0,{top})">'
        f"{_legend(ranks, mode)}{''.join(panels)}</g></svg>"
    )


__all__ = ["MAX_RANK_LINES", "render_svg"]
