"""Benchmark output: the run's environment, a printed table, dated JSON and an SVG plot.

The plot is written by matplotlib when it is importable, otherwise by a small SVG writer here
(line series on log-log axes, one panel per group), so a GPU machine without a package index
still gets a figure.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import platform
import re
import subprocess
from dataclasses import dataclass, field
from datetime import date
from typing import Any, Callable, Optional, Sequence
from xml.sax.saxutils import escape

import torch

__all__ = [
    "Column",
    "Table",
    "sig",
    "Series",
    "Panel",
    "environment",
    "device_slug",
    "result_paths",
    "write_json",
    "write_plot",
    "svg_document",
]


# -- environment --------------------------------------------------------------------------------


def _dist_version(*names: str) -> Optional[str]:
    # Read from distribution metadata: importing FlashInfer or Triton only to learn the version
    # would cost seconds and may fail on a machine that cannot run them.
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def _driver_version() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except Exception:
        return None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[0] if lines else None


def environment(device: str, gpus: int = 1) -> dict[str, Any]:
    """Date, device name and the versions a figure depends on (``None`` where not installed)."""
    cuda = torch.device(device).type == "cuda"
    return {
        "date": date.today().isoformat(),
        "device": "cuda" if cuda else "cpu",
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": gpus if cuda else 0,
        "cpu": platform.processor() or platform.machine(),
        "driver": _driver_version() if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _dist_version("triton", "pytorch-triton"),
        "flashinfer": _dist_version("flashinfer-python", "flashinfer"),
        "layer_boundary": _dist_version("layer-boundary"),
        "python": platform.python_version(),
    }


def device_slug(env: dict[str, Any]) -> str:
    """``nvidia-h200`` (``nvidia-h200-x2`` for two GPUs), ``cpu-x86_64`` without a GPU."""
    if env.get("gpu"):
        slug = re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-")
        return slug + (f"-x{env['gpu_count']}" if env.get("gpu_count", 1) > 1 else "")
    return "cpu-" + re.sub(r"[^a-z0-9]+", "-", platform.machine().lower()).strip("-")


def result_paths(out_dir: str, bench: str, env: dict[str, Any]) -> tuple[str, str]:
    """``(json, svg)`` paths ``<out_dir>/YYYY-MM-DD-<bench>-<device-slug>.{json,svg}``; a later run
    of the same bench on the same day and device gets ``-2``, ``-3``, ... rather than replacing it."""
    stem = os.path.join(out_dir, f"{env['date']}-{bench}-{device_slug(env)}")
    free, k = stem, 1
    while os.path.exists(free + ".json") or os.path.exists(free + ".svg"):
        k += 1
        free = f"{stem}-{k}"
    return free + ".json", free + ".svg"


def write_json(path: str, bench: str, env: dict[str, Any], rows: Sequence[dict[str, Any]],
               **extra: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    doc = {"bench": bench, **env, **extra, "rows": list(rows)}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")


def publish(args: Any, bench: str, env: dict[str, Any], rows: Sequence[dict[str, Any]], title: str,
            panels: Sequence[Any], *, note: str = "", **fields: Any) -> None:
    """Write a bench's dated JSON (its rows, ``fields`` and the command's options) and its plot
    under ``args.out``, and say where they went."""
    json_path, svg_path = result_paths(args.out, bench, env)
    write_json(json_path, bench, env, rows, **fields,
               options={k: v for k, v in vars(args).items() if not callable(v)})
    subtitle = f"{env['gpu'] or env['cpu']}, torch {env['torch']}, {env['date']}{note}"
    writer = write_plot(svg_path, title, panels, subtitle)
    print(f"\nwrote {json_path}\nwrote {svg_path} ({writer})")


def exit_status(rows: Sequence[dict[str, Any]], keys: Sequence[str] = ("tokens", "hidden"),
                what: str = "measurement(s)") -> int:
    """1 after naming the rows that failed their check or raised (``method`` and ``keys``), else 0."""
    failed = [r for r in rows if r.get("ok") is False or "error" in r]
    if not failed:
        return 0
    label = {"tokens": "T", "hidden": "H"}
    print(f"{len(failed)} {what} failed their check or raised: " + "; ".join(
        " ".join([r["method"], *(f"{label[k]}={r[k]}" if k in label else str(r[k]) for k in keys)])
        for r in failed))
    return 1


# -- table ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A table column: header, row key, format spec (``".2f"``) and width."""

    header: str
    key: str
    fmt: Any = ""  # a format spec, or a callable value -> text
    width: int = 9


