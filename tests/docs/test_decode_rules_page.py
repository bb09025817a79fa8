"""The concepts page "Resize, crop and decode" holds the decode rules: the
docstring of ``mmstore.decode``, rendered at build time by the site's hook
(``docs/gen/hooks.py``), word for word, with every section a heading and every
formula a code block. Rendered here through the hook itself, without building
the site (``tests/docs/test_site.py`` builds it)."""

from __future__ import annotations

import importlib.util
import os
import re
import types

import mmstore.decode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = "concepts/decoding.md"


def _hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("mmstore_docs_hooks", os.path.join(ROOT, "docs", "gen", "hooks.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rendered() -> str:
    with open(os.path.join(ROOT, "docs", PAGE), encoding="utf-8") as fh:
        text = fh.read()
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_uri=PAGE))
    return _hooks().on_page_markdown(text, page=page, config=None, files=None)


def _words(text: str) -> list[str]:
    text = re.sub(r":(?:class|func|meth|mod|attr|data|exc|obj|const):`~?(?:[\w.]+\.)?(\w+)`", r"\1", text)
    return re.findall(r"[A-Za-z0-9_]+", text)


def test_the_page_is_in_the_navigation_and_asks_for_the_rules():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as fh:
        assert re.search(r"^\s+- [^:]+: " + re.escape(PAGE) + r"\s*$", fh.read(), re.M)
    with open(os.path.join(ROOT, "docs", PAGE), encoding="utf-8") as fh:
        assert "<!-- gen: decode-rules -->" in fh.read().splitlines()


def test_the_page_holds_the_module_docstring_word_for_word():
    doc = mmstore.decode.__doc__ or ""
    md = _rendered()
    assert "<!-- gen:" not in md
    generated = md.split("\n---\n", 1)[1]
    body = "\n".join(line for line in generated.splitlines() if not line.startswith("```"))
    assert _words(body) == _words(doc)
    # each section of the docstring is a heading of the page
    titles = re.findall(r"^(\S[^\n]*)\n-{3,}$", doc, re.M)
    assert len(titles) >= 8
    for title in titles:
        heading = "## " + re.sub(r"``(.+?)``", r"`\1`", title)
        assert heading in md.splitlines(), title
    # every formula (a literal block) is in a code block of the page, line for line
    code = set()
    for block in re.findall(r"^```text\n(.*?)^```$", md, re.M | re.S):
        code |= {ln.strip() for ln in block.splitlines()}
    blocks = re.findall(r"::\n\n((?:(?: {4,}.*)?\n)+)", doc)
    assert len(blocks) >= 4
    for block in blocks:
        for line in (ln.strip() for ln in block.splitlines() if ln.strip()):
            assert line in code, line


def test_the_rules_state_what_a_user_needs_to_rebuild_a_record():
    """The facts a reproduction depends on are in the docstring, hence on the page."""
    md = _rendered()
    for fact in ("INTER_AREA", "INTER_LINEAR", "INTER_CUBIC", "(2*h*tw + th) // (2*th)", "v >> 8",
                 "(c*a + 127) // 255", "IMREAD_COLOR_RGB", "EXIF orientation", "COLOR_GRAY2RGB",
                 "copyMakeBorder", "The steps, in order", "rx1 = rw if x1 == w"):
        assert fact in md, fact
