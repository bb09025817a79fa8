"""A griffe extension for the API reference: reads the package's docstrings as they are written.

Two habits of the docstrings that the numpy-style parser would misread:

- Sphinx roles (``:class:`~mmstore.errors.LoaderStateError```) become inline
  code of the name they show (``LoaderStateError``);
- a paragraph of prose after the last parameter of a ``Parameters`` (or
  ``Returns``, ``Raises`` ...) section, which the docstrings use for what holds
  for all the parameters, is given a ``Notes`` heading of its own instead of
  being read as more parameters.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
_SECTIONS = {"Parameters", "Returns", "Yields", "Raises", "Warns", "Attributes", "Other Parameters", "Receives"}


def _role(m: re.Match) -> str:
    target = m.group(2)
    if "<" in target and target.endswith(">"):  # :class:`title <target>`
        return "`" + target.split("<", 1)[0].strip() + "`"
    return "`" + (target.rsplit(".", 1)[-1] if m.group(1) else target) + "`"


def _notes(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    in_items = False
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if nxt and set(nxt.strip()) == {"-"} and line.strip():
            in_items = line.strip() in _SECTIONS
        elif (in_items and line and not line[0].isspace() and i > 0 and not lines[i - 1].strip()
              and nxt.strip() and not nxt[0].isspace()):
            out += ["Notes", "-----"]
            in_items = False
        out.append(line)
    return "\n".join(out)


class ReadAsWritten(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _notes(_ROLE.sub(_role, obj.docstring.value))
