"""Line charts as inline SVG, drawn on the server: no chart library and no front-end build.
Every text that goes into the SVG is escaped."""

from __future__ import annotations

import time
from html import escape

from markupsafe import Markup

Point = tuple[float, float | None]  # a None value breaks the line (no samples there)

PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
MAX_SERIES = 11  # "total" and ten partitions; more would be unreadable


def _number(value: float) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 100 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.1f}"


def _segments(points: list[Point]) -> list[list[tuple[float, float]]]:
    """The runs of points between breaks (None values)."""
    runs: list[list[tuple[float, float]]] = [[]]
    for t, v in points:
        if v is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((t, v))
    return [run for run in runs if run]


def _drawn(points: list[Point]) -> int:
    return sum(1 for _, v in points if v is not None)


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def line_chart(
    series: dict[str, list[Point]],
    *,
    title: str,
    unit: str,
    width: int = 640,
    height: int = 180,
) -> Markup:
    """One SVG with a line per series (the first drawn thicker), a y axis from 0 to the max,
    the time span on the x axis, and a legend. A None value breaks a line: time without
    samples is never bridged. Fewer than two points: a note instead."""
    shown = {name: pts for name, pts in list(series.items())[:MAX_SERIES] if _drawn(pts) >= 2}
    label = escape(title)
    if not shown:
        return Markup(
            f'<div class="chart-empty" role="img" aria-label="{label}">{label}: collecting '
            "samples…</div>"
        )
    left, right, top, bottom = 48, 10, 18, 22
    xs = [t for pts in shown.values() for t, _ in pts]
    ys = [v for pts in shown.values() for _, v in pts if v is not None]
    x0, x1 = min(xs), max(xs)
    y1 = max(max(ys), 1.0)
    span_x = max(x1 - x0, 1e-9)
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(t: float) -> float:
        return left + (t - x0) / span_x * plot_w

    def py(v: float) -> float:
        return top + plot_h - v / y1 * plot_h

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{label}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="{left}" y="12" class="chart-title">{label} ({escape(unit)})</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}" '
        'class="axis"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" class="axis"/>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end" class="tick">{_number(y1)}</text>',
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end" class="tick">0</text>',
        f'<text x="{left}" y="{height - 6}" class="tick">{_clock(x0)}</text>',
        f'<text x="{width - right}" y="{height - 6}" text-anchor="end" class="tick">'
        f"{_clock(x1)}</text>",
    ]
    legend_x = left + 7 * (len(title) + len(unit)) + 40
    for i, (name, pts) in enumerate(shown.items()):
        color = PALETTE[i % len(PALETTE)]
        stroke = 2.5 if i == 0 else 1.2
        last = [v for _, v in pts if v is not None][-1]
        tip = f"<title>{escape(name)}: {_number(last)}</title>"
        for run in _segments(pts):
            if len(run) == 1:  # a lone sample between breaks: a dot
                ((t, v),) = run
                parts.append(
                    f'<circle cx="{px(t):.1f}" cy="{py(v):.1f}" r="{stroke}" fill="{color}">'
                    f"{tip}</circle>"
                )
                continue
            path = " ".join(f"{px(t):.1f},{py(v):.1f}" for t, v in run)
            parts.append(
                f'<polyline fill="none" stroke="{color}" stroke-width="{stroke}" '
                f'points="{path}">{tip}</polyline>'
            )
        parts.append(
            f'<text x="{legend_x}" y="12" fill="{color}" class="legend">{escape(name)}</text>'
        )
        legend_x += 8 * len(name) + 14
    parts.append("</svg>")
    return Markup("".join(parts))


def sparkline(
    points: list[Point], *, width: int = 120, height: int = 24, label: str = ""
) -> Markup:
    """A small line without axes, for tables (broken where samples are missing)."""
    if _drawn(points) < 2:
        return Markup('<span class="muted">…</span>')
    xs = [t for t, _ in points]
    top = max(max(v for _, v in points if v is not None), 1.0)
    span = max(xs[-1] - xs[0], 1e-9)
    lines = []
    for run in _segments(points):
        path = " ".join(
            f"{(t - xs[0]) / span * (width - 2) + 1:.1f},{height - 1 - v / top * (height - 2):.1f}"
            for t, v in run
        )
        lines.append(f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{path}"/>')
    return Markup(
        f'<svg class="spark" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(label)}">{"".join(lines)}</svg>'
    )