def sig(value: float) -> str:
    """A figure with about three significant digits and no exponent (4070, 40.7, 0.407)."""
    a = abs(value)
    return f"{value:.0f}" if a >= 100 else f"{value:.1f}" if a >= 10 else f"{value:.2f}" if a >= 1 else f"{value:.3f}"


class Table:
    """A fixed-width table printed row by row as results arrive (long runs show progress)."""

    def __init__(self, columns: Sequence[Column], out: Callable[[str], None] = print) -> None:
        self.columns = list(columns)
        self.out = out

    def _cell(self, col: Column, value: Any) -> str:
        if value is None:
            text = "-"
        elif isinstance(value, float) and not math.isfinite(value):
            text = str(value)
        else:
            text = col.fmt(value) if callable(col.fmt) else format(value, col.fmt) if col.fmt else str(value)
        return text.ljust(col.width) if col is self.columns[0] else text.rjust(col.width)

    def header(self) -> None:
        self.out(" ".join(c.header.ljust(c.width) if i == 0 else c.header.rjust(c.width)
                          for i, c in enumerate(self.columns)))

    def row(self, row: dict[str, Any]) -> None:
        self.out(" ".join(self._cell(c, row.get(c.key)) for c in self.columns))


# -- plot -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    """A line; series that share a ``color`` key (default: the name) share a colour."""

    name: str
    points: tuple[tuple[float, float], ...]
    dashed: bool = False
    color: Optional[str] = None

    @property
    def color_key(self) -> str:
        return self.color or self.name


@dataclass(frozen=True)
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...] = field(default_factory=tuple)


_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22")
_PW, _PH = 420, 290  # panel size
_ML, _MR, _MT, _MB = 62, 14, 28, 44  # plot margins inside a panel
_LEGEND_W = 260
_TITLE_H = 52


def _finite(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(x, y) for x, y in points if x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y)]


def _decades(values: Sequence[float]) -> tuple[int, int]:
    lo = math.floor(math.log10(min(values)))
    hi = math.ceil(math.log10(max(values)))
    return (lo, hi) if hi > lo else (lo, lo + 1)


def _tick(v: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if v >= scale:
            return f"{v / scale:g}{unit}"
    return f"{v:g}"


def _color_map(panels: Sequence[Panel]) -> dict[str, str]:
    keys = list(dict.fromkeys(s.color_key for p in panels for s in p.series))
    return {k: _COLORS[i % len(_COLORS)] for i, k in enumerate(keys)}


def _legend(panels: Sequence[Panel]) -> list[Series]:
    """One entry per series name, in order of first appearance."""
    first: dict[str, Series] = {}
    for p in panels:
        for s in p.series:
            first.setdefault(s.name, s)
    return list(first.values())


def _ticks(lo: int, hi: int) -> list[float]:
    """Decades; with 1, 2, 5 steps between them when the axis spans two decades or fewer."""
    steps = (1, 2, 5) if hi - lo <= 2 else (1,)
    return [m * 10.0**e for e in range(lo, hi + 1) for m in steps if m * 10.0**e <= 10.0**hi]


def _panel_svg(p: Panel, x0: float, y0: float, colors: dict[str, str]) -> list[str]:
    out = [f'<g transform="translate({x0:.0f},{y0:.0f})">',
           f'<text x="{_PW / 2:.0f}" y="17" text-anchor="middle" font-weight="bold">{escape(p.title)}</text>']
    w, h = _PW - _ML - _MR, _PH - _MT - _MB
    pts = [pt for s in p.series for pt in _finite(s.points)]
    out.append(f'<rect x="{_ML}" y="{_MT}" width="{w}" height="{h}" fill="none" stroke="#444"/>')
    if not pts:
        out.append(f'<text x="{_ML + w / 2:.0f}" y="{_MT + h / 2:.0f}" text-anchor="middle">no data</text></g>')
        return out
    (xl, xh), (yl, yh) = _decades([x for x, _ in pts]), _decades([y for _, y in pts])

    def px(x: float) -> float:
        return _ML + (math.log10(x) - xl) / (xh - xl) * w

    def py(y: float) -> float:
        return _MT + h - (math.log10(y) - yl) / (yh - yl) * h

    for v in _ticks(xl, xh):
        x = px(v)
        out.append(f'<line x1="{x:.1f}" y1="{_MT}" x2="{x:.1f}" y2="{_MT + h}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{_MT + h + 15}" text-anchor="middle">{_tick(v)}</text>')
    for v in _ticks(yl, yh):
        y = py(v)
        out.append(f'<line x1="{_ML}" y1="{y:.1f}" x2="{_ML + w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{_ML - 5}" y="{y + 4:.1f}" text-anchor="end">{_tick(v)}</text>')
    out.append(f'<text x="{_ML + w / 2:.0f}" y="{_PH - 8}" text-anchor="middle">{escape(p.xlabel)}</text>')
    out.append(f'<text transform="translate(14,{_MT + h / 2:.0f}) rotate(-90)" text-anchor="middle">'
               f'{escape(p.ylabel)}</text>')
    for s in p.series:
        sp = sorted(_finite(s.points))
        if not sp:
            continue
        color = colors[s.color_key]
        dash = ' stroke-dasharray="6,4"' if s.dashed else ""
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sp)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.8"{dash}/>')
        if not s.dashed:
            out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}"/>' for x, y in sp]
    out.append("</g>")
    return out


