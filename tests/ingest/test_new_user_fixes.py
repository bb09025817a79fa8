"""Ingest as a new user meets it: a refused resume says what changed, a run
stopped by --max-errors says how to go on, an empty DEST directory is used,
from_dataset says what it needs of an iterable."""

from __future__ import annotations

import os
import shlex

import numpy as np
import pytest

import mmstore
from mmstore.errors import DestinationError, ResumeMismatchError, SourceError


def _broken(root: str, n: int = 1) -> None:
    for k in range(n):
        with open(os.path.join(root, "cat", f"broken{k}.jpg"), "wb") as fh:
            fh.write(b"junk")


def _interrupted(h, tmp_path, capsys):
    root = str(tmp_path / "src")
    h.make_folder(root, per_class=3, seed=1)
    _broken(root)
    dest = str(tmp_path / "d")
    assert h.cli("ingest", root, dest, "--size", "8x8", "--on-error", "fail", "-q", "--chunk", "1",
                 "--workers", "0") == 1
    assert os.path.isdir(dest + ".partial")
    capsys.readouterr()
    return root, dest


def test_a_refused_resume_says_what_changed(tmp_path, h, capsys):
    root, dest = _interrupted(h, tmp_path, capsys)
    assert h.cli("ingest", root, dest, "--size", "12x16", "-q", "--resume") == 2  # a usage error: fix the command
    err = capsys.readouterr().err
    assert "cannot resume" in err and "size was 8x8, now 12x16" in err, err
    assert "{" not in err and "[" not in err.split("now 12x16", 1)[1]  # no JSON cut mid-structure
    assert h.cli("ingest", root, dest, "--size", "8x8", "--resize", "pad", "-q", "--resume") == 2
    err = capsys.readouterr().err
    assert 'resize was "center-crop", now "pad"' in err and " size was" not in err, err
    with pytest.raises(ResumeMismatchError, match="bgr was false, now true"):
        mmstore.ingest(root, dest, (8, 8), bgr=True, resume=True, quiet=True)


def test_a_max_errors_stop_says_to_raise_the_limit_and_gives_a_command_that_goes_on(tmp_path, h, capsys):
    root = str(tmp_path / "src")
    h.make_folder(root, per_class=4, seed=2)
    _broken(root, 3)
    dest = str(tmp_path / "d")
    assert h.cli("ingest", root, dest, "--size", "8x8", "--max-errors", "1", "--chunk", "1", "--workers", "0") == 1
    err = capsys.readouterr().err
    assert "raise the limit" in err, err
    cmd = err.split("resume with: ", 1)[1].rsplit(")", 1)[0]
    argv = shlex.split(cmd)
    assert argv[:2] == ["mmstore", "ingest"] and "--resume" in argv
    limit = argv[argv.index("--max-errors") + 1]
    assert int(limit) > 1, cmd  # not the same command again
    assert h.cli(*argv[1:]) == 0
    s = mmstore.open(dest)
    assert s.slots == 11 and s.records == 8
    # --on-error fail: the advice switches to skip with a limit
    dest2 = str(tmp_path / "d2")
    assert h.cli("ingest", root, dest2, "--size", "8x8", "--on-error", "fail", "--chunk", "1", "--workers", "0") == 1
    err = capsys.readouterr().err
    cmd = err.split("resume with: ", 1)[1].rsplit(")", 1)[0]
    assert "--on-error fail" not in cmd and "--max-errors" in cmd, cmd
    assert h.cli(*shlex.split(cmd)[1:]) == 0


def test_an_empty_existing_dest_directory_is_used(tmp_path, h, folder, capsys):
    root, _ = folder
    for extra in ([], ["--overwrite"]):
        dest = tmp_path / f"empty{len(extra)}"
        dest.mkdir()
        assert h.cli("ingest", root, str(dest), "--size", "8x8", "-q", *extra) == 0, capsys.readouterr().err
        assert mmstore.open(str(dest)).records == 12
    dest = tmp_path / "py"
    dest.mkdir()
    mmstore.ingest(root, str(dest), (8, 8), quiet=True)
    assert mmstore.open(str(dest)).records == 12


def test_a_non_empty_dest_that_is_not_a_store_is_refused_with_one_advice(tmp_path, h, folder, capsys):
    root, _ = folder
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    capsys.readouterr()
    for extra in ([], ["--overwrite"]):
        assert h.cli("ingest", root, str(dest), "--size", "8x8", "-q", *extra) == 2
        err = capsys.readouterr().err
        assert "not an mmstore store" in err and "pass --overwrite" not in err, err
    with pytest.raises(DestinationError):
        mmstore.ingest(root, str(dest), (8, 8), quiet=True)
    assert os.listdir(dest) == ["notes.txt"]


class _NoIndex:
    """Iterable with a length but no ds[i]."""

    def __len__(self):
        return 2

    def __iter__(self):
        return iter([np.zeros((4, 4, 3), np.uint8)] * 2)


@pytest.mark.parametrize("make", [lambda: (np.zeros((4, 4, 3), np.uint8) for _ in range(3)),
                                  lambda: iter([np.zeros((4, 4, 3), np.uint8)]),
                                  _NoIndex],
                         ids=["generator", "iterator", "no-getitem"])
def test_from_dataset_says_it_needs_a_map_style_dataset(tmp_path, make):
    with pytest.raises(SourceError, match=r"map-style dataset \(len\(ds\) and ds\[i\].*list\(ds\)"):
        mmstore.from_dataset(make(), str(tmp_path / "s"), quiet=True)
    assert not os.path.exists(tmp_path / "s") and not os.path.exists(tmp_path / "s.partial")
    # what the message suggests works
    mmstore.from_dataset(list(make()), str(tmp_path / "s"), workers=0, quiet=True)
    assert mmstore.open(str(tmp_path / "s")).records >= 1


def test_from_dataset_refuses_a_torch_iterable_dataset(tmp_path):
    torch_data = pytest.importorskip("torch.utils.data")

    class Stream(torch_data.IterableDataset):
        def __iter__(self):
            yield np.zeros((4, 4, 3), np.uint8)

    with pytest.raises(SourceError, match="an iterable dataset"):
        mmstore.from_dataset(Stream(), str(tmp_path / "s"), quiet=True)
