"""Tags to training targets: ``mmstore.torch.multi_hot`` and the guide's "Tags and captions" snippet."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from support.images import photo, write_image

import mmstore
from mmstore.cli import main as cli_main
from mmstore.format.ragged import Ragged

torch = pytest.importorskip("torch")

from mmstore.torch import Padded, multi_hot  # noqa: E402 - needs torch, so after the importorskip

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _want(rows, k):
    out = torch.zeros((len(rows), k))
    for j, r in enumerate(rows):
        for t in r:
            out[j, t] = 1
    return out


def test_multi_hot_of_every_form():
    rows = [[1, 0], [], [2, 2, 4], [4]]
    want = _want(rows, 5)
    as_list = [torch.tensor(r, dtype=torch.int32) for r in rows]
    assert torch.equal(multi_hot(as_list, 5), want)
    assert torch.equal(multi_hot([np.array(r, np.int64) for r in rows], 5), want)
    flat = np.array([t for r in rows for t in r], np.int32)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    assert torch.equal(multi_hot(Ragged(flat, offsets), 5), want)
    padded = torch.full((4, 3), -1, dtype=torch.int32)
    for j, r in enumerate(rows):
        padded[j, : len(r)] = torch.tensor(r, dtype=torch.int32)
    assert torch.equal(multi_hot(Padded(padded, torch.tensor([2, 0, 3, 1])), 5), want)
    assert multi_hot([], 5).shape == (0, 5)
    assert multi_hot(as_list, 5, dtype=torch.bool).dtype == torch.bool
    with pytest.raises(ValueError, match="tag id 5 of record 2 is outside 0 .. 4"):
        multi_hot([torch.tensor([1]), torch.tensor([]), torch.tensor([0, 5])], 5)
    with pytest.raises(ValueError, match="tag id -1 of record 0"):
        multi_hot(Padded(padded, torch.tensor([3, 0, 3, 1])), 5)  # the padding is not a tag
    for floats in ([torch.tensor([1.5])], [np.array([1.0, 2.0])], Ragged(np.array([1.5], np.float32), [0, 1]),
                   Padded(torch.tensor([[1.5]]), torch.tensor([1])), [torch.tensor([True])]):
        with pytest.raises(TypeError, match="tag ids must be integers"):
            multi_hot(floats, 5)  # never rounded to a tag
    assert torch.equal(multi_hot([torch.tensor([]), np.array([]), torch.tensor([3])], 5), _want([[], [], [3]], 5))


def _snippet():
    with open(os.path.join(ROOT, "docs/guides/tags-captions.md"), encoding="utf-8") as f:
        m = re.search(r"<!-- test: tags -->\n```python\n(.*?)```", f.read(), re.DOTALL)
    assert m, "the guide's tags snippet is missing"
    return m.group(1)


def test_readme_tags_snippet_runs(tmp_path, monkeypatch):
    """The README's CSV example and loop, unchanged, from the list to the targets."""
    rng = np.random.default_rng(0)
    (tmp_path / "img").mkdir()
    cells = [("cat;animal", "A cat asleep on a mat."), ("dog; animal", ""), ("", '"Two birds, one branch."'),
             ("bird;animal;bird", "one")]
    lines = ["path,tags,caption"]
    for k, (tags, cap) in enumerate(cells):
        write_image(str(tmp_path / "img" / f"{k:04d}.jpg"), photo(rng, 24, 20))
        lines.append(f"img/{k:04d}.jpg,{tags},{cap}")
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert cli_main(["ingest", "train.csv", "train.store", "--size", "16", "--tags-column", "tags",
                     "--text-column", "caption", "--workers", "0", "-q"]) == 0
    assert mmstore.open("train.store").schema["tags"].class_names == {0: "animal", 1: "bird", 2: "cat", 3: "dog"}
    seen = []
    ns = {"model": lambda x: (seen.append(len(x)), torch.zeros((len(x), 4)))[1]}
    exec(compile(_snippet(), "docs/guides/tags-captions.md", "exec"), ns)  # noqa: S102 - the README snippet is the test
    want = {"A cat asleep on a mat.": [0, 2], "": [0, 3], "Two birds, one branch.": [], "one": [0, 1]}
    assert seen == [4] and sorted(ns["captions"]) == sorted(want)
    assert torch.equal(ns["target"], _want([want[c] for c in ns["captions"]], 4))
