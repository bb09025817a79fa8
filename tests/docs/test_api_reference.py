"""The API reference shows each parameter's own type and real default.

mkdocstrings renders the reference from what griffe makes of the source, with
the extension of ``docs/gen/griffe_docstrings.py`` that ``mkdocs.yml`` names.
These tests load the package the same way (griffe only: no site build) and
compare the rows of the parameter tables, and the defaults of the signatures,
that the reference of ``mmstore.ingest`` and ``mmstore.torch.Loader`` shows
with ``inspect.signature`` of the running code. griffe comes with the
``test`` extra (and with mkdocstrings in the ``docs`` extra).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re

import pytest

griffe = pytest.importorskip("griffe", reason="griffe comes with the test extra: pip install -e '.[test]'")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the objects whose reference is checked: (module, name) as the reference pages name them
CHECKED = [("mmstore.ingest", "ingest"), ("mmstore.torch.loader", "Loader")]


def _site_options() -> tuple[str, str]:
    """The griffe extension and the docstring style the site uses (mkdocs.yml)."""
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as fh:
        text = fh.read()
    ext = re.search(r"^\s*- (docs/gen/griffe_docstrings\.py:\w+)\s*$", text, re.M)
    style = re.search(r"^\s*docstring_style:\s*(\w+)\s*$", text, re.M)
    assert ext and style, "mkdocs.yml names no griffe extension or docstring style"
    return ext.group(1), style.group(1)


@pytest.fixture(scope="module")
def package():
    ext, style = _site_options()
    path, _, name = ext.partition(":")
    extensions = griffe.load_extensions(f"{os.path.join(ROOT, path)}:{name}")
    return griffe.load("mmstore", search_paths=[ROOT], extensions=extensions, docstring_parser=style,
                       allow_inspection=False), style


def _norm(text: object) -> str:
    return re.sub(r"\s+", "", str(text)).replace('"', "'")


def _rows(obj) -> dict[str, object]:
    """name -> row of the Parameters table the reference renders for ``obj``."""
    rows = {}
    for section in obj.docstring.parsed:
        if section.kind is griffe.DocstringSectionKind.parameters:
            for row in section.value:
                assert row.name not in rows, f"{obj.path}: {row.name} has two rows"
                rows[row.name] = row
    return rows


def _parameters(real) -> list[inspect.Parameter]:
    sig = inspect.signature(real)
    return [p for p in sig.parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


@pytest.mark.parametrize("module, name", CHECKED, ids=[n for _, n in CHECKED])
def test_each_row_has_its_own_type_and_real_default(package, module, name):
    pkg, _ = package
    obj = pkg[f"{module}.{name}".split(".", 1)[1]]
    real = getattr(importlib.import_module(module), name)
    rows = _rows(obj)
    params = _parameters(real)
    assert [p.name for p in params if p.name not in rows] == [], f"{name}: parameters with no row"
    assert sorted(set(rows) - {p.name for p in params}) == [], f"{name}: rows of no parameter"
    for p in params:
        row = rows[p.name]
        assert row.description.strip(), f"{name}({p.name}): the row says nothing"
        # the type: the signature's annotation (a docstring type only stands in for ``Any``)
        if p.annotation is not inspect.Parameter.empty and p.annotation not in ("Any", "typing.Any"):
            assert _norm(row.annotation) == _norm(p.annotation), (name, p.name, str(row.annotation))
        # the default: the value the running code has, written as Python would
        if p.default is inspect.Parameter.empty:
            assert row.value is None, (name, p.name, row.value)
        else:
            shown = str(row.value)
            assert ast.literal_eval(shown) == p.default and type(ast.literal_eval(shown)) is type(p.default), \
                (name, p.name, shown, p.default)


@pytest.mark.parametrize("module, name", CHECKED, ids=[n for _, n in CHECKED])
def test_the_signature_shows_real_defaults(package, module, name):
    pkg, _ = package
    obj = pkg[f"{module}.{name}".split(".", 1)[1]]
    func = obj["__init__"] if obj.is_class else obj
    real = {p.name: p for p in _parameters(getattr(importlib.import_module(module), name))}
    shown = {p.name: p for p in func.parameters if p.name in real}
    assert set(shown) == set(real)
    for pname, p in real.items():
        if p.default is not inspect.Parameter.empty:
            assert ast.literal_eval(str(shown[pname].default)) == p.default, (name, pname, shown[pname].default)


def test_a_shared_entry_gives_each_name_its_own_type(package, tmp_path):
    """A docstring entry naming several parameters (``a, b``) yields one row
    per parameter with that parameter's annotation and default."""
    mod = tmp_path / "shared_entry_demo.py"
    mod.write_text('def f(a: str | None = None, b: int = 3, *, c: bool = False) -> None:\n'
                   '    """Demo.\n\n    Parameters\n    ----------\n    a, b, c\n        Shared.\n    """\n')
    pkg, style = package
    ext, _ = _site_options()
    path, _, cls = ext.partition(":")
    demo = griffe.load("shared_entry_demo", search_paths=[str(tmp_path)], docstring_parser=style,
                       extensions=griffe.load_extensions(f"{os.path.join(ROOT, path)}:{cls}"))
    rows = _rows(demo["f"])
    assert {n: (str(r.annotation), str(r.value)) for n, r in rows.items()} == {
        "a": ("str | None", "None"), "b": ("int", "3"), "c": ("bool", "False")}
