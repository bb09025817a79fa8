"""A guide's example shows what the code prints once: ``mmstore.ray.write``
prints its summary itself (unless ``quiet=True``), so no example prints the
result's ``summary()`` again."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import sys

_spec = importlib.util.spec_from_file_location(
    "mmstore_doc_blocks", os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_code_blocks.py"))
assert _spec and _spec.loader
_blocks = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_blocks)
doc_files, parse = _blocks.doc_files, _blocks.parse

WRITE = re.compile(r"^(\w+)\s*=\s*mmstore\.ray\.write\(", re.M)


def test_write_prints_its_summary_unless_quiet():
    import pytest

    sink = pytest.importorskip("mmstore.ray.sink")
    source = inspect.getsource(sink.write)
    assert re.search(r"if not quiet:\n\s+print\(result\.summary\(\), file=sys\.stderr\)", source)


def test_no_example_prints_the_summary_write_printed():
    found = 0
    for path in doc_files():
        for block in parse(path):
            if block.lang != "python":
                continue
            for m in WRITE.finditer(block.code):
                found += 1
                call = block.code[m.end():].split("\n\n", 1)[0]
                if "quiet=True" in call:
                    continue
                assert f"print({m.group(1)}.summary())" not in block.code, f"{block.id}: the summary prints twice"
    assert found, "no example assigns the result of mmstore.ray.write"
