"""MkDocs hooks: the parts of the site generated from the code at build time.

A page asks for generated content with a marker on a line of its own:

- ``<!-- gen: cli-reference -->``: every command's ``--help``, from
  ``mmstore.cli.build_parser()`` (``cli_reference.py``);
- ``<!-- gen: format-spec -->``: the on-disk specification, the docstring of
  ``mmstore/format/__init__.py`` (``format_spec.py``);
- ``<!-- gen: decode-rules -->``: how an image becomes a record (decoding,
  resize and crop, the order of the steps), the docstring of
  ``mmstore/decode/__init__.py``, rendered as the format specification is;
- ``<!-- gen: bench NAME -->``: the tables and plots of the benchmark record
  ``docs/benchmarks/data/NAME.json`` (``bench_pages.py``).

The plots, and the picture of the orders in the concepts, are SVG files added
to the site here (``on_files``), never committed. A marker naming nothing
known fails the build.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_pages  # noqa: E402
import cli_reference  # noqa: E402
import format_spec  # noqa: E402

MARKER = re.compile(r"^<!-- gen: (?P<what>[a-z-]+)(?: (?P<arg>[\w-]+))? -->$", re.MULTILINE)
ORDERS_PICTURE = "concepts/orders.svg"


def on_files(files, config):
    from mkdocs.structure.files import File

    generated = {f"benchmarks/plots/{name}": lambda p=p: bench_pages.plot_svg(p)
                 for name, p in bench_pages.plots().items()}
    generated[ORDERS_PICTURE] = orders_svg
    for uri, make in generated.items():
        files.append(File.generated(config, uri, content=make()))
    return files


def on_page_markdown(markdown, page, config, files):
    def replace(m: re.Match) -> str:
        what, arg = m.group("what"), m.group("arg")
        if what == "cli-reference":
            return cli_reference.to_markdown()
        if what == "format-spec":
            import mmstore.format

            return format_spec.to_markdown(mmstore.format.__doc__ or "")
        if what == "decode-rules":
            return decode_rules_markdown()
        if what == "bench" and arg:
            here = posixpath.dirname(page.file.src_uri) or "."
            return bench_pages.run_markdown(arg, posixpath.relpath("benchmarks/plots", here))
        raise ValueError(f"{page.file.src_uri}: unknown generated content {m.group(0)!r}")

    return MARKER.sub(replace, markdown)


def decode_rules_markdown() -> str:
    """The decode rules of ``mmstore.decode`` as Markdown: its docstring's
    sections as second-level headings of the concepts page."""
    import mmstore.decode

    return format_spec.to_markdown(mmstore.decode.__doc__ or "", level=1)


def orders_svg() -> bytes:
    """Which records the first batches of an epoch take, in each order: record index against batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mmstore.order import make_order

    n, batch, shown = 1024, 32, 6
    orders = [("sequential", make_order("sequential", n)),
              ("permutation", make_order("permutation", n, seed=0)),
              ("block shuffle (block 32, window 4)", make_order("block", n, seed=0, block=32, window=4))]
    fig, axes = plt.subplots(len(orders), 1, figsize=(7.5, 4.8), sharex=True)
    try:
        for ax, (title, order) in zip(axes, orders):
            idx = order.epoch(0)
            for b in range(shown):
                rec = idx[b * batch:(b + 1) * batch]
                ax.scatter(rec, [b] * len(rec), s=6, marker="|")
            ax.set_yticks(range(shown), [f"batch {b}" for b in range(shown)], fontsize=7)
            ax.invert_yaxis()
            ax.set_title(title, fontsize=9, loc="left")
            ax.set_xlim(0, n)
        axes[-1].set_xlabel(f"record index (a store of {n:,} records; each mark is a record a batch of {batch} reads)",
                            fontsize=8)
        fig.tight_layout()
        buf = io.BytesIO()
        with matplotlib.rc_context({"svg.hashsalt": "mmstore-docs", "svg.fonttype": "none"}):
            fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
        return buf.getvalue()
    finally:
        plt.close(fig)
