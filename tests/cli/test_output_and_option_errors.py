"""What a new user meets first at the command line: a pipe closed early
(``| head -1``), an option error, the target size, and the commands a
message tells them to run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import mmstore
from mmstore.cli import EXIT_CODES, EXIT_OUTPUT_CLOSED, main


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("cli-store")
    np.save(d / "a.npy", np.random.default_rng(0).integers(0, 255, (40, 8, 8, 3), dtype=np.uint8))
    path = str(d / "s.store")
    assert main(["ingest", str(d / "a.npy"), path, "-q", "--workers", "0"]) == 0
    return path


def _run(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


# ---------------------------------------------------------------------------
# a reader that goes away: `mmstore show STORE | head -1`


@pytest.mark.parametrize("argv", [["inspect", "{store}"], ["inspect", "{store}", "--json"], ["verify", "{store}"],
                                  ["show", "{store}", "-o", "{tmp}/grid.png", "-n", "4"]],
                         ids=["inspect", "inspect-json", "verify", "show"])
def test_a_pipe_closed_early_ends_the_command_quietly(store, tmp_path, argv):
    argv = [a.format(store=store, tmp=tmp_path) for a in argv]
    proc = subprocess.Popen([sys.executable, "-m", "mmstore", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the command prints its first line
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == EXIT_OUTPUT_CLOSED == 141, err
    assert err == "", err  # no "I/O error: Broken pipe", no "Exception ignored"


def test_a_pipe_read_to_its_end_is_a_success(store):
    r = subprocess.run([sys.executable, "-m", "mmstore", "inspect", store], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("store ") and r.stderr == ""


def test_the_exit_code_of_a_closed_output_is_stated_in_the_help():
    assert re.search(r"^\s+141\s+the reader of the output went away", EXIT_CODES, re.M)


# ---------------------------------------------------------------------------
# an option error: the message first, one line of usage, no 20-line usage block


def test_an_option_error_says_what_is_wrong_first(tmp_path, capsys):
    rc, err = _run(capsys, "ingest", tmp_path / "in", tmp_path / "out", "--sise", "64")
    assert rc == 2
    lines = err.splitlines()
    assert lines[0] == "mmstore ingest: error: unrecognized arguments: --sise 64; did you mean --size?"
    assert lines[1:] == ["usage: mmstore ingest source dest [options] (see mmstore ingest --help)"]


@pytest.mark.parametrize("argv, first", [
    (["inspect"], "mmstore inspect: error: the following arguments are required: STORE"),
    (["ingest", "a", "b", "--resize", "crop"], "mmstore ingest: error: argument --resize: invalid choice: 'crop'"),
    (["nosuch"], "mmstore: error: argument COMMAND: invalid choice: 'nosuch'"),
])
def test_every_parser_error_is_two_lines_message_first(capsys, argv, first):
    rc, err = _run(capsys, *argv)
    lines = err.splitlines()
    assert rc == 2 and lines[0].startswith(first) and len(lines) == 2, err
    assert lines[1].startswith("usage: mmstore") and lines[1].endswith("--help)")


# ---------------------------------------------------------------------------
# the target size: HxW, or N for NxN, the same in help, errors and behaviour


def test_size_n_is_n_by_n_and_the_help_says_so(tmp_path, capsys):
    cv2 = pytest.importorskip("cv2")
    os.makedirs(tmp_path / "photos")
    cv2.imwrite(str(tmp_path / "photos" / "a.png"), np.full((30, 50, 3), 90, np.uint8))
    assert main(["ingest", str(tmp_path / "photos"), str(tmp_path / "s"), "--size", "16", "-q",
                 "--workers", "0"]) == 0
    with mmstore.open(str(tmp_path / "s")) as s:
        assert s[0]["image"].shape == (16, 16, 3)
    with pytest.raises(SystemExit):
        main(["ingest", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--size HxW target size: HxW such as 224x224, or N for NxN" in text


@pytest.mark.parametrize("size", ["16x", "x16", "0", "16x0", "16x16x3", "a"])
def test_a_bad_size_on_the_command_line_says_what_is_accepted(tmp_path, capsys, size):
    pytest.importorskip("cv2")
    os.makedirs(tmp_path / "photos")
    rc, err = _run(capsys, "ingest", tmp_path / "photos", tmp_path / "s", "--size", size)
    assert rc == 2, err
    assert err.strip() == f"mmstore ingest: size must be HxW such as 224x224, or N for NxN; got {size!r}"
    assert not os.path.exists(tmp_path / "s")


@pytest.mark.parametrize("size, error", [((64,), ValueError), ((64, 64, 3), ValueError), ((0, 8), ValueError),
                                         ((8.0, 8.0), ValueError), (8.0, TypeError), (True, TypeError)])
def test_a_bad_size_in_python_says_what_is_expected(tmp_path, size, error):
    np.save(tmp_path / "a.npy", np.zeros((2, 4, 4, 3), np.uint8))
    with pytest.raises(error, match=re.escape("an int N (for N x N) or an (H, W) pair of positive ints")) as e:
        mmstore.ingest(str(tmp_path / "a.npy"), str(tmp_path / "s"), size=size, quiet=True, workers=0)
    assert "unpack" not in str(e.value)
    assert not os.path.exists(tmp_path / "s")


def test_no_size_for_images_names_both_spellings(tmp_path, capsys):
    pytest.importorskip("cv2")
    import cv2

    os.makedirs(tmp_path / "photos")
    cv2.imwrite(str(tmp_path / "photos" / "a.png"), np.zeros((4, 4, 3), np.uint8))
    rc, err = _run(capsys, "ingest", tmp_path / "photos", tmp_path / "s")
    assert rc == 2 and "pass --size HxW (or --size N for N x N)" in err


# ---------------------------------------------------------------------------
# the commands a message tells the user to run exist and do what it says


def test_the_ray_summary_points_to_commands_that_exist(tmp_path, capsys):
    pytest.importorskip("ray.data")
    pytest.importorskip("cv2")
    from mmstore.ray.sink import RayWriteResult

    folder = tmp_path / "photos"
    os.makedirs(folder)
    import cv2

    cv2.imwrite(str(folder / "a.png"), np.zeros((8, 8, 3), np.uint8))
    (folder / "b.png").write_bytes(b"not an image")
    store = str(tmp_path / "s.store")
    res = mmstore.ingest(str(folder), store, size=4, quiet=True, workers=0)
    assert res.skipped == 1
    opened = mmstore.open(store)
    reasons = Counter(r["reason"] for r in opened.skipped())
    opened.close()
    text = RayWriteResult(store, 2, 1, 1, 1, reasons).summary()
    details = next(ln for ln in text.splitlines() if ln.startswith("details"))
    path = re.search(r"details \(slot, key, reason\): (\S+)", details)
    assert path and os.path.isfile(path.group(1))
    with open(path.group(1), encoding="utf-8") as fh:
        assert "b.png" in fh.read()
    commands = re.findall(r"mmstore ([a-z]+ [^;)]*)", details)
    assert commands, details
    for command in commands:
        rc, _ = _run(capsys, *shlex.split(command))
        assert rc == 0, command
    reason = next(iter(reasons)).split(":", 1)[0]
    assert main(["inspect", store]) == 0 and reason in capsys.readouterr().out
