"""Inputs or parameters that changed between an interrupted run and its resume
are detected and refused; restoring them lets the resume finish."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from support.compare import store_bytes
from support.faults import CRASHED, ingest_argv, run_forked
from support.images import make_source
from support.proc import cli


@pytest.fixture
def interrupted(tmp_path):
    src = make_source(str(tmp_path / "src"), n_per_class=3)
    ref = str(tmp_path / "ref")
    assert run_forked(ingest_argv(src, ref)) == 0
    dest = str(tmp_path / "s")
    assert run_forked(ingest_argv(src, dest), crash="commit:2") == CRASHED
    assert os.path.isdir(dest + ".partial")
    return src, dest, ref


def _refused(src, dest, *extra):
    return cli(*ingest_argv(src, dest, "--resume", *extra))


def test_file_added(interrupted, capsys):
    src, dest, ref = interrupted
    shutil.copy(os.path.join(src, "ant", "000.jpg"), os.path.join(src, "ant", "001b.jpg"))
    assert _refused(src, dest) != 0
    assert "cannot resume" in capsys.readouterr().err.lower()
    os.unlink(os.path.join(src, "ant", "001b.jpg"))
    assert run_forked(ingest_argv(src, dest, "--resume")) == 0
    assert store_bytes(dest) == store_bytes(ref)


def test_file_removed(interrupted, capsys):
    src, dest, _ = interrupted
    os.unlink(os.path.join(src, "bee", "002.jpg"))
    assert _refused(src, dest) != 0
    assert "cannot resume" in capsys.readouterr().err.lower()


def test_file_modified_same_size(interrupted, capsys):
    src, dest, _ = interrupted
    p = os.path.join(src, "ant", "001.png")
    with open(p, "rb") as fh:
        data = bytearray(fh.read())
    data[-20] ^= 1
    time.sleep(0.01)
    with open(p, "wb") as fh:
        fh.write(bytes(data))
    assert _refused(src, dest) != 0
    assert "cannot resume" in capsys.readouterr().err.lower()


@pytest.mark.parametrize("extra", [("--size", "20x20"), ("--resize", "stretch"), ("--channels", "1"),
                                   ("--backend", "lmdb"), ("--layout", "chw")])
def test_different_parameters(interrupted, capsys, extra):
    src, dest, _ = interrupted
    assert _refused(src, dest, *extra) != 0
    err = capsys.readouterr().err.lower()
    assert "cannot resume" in err
