"""A griffe extension for the API reference: reads the package's docstrings as
they are written, and each parameter's type and default from the signature.

Habits of the docstrings that the numpy-style parser would misread:

- Sphinx roles (``:class:`~mmstore.errors.LoaderStateError```) become inline
  code of the name they show (``LoaderStateError``);
- a paragraph of prose after the last parameter of a ``Parameters`` (or
  ``Returns``, ``Raises`` ...) section, which the docstrings use for what holds
  for all the parameters, is given a ``Notes`` heading of its own instead of
  being read as more parameters.

What the signature says wins over what griffe would guess:

- a parameter's default is the value it has when the module runs
  (``'skip'``, not ``RUN_DEFAULTS['on_error']``), in the signature and in the
  table, whenever the source spells it as an expression rather than a
  literal;
- each row of a ``Parameters`` table takes its own parameter's annotation
  (griffe gives every name of a shared entry, ``resize, channels : ...``, the
  first one's) and its real default (not a default written in the entry's
  type); a docstring type is kept only where the signature has none, or
  only ``Any``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
_SECTIONS = {"Parameters", "Returns", "Yields", "Raises", "Warns", "Attributes", "Other Parameters", "Receives"}
_PARAMETER_KINDS = {griffe.DocstringSectionKind.parameters, griffe.DocstringSectionKind.other_parameters}


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


def _is_literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return True


def _runtime(obj: griffe.Object) -> Any:
    """The object ``obj`` describes, imported; None when that fails."""
    module = obj.module
    try:
        target: Any = importlib.import_module(module.path)
        for part in obj.path[len(module.path) + 1:].split("."):
            target = getattr(target, part)
    except Exception:  # noqa: BLE001 - an optional dependency missing: keep what the source says
        return None
    return target


def real_defaults(func: griffe.Function) -> None:
    """Replace each default written as an expression by the repr of its value."""
    wanted = [p for p in func.parameters if p.default is not None and not _is_literal(str(p.default))]
    if not wanted:
        return
    target = _runtime(func)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return
    for p in wanted:
        real = sig.parameters.get(p.name)
        if real is None or real.default is inspect.Parameter.empty:
            continue
        text = repr(real.default)
        if _is_literal(text):  # a value a reader can type back (not <function ...>)
            p.default = text


def signature_rows(sections: list[griffe.DocstringSection], parent: griffe.Object | None) -> None:
    """Give every row of the parameter tables its own parameter's type and default."""
    try:
        params = getattr(parent, "parameters", None)  # a function's, or a class's __init__'s
    except KeyError:
        return
    if not params:
        return
    for section in sections:
        if section.kind not in _PARAMETER_KINDS:
            continue
        for row in section.value:
            name = row.name.lstrip("*")
            if name not in params:
                continue
            p = params[name]
            if p.annotation is not None and str(p.annotation) not in ("Any", "typing.Any"):
                row.annotation = p.annotation
            row.value = p.default


class SignatureDocstring(griffe.Docstring):
    """A docstring whose parsed parameter tables follow the signature (:func:`signature_rows`)."""

    def parse(self, parser: Any = None, **options: Any) -> list[griffe.DocstringSection]:
        sections = super().parse(parser, **options)
        signature_rows(sections, self.parent)
        return sections


class ReadAsWritten(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if isinstance(obj, griffe.Function):
            real_defaults(obj)
        doc = obj.docstring
        if doc is not None:
            obj.docstring = SignatureDocstring(
                _notes(_ROLE.sub(_role, doc.value)), lineno=doc.lineno, endlineno=doc.endlineno, parent=obj,
                parser=doc.parser, parser_options=doc.parser_options)