def svg_document(title: str, panels: Sequence[Panel], subtitle: str = "") -> str:
    """A standalone SVG: panels in rows of two, log-log axes, one shared legend."""
    cols = min(2, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    colors = _color_map(panels)
    width = cols * _PW + _LEGEND_W
    height = max(_TITLE_H + rows * _PH, _TITLE_H + 20 * len(_legend(panels)) + 20)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(title)}</text>',
           f'<text x="10" y="39" fill="#555">{escape(subtitle)}</text>']
    for i, p in enumerate(panels):
        out += _panel_svg(p, (i % cols) * _PW, _TITLE_H + (i // cols) * _PH, colors)
    lx = cols * _PW + 10
    for i, s in enumerate(_legend(panels)):
        y = _TITLE_H + 20 + 20 * i
        dash = ' stroke-dasharray="6,4"' if s.dashed else ""
        out.append(f'<line x1="{lx}" y1="{y - 4}" x2="{lx + 24}" y2="{y - 4}" stroke="{colors[s.color_key]}" '
                   f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{lx + 30}" y="{y}">{escape(s.name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _matplotlib_plot(path: str, title: str, panels: Sequence[Panel], subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols + 2.2, 3.6 * rows + 0.8), squeeze=False)
    colors = _color_map(panels)
    for ax, p in zip(axes.flat, panels):
        for s in p.series:
            sp = sorted(_finite(s.points))
            if sp:
                ax.plot([x for x, _ in sp], [y for _, y in sp], "--" if s.dashed else "-o", ms=3,
                        color=colors[s.color_key], label=s.name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(p.title)
        ax.set_xlabel(p.xlabel)
        ax.set_ylabel(p.ylabel)
        ax.grid(True, which="major", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
    fig.legend(list(handles.values()), list(handles), loc="center right", fontsize=8)
    fig.suptitle(f"{title}\n{subtitle}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    fig.savefig(path, format="svg")
    plt.close(fig)


def write_plot(path: str, title: str, panels: Sequence[Panel], subtitle: str = "", *,
               use_matplotlib: Optional[bool] = None) -> str:
    """Write the figure; returns the writer used (``matplotlib`` or ``svg``).

    ``use_matplotlib=None`` uses matplotlib when it imports and falls back to the built-in
    writer if it fails: a figure is never worth losing the run's JSON over.
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if use_matplotlib is not False:
        try:
            _matplotlib_plot(path, title, panels, subtitle)
            return "matplotlib"
        except ImportError:
            if use_matplotlib:
                raise
        except Exception as e:  # a broken matplotlib install: say so, keep the built-in figure
            if use_matplotlib:
                raise
            print(f"matplotlib failed ({type(e).__name__}: {e}); writing the built-in SVG instead")
    with open(path, "w") as f:
        f.write(svg_document(title, panels, subtitle))
    return "svg"
