"""What setup.cfg declares (the supported Python, the version) holds for the code."""

from __future__ import annotations

import ast
import configparser
import os
import re
import sys
import warnings

import pytest

import mmstore
from mmstore import _version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    assert cfg.read(os.path.join(ROOT, "setup.cfg")), "setup.cfg is missing"
    return cfg


def _declared_minimum() -> tuple[int, int]:
    spec = _setup_cfg()["options"]["python_requires"].strip()
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec)
    assert m, f"python_requires should be a plain lower bound such as >=3.10, found {spec!r}"
    return int(m.group(1)), int(m.group(2))


def _package_sources() -> list[str]:
    out = []
    for d, _, files in os.walk(os.path.join(ROOT, "mmstore")):
        out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(out)


def test_declared_minimum_is_what_runs_here_or_older():
    assert _declared_minimum() <= sys.version_info[:2]
    assert _declared_minimum() >= (3, 10)  # order.py uses dataclasses.KW_ONLY (3.10)


def test_every_module_parses_with_the_declared_minimum_grammar():
    minimum = _declared_minimum()
    sources = _package_sources()
    assert len(sources) > 30  # the walk found the package, not an empty folder
    bad = []
    for path in sources:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SyntaxWarning)
                ast.parse(text, filename=path, feature_version=minimum)
        except SyntaxError as exc:
            bad.append(f"{os.path.relpath(path, ROOT)}:{exc.lineno}: {exc.msg}")
    assert not bad, f"not valid Python {minimum[0]}.{minimum[1]}: " + "; ".join(bad)


def test_the_grammar_check_catches_a_newer_construct():
    # PEP 695 type parameters are 3.12 syntax: the check above would report them
    with pytest.raises(SyntaxError):
        ast.parse("def first[T](xs: list[T]) -> T:\n    return xs[0]\n", feature_version=(3, 10))
    # and except* (3.11) under a 3.10 floor
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))


def test_the_version_has_one_home():
    assert _setup_cfg()["metadata"]["version"].strip() == "attr: mmstore._version.__version__"
    assert mmstore.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", _version.__version__)
