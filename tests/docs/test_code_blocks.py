"""Every fenced code block of ``README.md`` and ``docs/**/*.md`` runs, or says why it cannot.

How a block is marked (HTML comments on the lines just before its fence,
blank lines allowed between them):

- ``<!-- fixture: NAME, NAME -->``: the data the block needs (see
  ``conftest.py``); the block runs in a fresh folder holding copies of them.
- ``<!-- not-run: REASON -->``: the block is not run (it installs packages,
  starts jobs on many machines, runs the whole test suite ...); REASON says
  which, and must not be empty.
- ``<!-- test: NAME -->``: another test also runs the block (kept next to the
  fence, where that test looks for it).
- ``<!-- slow: REASON -->``: the block is a whole job of many processes (a
  Ray Train run): it carries the ``slow`` marker, so the README's command
  leaves it to CI's step for slow tests; REASON says why, and must not be empty.

``python`` blocks are executed in this process (warnings are errors, as in the
whole suite); ``bash`` / ``sh`` blocks run under ``bash -euo pipefail`` with the
``mmstore`` command of the running interpreter first on ``PATH``. Blocks of
data or output (``text``, ``csv``, ``diff``, ``json``) are not code; a fence
without a language is refused, so nothing is left unrun by accident.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = {"python": "python", "bash": "bash", "sh": "bash"}
NOT_CODE = {"text", "csv", "diff", "json"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<lang>[^\s`{]*)[^`]*$")
COMMENT = re.compile(r"^\s*<!--\s*(?P<body>.*?)\s*-->\s*$")


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, from 1
    lang: str
    code: str
    fixtures: list[str] = field(default_factory=list)
    not_run: str | None = None
    slow: str | None = None
    marks: list[str] = field(default_factory=list)  # every directive seen, for the checks

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[str]:
    files = [os.path.join(ROOT, "README.md")]
    files += sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return files


def parse(path: str) -> list[Block]:
    """The fenced blocks of one Markdown file with the directives before each."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    rel = os.path.relpath(path, ROOT)
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group("indent"), m.group("fence"), m.group("lang").lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence))
                                      and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        block = Block(rel, i + 1, lang, "\n".join(body) + "\n")
        k = i - 1
        while k >= 0 and (not lines[k].strip() or COMMENT.match(lines[k])):
            c = COMMENT.match(lines[k])
            if c:
                _directive(block, c.group("body"))
            k -= 1
        out.append(block)
        i = j + 1
    return out


def _directive(block: Block, body: str) -> None:
    name, _, value = body.partition(":")
    name, value = name.strip(), value.strip()
    block.marks.append(name)
    if name == "fixture":
        block.fixtures += [v.strip() for v in value.split(",") if v.strip()]
    elif name == "not-run":
        block.not_run = value
    elif name == "slow":
        block.slow = value


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in parse(f)]


BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b.lang in RUN and b.not_run is None]


def test_the_docs_have_blocks_to_run():
    assert len(RUNNABLE) >= 30, [b.id for b in RUNNABLE]
    assert any(b.path == "README.md" for b in RUNNABLE)


def test_every_block_is_code_data_or_marked(doc_fixtures):
    bad = []
    for b in BLOCKS:
        if b.lang not in RUN and b.lang not in NOT_CODE:
            bad.append(f"{b.id}: fence language {b.lang!r} is neither code ({sorted(RUN)}) nor data "
                       f"({sorted(NOT_CODE)})")
        if "not-run" in b.marks and not b.not_run:
            bad.append(f"{b.id}: <!-- not-run: ... --> must say why")
        if "slow" in b.marks and not b.slow:
            bad.append(f"{b.id}: <!-- slow: ... --> must say why")
        if b.not_run is not None and b.lang not in RUN:
            bad.append(f"{b.id}: only code blocks are marked not-run")
        for f in b.fixtures:
            if f not in doc_fixtures.known:
                bad.append(f"{b.id}: unknown fixture {f!r}")
    assert not bad, "\n".join(bad)


def test_the_readme_test_command_is_marked_as_ci_reads_it():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    at = lines.index("<!-- test-command -->")
    assert lines[at + 1] == "```bash" and "pytest" in lines[at + 2] and lines[at + 3] == "```"
    marked = [b for b in BLOCKS if b.path == "README.md" and b.line == at + 2]
    assert marked and marked[0].not_run  # the suite does not run itself


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("MMSTORE_DEBUG", None)
    return env


def _param(block: Block):
    # a block that starts a Ray cluster runs on the pytest-xdist worker of the other Ray tests
    # (tests/conftest.py): one Ray cluster at a time
    ray = {"ray", "ray-photos-in-s3"} & set(block.fixtures)
    marks = [pytest.mark.xdist_group("ray")] if ray else []
    if block.slow is not None:
        marks.append(pytest.mark.slow)
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_block_runs(block: Block, doc_fixtures, tmp_path, monkeypatch):
    ns = doc_fixtures.lay_out(block.fixtures, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    if RUN[block.lang] == "bash":
        if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mmstore")):
            pytest.fail(f"no mmstore command beside {sys.executable}: install the package (pip install -e .)")
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (f"{block.id} exited {r.returncode}\n--- block\n{block.code}--- stdout\n"
                                   f"{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
    else:
        ns["__name__"] = "__main__"
        exec(compile(block.code, block.id, "exec"), ns)  # noqa: S102 - the block is the test
