"""Geometry of a series' timeline, drawn as server-side SVG by the dashboard's template (no JS).

Two panels share the time axis: exact-match rate and mean margin (bounded at 20) per window, with
the honest band of each window (``views.Band``) drawn behind its point; a verdict strip below them
(one cell per window), dashed lines where the verdict changes, diamonds for scheduled audits. Lines
join only adjacent windows, so a gap in traffic shows as a gap. Times are UTC.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

WIDTH, LEFT, RIGHT = 960, 64, 16
PANEL_H, GAP, STRIP_H, AXIS_H, TOP = 120, 34, 16, 28, 22


@dataclass
class Panel:
    name: str
    top: float
    height: float
    yticks: list[tuple[float, str]]
    dots: list[tuple[float, float, Any]] = field(default_factory=list)  # x, y, point
    lines: list[str] = field(default_factory=list)  # SVG polyline "x,y x,y ..."
    bands: list[tuple[float, float, float, float]] = field(default_factory=list)  # x, y, w, h


@dataclass
class Chart:
    width: int
    height: int
    left: int
    right: int
    panels: list[Panel]
    strip: list[tuple[float, float, Any]]  # x, w, point
    strip_top: float
    changes: list[tuple[float, str]]  # x, new verdict
    audits: list[tuple[float, Any]]  # x, audit result
    xticks: list[tuple[float, str, str]]  # x, label, text-anchor


def _scale(lo: float, hi: float, top: float, height: float) -> Callable[[float], float]:
    span = (hi - lo) or 1.0
    return lambda v: round(top + height - (v - lo) / span * height, 2)


def nice_step(raw: float) -> float:
    """The 1, 2 or 5 times a power of ten at or above ``raw``: tick steps a reader can add in their head."""
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw * (1 - 1e-9))


def nice_range(lo: float, hi: float, ticks: int = 5) -> tuple[float, float, list[tuple[float, str]]]:
    """``[lo, hi]`` widened to multiples of a nice step, and its ticks labelled with the decimals the step
    needs (0.96, 0.98, 1 rather than 0.9612, 0.9709 ...)."""
    if not hi > lo:
        hi = lo + (abs(lo) or 1.0) * 0.1
    step = nice_step((hi - lo) / (ticks - 1))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    values = [round(k * step, decimals + 2) for k in range(first, last + 1)]
    return values[0], values[-1], [(v, f"{v:.{decimals}f}") for v in values]


TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 3 * 3600, 6 * 3600, 12 * 3600, 86400,
              2 * 86400, 7 * 86400, 14 * 86400, 28 * 86400)


def time_ticks(t0: dt.datetime, t1: dt.datetime, most: int = 7) -> list[tuple[dt.datetime, str]]:
    """Ticks at round UTC times (a multiple of a step from ``TIME_STEPS``, at most ``most`` of them), each
    labelled with the time, and with the date only where it changes (the first tick, a new day)."""
    span = (t1 - t0).total_seconds()
    step = next((s for s in TIME_STEPS if span / s <= most - 1), TIME_STEPS[-1])
    epoch = dt.datetime(1970, 1, 1)
    k = math.ceil((t0 - epoch).total_seconds() / step)
    out, day = [], None
    while (t := epoch + dt.timedelta(seconds=k * step)) <= t1:
        clock = t.strftime("%H:%M:%S" if step < 60 else "%H:%M")
        out.append((t, (t.strftime("%Y-%m-%d ") + clock if t.date() != day else clock) + ("Z" if day is None else "")))
        day, k = t.date(), k + 1
    return out or [(t0, t0.strftime("%Y-%m-%d %H:%M:%S") + "Z")]


def chart(points: Sequence[Any], audits: Sequence[Any] = (), width: int = WIDTH) -> Chart:
    """The timeline of ``points`` (``views.Point``, oldest first) and ``audits`` (``AuditResult``)."""
    times = [p.start for p in points] + [p.end for p in points] + [a.at for a in audits]
    t0, t1 = (min(times), max(times)) if times else (dt.datetime(1970, 1, 1), dt.datetime(1970, 1, 2))
    if t1 <= t0:
        t1 = t0 + dt.timedelta(seconds=1)
    plot_w = width - LEFT - RIGHT
    span = (t1 - t0).total_seconds()

    def x(t: dt.datetime) -> float:
        return round(LEFT + (t - t0).total_seconds() / span * plot_w, 2)

    panels = []
    for i, (name, attr, band_attr) in enumerate((("exact-match rate", "exact_match_rate", "exact"),
                                                 ("mean margin (bounded at 20)", "mean_margin", "margin"))):
        values = [getattr(p, attr) for p in points if getattr(p, attr) is not None]
        bands = [getattr(p.band, band_attr) for p in points if p.band is not None and getattr(p.band, band_attr)]
        lo = min(values + [b[0] for b in bands] + ([1.0] if attr == "exact_match_rate" else [0.0]))
        hi = max(values + [b[1] for b in bands] + ([1.0] if attr == "exact_match_rate" else [1e-3]))
        if attr == "exact_match_rate":
            lo = max(0.0, lo - 0.05 * max(hi - lo, 0.02))
        else:
            lo, hi = 0.0, hi * 1.08
        lo, hi, ticks = nice_range(lo, hi)
        if attr == "exact_match_rate":  # a rate: never beyond [0, 1]
            ticks = [(v, t) for v, t in ticks if 0 <= v <= 1]
            lo, hi = max(lo, 0.0), min(hi, 1.0)
        top = TOP + i * (PANEL_H + GAP)
        y = _scale(lo, hi, top, PANEL_H)
        panel = Panel(name, top, PANEL_H, [(y(v), label) for v, label in ticks])
        line: list[str] = []
        prev = None
        for p in points:
            band = getattr(p.band, band_attr) if p.band is not None else None
            if band:
                b_lo, b_hi = max(band[0], lo), min(band[1], hi)
                panel.bands.append((x(p.start), y(b_hi), max(x(p.end) - x(p.start), 1.0), max(y(b_lo) - y(b_hi), 1.0)))
            value = getattr(p, attr)
            if value is None:
                prev = None
                continue
            cx, cy = round((x(p.start) + x(p.end)) / 2, 2), y(value)
            if prev is None or prev.end != p.start:
                if len(line) > 1:
                    panel.lines.append(" ".join(line))
                line = []
            line.append(f"{cx},{cy}")
            panel.dots.append((cx, cy, p))
            prev = p
        if len(line) > 1:
            panel.lines.append(" ".join(line))
        panels.append(panel)
    strip_top = TOP + 2 * (PANEL_H + GAP) - GAP + 14
    strip = [(x(p.start), max(x(p.end) - x(p.start), 1.0), p) for p in points]
    changes = [(x(p.start), p.verdict) for p in points if p.changed]
    ticks = time_ticks(t0, t1)
    return Chart(width, int(strip_top + STRIP_H + AXIS_H), LEFT, RIGHT, panels, strip, strip_top, changes,
                 [(x(a.at), a) for a in audits],
                 [(x(t), label, "start" if x(t) < LEFT + 40 else "end" if x(t) > width - RIGHT - 40 else "middle")
                  for t, label in ticks])


__all__ = ["Chart", "Panel", "chart"]
