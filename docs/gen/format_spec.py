"""A specification written as a module docstring, as Markdown: the on-disk
format (``mmstore/format/__init__.py``) and the decode rules
(``mmstore/decode/__init__.py``).

The docstrings are written in the plain reStructuredText that numpy's format
module uses: titles underlined with ``=`` or ``-``, ````literals````, ``::``
literal blocks, field lists whose name stands alone in double backticks
followed by its text in an aligned column, bullet lists (a list inside an
item indented by two spaces), and Sphinx roles (``:func:`name```). This
turns exactly those into Markdown, so the site renders the specification
itself and never a copy.
"""

from __future__ import annotations

import re

_LITERAL = re.compile(r"``(.+?)``")
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")
_FIELD = re.compile(r"^``([^`]+)``\s{2,}(\S.*)$")
_NESTED_ITEM = re.compile(r"^ {1,3}([-*] )")  # Markdown nests a list indented by 4


def _inline(text: str) -> str:
    text = _ROLE.sub(lambda m: "`" + m.group(1).rsplit(".", 1)[-1] + "`", text)
    return _NESTED_ITEM.sub(r"    \1", _LITERAL.sub(lambda m: "`" + m.group(1) + "`", text))


def to_markdown(doc: str, level: int = 2) -> str:
    """Markdown of an RST-subset docstring; ``level`` is the Markdown level of a ``=`` title."""
    lines = doc.strip("\n").splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and nxt and len(set(nxt.strip())) == 1 and nxt.strip()[0] in "=-" \
                and len(nxt.strip()) >= len(line.strip()) and not line.startswith(" "):
            depth = level if nxt.strip()[0] == "=" else level + 1
            out += ["#" * depth + " " + _inline(line.strip()), ""]
            i += 2
            continue
        if line.rstrip().endswith("::"):
            head = line.rstrip()[:-2].rstrip()
            if head:
                out.append(_inline(head) + ":")
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            indent = min(len(b) - len(b.lstrip()) for b in block if b.strip())
            out += ["", "```text", *[b[indent:] for b in block], "```", ""]
            continue
        m = _FIELD.match(line)
        if m:
            text = [m.group(2).strip()]
            i += 1
            while i < len(lines) and lines[i].startswith("    ") and lines[i].strip():
                text.append(lines[i].strip())
                i += 1
            if out and out[-1].strip() and not out[-1].startswith("- **`"):
                out.append("")
            out.append(f"- **`{m.group(1)}`**: " + _inline(" ".join(text)))
            if i < len(lines) and lines[i].strip() and not _FIELD.match(lines[i]):
                out.append("")
            continue
        out.append(_inline(line))
        i += 1
    return "\n".join(out) + "\n"
