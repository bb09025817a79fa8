"""What a new user meets at the command line: exit codes (2 usage or input
error, 1 runtime failure), option typos, messages in the command line's
spelling, bench's quality header, the demo's grid."""

from __future__ import annotations

import json
import os
import re
import tempfile

import numpy as np
import pytest
from support.images import make_folder

import mmstore
from mmstore.cli import EXIT_CODES, main
from mmstore.errors import SourceError

pytest.importorskip("cv2")


@pytest.fixture
def photos(tmp_path):
    root = str(tmp_path / "photos")
    make_folder(root, per_class=3)
    return root


def _run(capsys, *argv):
    """main(argv): (exit code, stderr); argparse's own exit counts too."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_usage_and_input_errors_exit_2(tmp_path, photos, capsys):
    listing = tmp_path / "list.csv"
    listing.write_text("path,label\ncat/img000.jpg,x\n")
    cases = {
        "no --size": ["ingest", photos, tmp_path / "a"],
        "no such source": ["ingest", tmp_path / "nonexistent", tmp_path / "b", "--size", "8x8"],
        "unknown codec": ["ingest", photos, tmp_path / "c", "--size", "8x8", "--codec", "image=jpg:90"],
        "no such column": ["ingest", listing, tmp_path / "d", "--size", "8x8", "--root", photos,
                           "--label-column", "nope"],
        "not a store": ["verify", tmp_path / "nonexistent"],
    }
    for what, argv in cases.items():
        rc, err = _run(capsys, *argv)
        assert rc == 2, (what, err)
        assert err.startswith(f"mmstore {argv[0]}: ") and "Traceback" not in err, (what, err)
    assert not any(os.path.exists(tmp_path / n) for n in "abcd")


def test_a_runtime_failure_exits_1(tmp_path, photos, capsys):
    with open(os.path.join(photos, "cat", "broken.jpg"), "wb") as fh:
        fh.write(b"not an image")
    rc, err = _run(capsys, "ingest", photos, tmp_path / "s", "--size", "8x8", "--on-error", "fail", "--workers", "0")
    assert rc == 1, err
    assert "stopped" in err


def test_exit_codes_are_stated_in_the_top_level_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert EXIT_CODES.strip() in out
    assert re.search(r"^\s+1\s+a runtime failure", out, re.M)
    assert re.search(r"^\s+2\s+a usage or input error", out, re.M)


def test_an_option_typo_names_the_command_and_the_nearest_option(tmp_path, photos, capsys):
    rc, err = _run(capsys, "ingest", photos, tmp_path / "s", "--size", "8x8", "--reisze", "pad")
    assert rc == 2
    # the message first, then the command's one-line usage (not the top-level one)
    assert err.startswith("mmstore ingest: error: unrecognized arguments: --reisze pad; did you mean --resize?\n")
    assert err.splitlines()[1].startswith("usage: mmstore ingest ")
    assert not os.path.exists(tmp_path / "s")


def test_an_option_prefix_is_not_taken_for_the_option(tmp_path, photos, capsys):
    rc, err = _run(capsys, "ingest", photos, tmp_path / "s", "--size", "8x8", "--resu")
    assert rc == 2
    assert "unrecognized arguments: --resu; did you mean --resume?" in err
    assert not os.path.exists(tmp_path / "s")
    rc, err = _run(capsys, "verify", tmp_path / "s", "--qui")  # every command's parser
    assert rc == 2 and "did you mean --quick?" in err


def test_messages_use_the_command_line_spelling_there(tmp_path, photos, capsys):
    rc, err = _run(capsys, "ingest", photos, tmp_path / "s")
    assert rc == 2
    assert "pass --size HxW" in err and "size=(" not in err
    # the same error from Python names the keyword (and the flag)
    with pytest.raises(SourceError, match=re.escape("size=(H, W)")):
        mmstore.ingest(photos, str(tmp_path / "s"), quiet=True)
    # merge into an existing store
    part = str(tmp_path / "part")
    assert main(["ingest", photos, part, "--size", "8x8", "-q"]) == 0
    assert main(["ingest", photos, str(tmp_path / "dest"), "--size", "8x8", "-q"]) == 0
    rc, err = _run(capsys, "merge", part, tmp_path / "dest")
    assert rc == 2
    assert "pass --overwrite" in err and "overwrite=True" not in err
    # a partial ingest in the way
    with open(os.path.join(photos, "cat", "broken.jpg"), "wb") as fh:
        fh.write(b"junk")
    assert main(["ingest", photos, str(tmp_path / "p"), "--size", "8x8", "-q", "--on-error", "fail",
                 "--workers", "0", "--chunk", "1"]) == 1
    rc, err = _run(capsys, "ingest", photos, tmp_path / "p", "--size", "8x8", "-q")
    assert rc == 2 and "pass --overwrite to start over" in err and "=True" not in err


def test_bench_header_describes_the_displacement_a_uniform_shuffle_shows(tmp_path, capsys):
    np.save(tmp_path / "a.npy", np.zeros((3000, 2, 2), np.uint8))
    store = str(tmp_path / "a.store")
    assert main(["ingest", str(tmp_path / "a.npy"), store, "-q"]) == 0
    capsys.readouterr()
    argv = ["bench", store, "--samples", "64", "--batch-size", "16", "--paths", "read_batch", "--cache", "warm",
            "--orders", "sequential,permutation"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if ln.startswith("shuffle quality"))
    stated = float(re.search(r"displacement: 0 = sequential, ([\d.]+) = a uniform shuffle", header).group(1))
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[out.splitlines().index(header) + 3:]
            if ln.strip().startswith(("sequential", "permutation"))}
    assert float(rows["sequential"][1]) == 0.0
    assert abs(float(rows["permutation"][1]) - stated) < 0.02, (header, rows)
    assert main(argv + ["--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert abs(rep["quality"]["permutation"]["mean_abs_displacement"] - stated) < 0.02


def test_demo_grid_outlives_the_demo(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the demo's temporary files go here
    capsys.readouterr()
    assert main(["demo", "--images", "10", "--size", "8", "--quick"]) == 0
    out = capsys.readouterr().out
    grid = re.search(r"grid of 16 random records: (\S+\.png)", out).group(1)
    assert os.path.isfile(grid) and os.path.getsize(grid) > 0, out
    with open(grid, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    # nothing else of the demo is left behind: its work folder is gone
    left = [n for n in os.listdir(tmp_path) if n.startswith("mmstore-demo")]
    assert left == [os.path.basename(grid)], left
