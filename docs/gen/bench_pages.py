"""Benchmark tables and plots for the docs, generated from the JSON records in ``docs/benchmarks/data``.

Each JSON file is one benchmark run: what was measured, the command that
reproduces it, the machine, the date, and its figures as tables and plot
series. The benchmark pages hold a marker ``<!-- gen: bench NAME -->`` that
the site build (``docs/gen/hooks.py``) replaces with :func:`run_markdown`;
the plots are drawn by :func:`plot_svg` at build time. Run alone it writes
every table and plot to a folder, to look at them without building the site::

    python docs/gen/bench_pages.py --out build/benchmarks

A record::

    {"title": "...", "command": "python benchmarks/bench_read.py" or [...],
     "machine": "...", "date": "2026-11-30", "conditions": "...",
     "sections": [{"heading": "...", "text": "...",
                   "table": {"columns": [...], "rows": [[...], ...]},
                   "plot": {"file": "x.svg", "title": "...", "xlabel": "...",
                            "categories": [...], "series": [{"label": "...", "values": [...]}],
                            "reference": {"value": 1.0, "label": "..."}, "log": false}}]}
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "data")
REQUIRED = ("title", "command", "machine", "date", "sections")


def load(name: str) -> dict:
    """The record ``NAME.json``, checked for the keys every run must carry."""
    with open(os.path.join(DATA, name + ".json"), encoding="utf-8") as fh:
        rec = json.load(fh)
    missing = [k for k in REQUIRED if not rec.get(k)]
    if missing:
        raise ValueError(f"{name}.json: a benchmark record needs {', '.join(missing)}")
    for s in rec["sections"]:
        t = s.get("table")
        if t and any(len(r) != len(t["columns"]) for r in t["rows"]):
            raise ValueError(f"{name}.json: a row of {s.get('heading', 'a table')!r} does not have "
                             f"{len(t['columns'])} cells")
        p = s.get("plot")
        if p and any(len(se["values"]) != len(p["categories"]) for se in p["series"]):
            raise ValueError(f"{name}.json: a series of plot {p['file']!r} does not have one value per category")
    return rec


def names() -> list[str]:
    return sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(DATA, "*.json")))


def _cell(v: object) -> str:
    text = f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def table_markdown(table: dict) -> str:
    cols = table["columns"]
    align = table.get("align") or ["---"] + ["---:" if all(isinstance(r[k], (int, float)) for r in table["rows"])
                                             else "---" for k in range(1, len(cols))]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table["rows"]]
    return "\n".join(lines)


def run_markdown(name: str, plots_url: str = "plots") -> str:
    """The Markdown of one run: its command, machine and date, then its sections."""
    rec = load(name)
    cmds = rec["command"] if isinstance(rec["command"], list) else [rec["command"]]
    out = [f"### {rec['title']}", ""]
    out += ["| run | |", "|---|---|"]
    out += ["| command | " + "<br>".join(f"`{_cell(c)}`" for c in cmds) + " |",
            f"| machine | {_cell(rec['machine'])} |", f"| date | {_cell(rec['date'])} |"]
    if rec.get("conditions"):
        out.append(f"| conditions | {_cell(rec['conditions'])} |")
    out.append("")
    for s in rec["sections"]:
        if s.get("heading"):
            out += [f"**{s['heading']}**", ""]
        if s.get("text"):
            out += [s["text"], ""]
        if s.get("table"):
            out += [table_markdown(s["table"]), ""]
        if s.get("plot"):
            p = s["plot"]
            out += [f"![{p['title']}]({plots_url}/{p['file']})", ""]
    return "\n".join(out)


def plots() -> dict[str, dict]:
    """Every plot of every record, by file name."""
    found: dict[str, dict] = {}
    for n in names():
        for s in load(n)["sections"]:
            if s.get("plot"):
                if s["plot"]["file"] in found:
                    raise ValueError(f"plot file {s['plot']['file']!r} is named twice")
                found[s["plot"]["file"]] = s["plot"]
    return found


def plot_svg(p: dict) -> bytes:
    """One plot as SVG: horizontal bars, one group per category, one bar per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats, series = p["categories"], p["series"]
    height = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(7.5, 0.5 + 0.42 * len(cats) * max(1, len(series) * 0.75)))
    try:
        for k, se in enumerate(series):
            ys = [i + (k - (len(series) - 1) / 2) * height for i in range(len(cats))]
            bars = ax.barh(ys, se["values"], height=height * 0.92, label=se["label"] if len(series) > 1 else None)
            ax.bar_label(bars, labels=[f"{v:,.3g}" for v in se["values"]], padding=3, fontsize=8)
        ax.set_yticks(range(len(cats)), cats, fontsize=8)
        ax.invert_yaxis()
        if p.get("log"):
            ax.set_xscale("log")
        ref = p.get("reference")
        if ref:
            ax.axvline(ref["value"], color="0.3", linestyle="--", linewidth=1, label=ref["label"])
        ax.set_xlabel(p.get("xlabel", ""))
        ax.set_title(p["title"], fontsize=10)
        ax.margins(x=0.15)
        if len(series) > 1 or ref:
            ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        buf = io.BytesIO()
        with matplotlib.rc_context({"svg.hashsalt": "mmstore-docs", "svg.fonttype": "none"}):
            fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
        return buf.getvalue()
    finally:
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for NAME.md tables and the plots' SVG files")
    a = ap.parse_args()
    os.makedirs(os.path.join(a.out, "plots"), exist_ok=True)
    for n in names():
        with open(os.path.join(a.out, n + ".md"), "w", encoding="utf-8") as fh:
            fh.write(run_markdown(n))
    for file, p in plots().items():
        with open(os.path.join(a.out, "plots", file), "wb") as fh:
            fh.write(plot_svg(p))
    print(f"{len(names())} runs, {len(plots())} plots in {a.out}")


if __name__ == "__main__":
    main()
