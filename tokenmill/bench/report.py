"""One writer for every bench's results, and the progress bar benches show while they run.

``write_report`` puts three files in an output folder: ``<bench>.json`` (the whole result, as
printed), ``<bench>.md`` (a markdown table of the bench's rows, with the run's settings and
machine facts above it) and ``<bench>.png`` (a matplotlib chart, one panel per metric).

Nothing heavy is imported at module level: ``bench serve`` is a stdlib-only client, so
matplotlib (Agg, no pyplot and so no global figure state) and tqdm are imported when used, and
a missing one costs only its output, with a note on stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

DEFAULT_OUTPUT_DIR = "bench-results"


@dataclass(frozen=True)
class Chart:
    """How to draw a bench's rows: ``x`` names each bar (or is the line's x axis), each key in
    ``y`` gets its own panel (metrics have different units), ``kind`` is "bar" or "line"."""

    x: str
    y: tuple[str, ...]
    kind: str = "bar"
    title: str = ""
    highlight: str = ""       # bars whose label starts with this stand out (e.g. "tokenmill")
    series: str = ""          # line charts: one line per distinct value of this row key


def add_output_args(p: argparse.ArgumentParser, default_dir: Optional[str] = DEFAULT_OUTPUT_DIR) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output-dir", default=default_dir,
                   help="write <bench>.json, <bench>.md and <bench>.png here "
                        f"(default: {default_dir}; '' to write none)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar on stderr")


# -- rows -----------------------------------------------------------------------------------------
def flatten(row: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested results become table columns."""
    out = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _columns(rows: Sequence[dict]) -> list[str]:
    cols: list[str] = []
    for row in rows:
        cols.extend(k for k in row if k not in cols)
    return cols


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == 0 or abs(value) >= 100:
            return f"{value:,.1f}" if abs(value) < 1e6 else f"{value:.3g}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 100_000 else str(value)
    if isinstance(value, (list, tuple)):
        text = json.dumps(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[dict]) -> str:
    rows = [flatten(r) for r in rows]
    cols = _columns(rows)
    if not cols:
        return "(no rows)\n"
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def markdown_report(name: str, result: dict, rows: Sequence[dict]) -> str:
    """Heading, the run's scalar settings and machine facts as a list, the table, then any
    other list of records in the result (e.g. "goals") as a table of its own."""
    facts = [f"- **{k}**: {_fmt(v)}" for k, v in result.items()
             if not isinstance(v, (dict, list)) and k != "bench"]
    for key in ("machine", "machine_before", "machine_after"):
        if isinstance(result.get(key), dict):
            facts.append(f"- **{key}**: " + ", ".join(f"{k}={_fmt(v)}" for k, v in result[key].items()))
    text = f"# tokenmill bench {name}\n\n" + "\n".join(facts) + "\n\n" + markdown_table(rows)
    for key, value in result.items():
        if key != "rows" and isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            text += f"\n## {key}\n\n" + markdown_table(value)
    return text


# -- chart ----------------------------------------------------------------------------------------
def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) or math.isinf(value) else float(value)


def draw_chart(rows: Sequence[dict], chart: Chart, path: str) -> bool:
    """One panel per metric of ``chart.y`` that has a number in some row. False when there
    is nothing to draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    rows = [flatten(r) for r in rows]
    metrics = [m for m in chart.y if any(_number(r.get(m)) is not None for r in rows)]
    if not metrics:
        return False
    ncols = min(3, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig = Figure(figsize=(4.2 * ncols, 3.2 * nrows), dpi=100)
    FigureCanvasAgg(fig)
    labels = [_fmt(r.get(chart.x)) for r in rows]
    for i, metric in enumerate(metrics):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        values = [_number(r.get(metric)) for r in rows]
        if chart.kind == "line":
            names = list(dict.fromkeys(str(r.get(chart.series, "")) for r in rows))
            for name in names:
                pts = [(_number(r.get(chart.x)), v) for r, v in zip(rows, values)
                       if str(r.get(chart.series, "")) == name]
                pts = [(x, v) for x, v in pts if x is not None and v is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name or None)
            if len(names) > 1:
                ax.legend(fontsize="small")
            ax.set_xlabel(chart.x)
        else:
            xs = range(len(rows))
            colors = ["tab:orange" if chart.highlight and label.startswith(chart.highlight)
                      else "tab:blue" for label in labels]
            bars = ax.bar(xs, [v or 0.0 for v in values], color=colors)
            for bar, v in zip(bars, values):
                ax.annotate("n/a" if v is None else _fmt(v), (bar.get_x() + bar.get_width() / 2,
                            bar.get_height()), ha="center", va="bottom", fontsize=7)
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(metric, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    if chart.title:
        fig.suptitle(chart.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return True


# -- the three files ------------------------------------------------------------------------------
def write_report(name: str, result: dict, out_dir: str, rows: Sequence[dict],
                 chart: Optional[Chart] = None) -> dict[str, str]:
    """Write <name>.json / .md / .png under ``out_dir``; returns {"json"|"md"|"png": path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}.json"),
             "md": os.path.join(out_dir, f"{name}.md")}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=2)
    with open(paths["md"], "w") as f:
        f.write(markdown_report(name, result, rows))
    if chart is not None:
        png = os.path.join(out_dir, f"{name}.png")
        try:
            if draw_chart(rows, chart, png):
                paths["png"] = png
        except ImportError as e:
            print(f"tokenmill bench: no chart ({e}); pip install matplotlib", file=sys.stderr)
    return paths


# -- progress -------------------------------------------------------------------------------------
class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress(total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr (a no-op object when disabled or tqdm is missing); use it as a
    context manager and ``update()`` it between timed sections, never inside one."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
