"""``mmstore demo`` runs end to end on a small size and prints the table."""

from __future__ import annotations

import os
import re

import pytest

from mmstore.cli import main

pytest.importorskip("torch")


def test_demo_small_completes_and_prints_the_table(tmp_path, capsys):
    work = str(tmp_path / "w")
    rc = main(["demo", "--images", "60", "--size", "32", "--quick", "--workdir", work, "--keep"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "60 records, 4 skipped" in out
    assert "OK: structure and 64 slots verified" in out
    for row in ("JPEG folder, cv2.imread", "store, StoreDataset", "store, Loader", "warm() then Loader"):
        line = next(ln for ln in out.splitlines() if row in ln)
        rates = [float(t.replace(",", "")) for t in line.split(row)[1].split() if re.fullmatch(r"\d[\d,]*", t)]
        assert len(rates) == 2 and all(r > 0 for r in rates), line
    assert re.search(r"loss \d+\.\d+ -> \d+\.\d+", out)
    assert os.path.exists(os.path.join(work, "grid.png"))
    assert "mmstore ingest /path/to/train" in out


def test_demo_cleans_up_its_workdir(tmp_path, capsys):
    work = str(tmp_path / "w")
    assert main(["demo", "--images", "20", "--size", "16", "--quick", "--workdir", work]) == 0
    assert os.listdir(work) == []
