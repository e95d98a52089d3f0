"""Inline SVG charts (line chart, grouped horizontal bar chart) drawn in Python: no script, works offline.

Every chart is an <svg class="chart"> with a <title>; each data line is a <polyline class="series"> and each
bar a <rect class="bar">, both with a <title> tooltip, so tests (and people) can find them in the DOM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

# Okabe-Ito: distinguishable with the common colour-vision deficiencies.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#F0E442")
WIDTH, HEIGHT = 580, 320
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 70, 20, 40, 80


@dataclass(frozen=True)
class Series:
    """One line of a line chart."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str
    dashed: bool = False


def nice_ticks(high: float, count: int = 5) -> list[float]:
    """0 and round steps (1, 2, 2.5, 5 x 10^k) up to at least `high`."""
    if not high > 0 or not math.isfinite(high):
        return [0.0, 1.0]
    raw = high / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(math.ceil(high / step - 1e-9)) + 1)]


def _frame(title: str, body: list[str], width: int = WIDTH, height: int = HEIGHT) -> str:
    return (f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img"><title>{escape(title)}</title>'
            f'<text class="chart-title" x="{width / 2}" y="22" text-anchor="middle">{escape(title)}</text>'
            + "".join(body) + "</svg>")


def empty_chart(title: str, message: str) -> str:
    """A chart frame that says why there is nothing to draw."""
    return _frame(title, [f'<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">'
                          f"{escape(message)}</text>"])


@dataclass(frozen=True)
class Band:
    """A shaded stretch of the x axis (e.g. a run's start-up), labelled at its top."""

    x0: float
    x1: float
    label: str
    color: str


def line_chart(title: str, series: list[Series], x_label: str, y_label: str,
               x_fmt: Callable[[float], str], y_fmt: Callable[[float], str],
               x_max: float | None = None, y_max: float | None = None, bands: Sequence[Band] = ()) -> str:
    """Lines over shared linear axes from 0; values beyond x_max / y_max are clamped to the edge; `bands`
    are shaded behind the lines."""
    drawn = [s for s in series if len(s.xs) > 0]
    if not drawn:
        return empty_chart(title, "no data")
    x_ticks = nice_ticks(x_max or max(max(s.xs) for s in drawn))
    y_ticks = nice_ticks(y_max or max(max(s.ys) for s in drawn))
    plot = _Plot(x_ticks[-1], y_ticks[-1])
    body = [plot.band(b, i) for i, b in enumerate(bands)]
    body += plot.axes(x_ticks, y_ticks, x_fmt, y_fmt, x_label, y_label)
    body += [plot.polyline(s) for s in drawn]
    body += legend([(s.label, s.color, s.dashed) for s in drawn])
    return _frame(title, body)


class _Plot:
    """Maps data coordinates to the plot area of a WIDTH x HEIGHT chart."""

    def __init__(self, x_high: float, y_high: float) -> None:
        self.x_high, self.y_high = x_high or 1.0, y_high or 1.0
        self.left, self.right = MARGIN_LEFT, WIDTH - MARGIN_RIGHT
        self.top, self.bottom = MARGIN_TOP, HEIGHT - MARGIN_BOTTOM

    def x(self, value: float) -> float:
        """Pixel x of a data value (clamped to the plot)."""
        share = min(max(value / self.x_high, 0.0), 1.0)
        return round(self.left + share * (self.right - self.left), 2)

    def y(self, value: float) -> float:
        """Pixel y of a data value (clamped to the plot)."""
        share = min(max(value / self.y_high, 0.0), 1.0)
        return round(self.bottom - share * (self.bottom - self.top), 2)

    def axes(self, x_ticks: list[float], y_ticks: list[float], x_fmt: Callable[[float], str],
             y_fmt: Callable[[float], str], x_label: str, y_label: str) -> list[str]:
        """Grid lines, tick labels, frame and axis titles."""
        parts = []
        for tick in y_ticks:
            y = self.y(tick)
            parts.append(f'<line class="grid" x1="{self.left}" y1="{y}" x2="{self.right}" y2="{y}"/>'
                         f'<text class="tick" x="{self.left - 6}" y="{y + 4}" text-anchor="end">'
                         f"{escape(y_fmt(tick))}</text>")
        for tick in x_ticks:
            x = self.x(tick)
            parts.append(f'<line class="grid" x1="{x}" y1="{self.top}" x2="{x}" y2="{self.bottom}"/>'
                         f'<text class="tick" x="{x}" y="{self.bottom + 16}" text-anchor="middle">'
                         f"{escape(x_fmt(tick))}</text>")
        parts.append(f'<rect class="plot-frame" x="{self.left}" y="{self.top}" '
                     f'width="{self.right - self.left}" height="{self.bottom - self.top}"/>')
        parts.append(f'<text class="axis-label" x="{(self.left + self.right) / 2}" y="{self.bottom + 34}" '
                     f'text-anchor="middle">{escape(x_label)}</text>')
        mid = (self.top + self.bottom) / 2
        if y_label:
            parts.append(f'<text class="axis-label" transform="translate(16 {mid}) rotate(-90)" '
                         f'text-anchor="middle">{escape(y_label)}</text>')
        return parts

    def band(self, band: Band, index: int = 0) -> str:
        """A translucent rectangle over [x0, x1] with its label inside the top edge."""
        x0, x1 = self.x(band.x0), self.x(band.x1)
        return (f'<g class="band"><rect x="{x0}" y="{self.top}" width="{max(x1 - x0, 1.0):.2f}" '
                f'height="{self.bottom - self.top}" fill="{band.color}" fill-opacity="0.13"/>'
                f'<text class="band-label" x="{x0 + 4}" y="{self.top + 14 + 13 * index}">{escape(band.label)}</text>'
                f"<title>{escape(band.label)}</title></g>")

    def polyline(self, series: Series) -> str:
        """One series as a polyline with a tooltip."""
        points = " ".join(f"{self.x(x)},{self.y(y)}" for x, y in zip(series.xs, series.ys, strict=True))
        dash = ' stroke-dasharray="6 4"' if series.dashed else ""
        return (f'<polyline class="series" fill="none" stroke="{series.color}" stroke-width="2"{dash} '
                f'points="{points}"><title>{escape(series.label)}</title></polyline>')


