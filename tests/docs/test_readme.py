"""The README is one screen, links only to what exists, and the docs speak of the project only."""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _slug(heading: str) -> str:
    """The anchor GitHub and MkDocs give a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_the_readme_fits_one_screen():
    assert len(_read(os.path.join(ROOT, "README.md")).splitlines()) <= 120


def test_every_relative_link_of_the_readme_resolves():
    text = _read(os.path.join(ROOT, "README.md"))
    links = [m.group("target") for m in LINK.finditer(text) if "://" not in m.group("target")]
    assert len(links) > 20
    bad = []
    for link in links:
        path, _, anchor = link.partition("#")
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            bad.append(f"{link}: no such file")
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", _read(full), re.MULTILINE)
            if anchor not in {_slug(h) for h in headings}:
                bad.append(f"{link}: no heading with that anchor")
    assert not bad, bad


def test_the_docs_speak_of_the_project_only():
    words = re.compile(r"\bissue #?\d+|\bsessions?\b|\bengineers?\b|/work/|\bshared/|/tmp/")
    files = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "mkdocs.yml")]
    files += glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    files += glob.glob(os.path.join(ROOT, "docs", "**", "*.json"), recursive=True)
    found = [f"{os.path.relpath(f, ROOT)}: {m.group(0)!r}" for f in files for m in words.finditer(_read(f))]
    assert not found, found