def legend(entries: list[tuple[str, str, bool]], y: float = HEIGHT - 30) -> list[str]:
    """Swatches and labels under the plot, wrapping onto a new row 16 px lower when a row is full."""
    parts = []
    x = MARGIN_LEFT
    for label, color, dashed in entries:
        text = label if len(label) <= 34 else label[:31] + "..."
        if x > MARGIN_LEFT and x + 40 + 7 * len(text) > WIDTH:
            x, y = MARGIN_LEFT, y + 16
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        parts.append(f'<g class="legend-item"><line x1="{x}" y1="{y - 4}" x2="{x + 22}" y2="{y - 4}" '
                     f'stroke="{color}" stroke-width="3"{dash}/><text class="legend" x="{x + 28}" y="{y}">'
                     f"{escape(text)}</text></g>")
        x += 40 + 7 * len(text)
    return parts


BAR_H, BAR_GAP, BAR_LABEL_W = 16, 14, 150


def bar_chart(title: str, groups: list[str], bars: list[tuple[str, list[float | None], str]],
              value_fmt: Callable[[float], str]) -> str:
    """Horizontal bars: one block per group (run), one bar per (label, values, color); None is not drawn."""
    values = [v for _, vals, _ in bars for v in vals if v is not None]
    if not values:
        return empty_chart(title, "nothing to draw")
    height = MARGIN_TOP + len(groups) * (len(bars) * BAR_H + BAR_GAP) + 50
    scale = (WIDTH - MARGIN_RIGHT - BAR_LABEL_W - 60) / nice_ticks(max(values))[-1]
    body = []
    for g, group in enumerate(groups):
        top = MARGIN_TOP + g * (len(bars) * BAR_H + BAR_GAP)
        body.append(f'<text class="group" x="8" y="{top + len(bars) * BAR_H / 2 + 4}">'
                    f"{escape(group[:22])}</text>")
        for b, (label, vals, color) in enumerate(bars):
            if vals[g] is not None:
                body.append(_bar(top + b * BAR_H, vals[g] * scale, color, f"{group}: {label}",
                                 value_fmt(vals[g])))
    body += legend([(label, color, False) for label, _, color in bars], y=height - 16)
    return _frame(title, body, WIDTH, height)


def _bar(y: float, width: float, color: str, what: str, value: str) -> str:
    width = max(1.0, width)
    return (f'<rect class="bar" x="{BAR_LABEL_W}" y="{y}" width="{width:.2f}" height="{BAR_H - 2}" '
            f'fill="{color}"><title>{escape(f"{what} {value}")}</title></rect>'
            f'<text class="bar-value" x="{BAR_LABEL_W + width + 4:.2f}" y="{y + BAR_H - 4}">'
            f"{escape(value)}</text>")


def point_chart(title: str, categories: list[str], series: list[Series], y_label: str,
                y_fmt: Callable[[float], str], x_label: str = "run date") -> str:
    """Values over evenly spaced categories (run dates), a line with a dot per point; None values are skipped."""
    known = [(s, [(x, y) for x, y in zip(s.xs, s.ys, strict=True) if y is not None]) for s in series]
    if not any(points for _, points in known):
        return empty_chart(title, "no values")
    high = max(y for _, points in known for _, y in points)
    plot = _Plot(len(categories), nice_ticks(high)[-1])  # category i sits at i + 0.5: labels stay inside
    every = max(1, len(categories) // 8)  # at most ~8 date labels
    body = plot.axes([i + 0.5 for i in range(0, len(categories), every)], nice_ticks(high),
                     lambda x: categories[int(x)], y_fmt, x_label, y_label)
    for s, points in known:
        body.append(plot.polyline(Series(s.label, [x + 0.5 for x, _ in points], [y for _, y in points], s.color)))
        body += [f'<circle class="point" cx="{plot.x(x + 0.5)}" cy="{plot.y(y)}" r="3.5" fill="{s.color}">'
                 f"<title>{escape(f'{categories[int(x)]}: {y_fmt(y)}')}</title></circle>" for x, y in points]
    return _frame(title, body)
