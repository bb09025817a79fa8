"""Replacing a local store keeps what a user wrote: a file put inside the old store's directory
(notes beside the data) is never deleted by ``pull --overwrite`` or ``ingest --overwrite``; the
command refuses, naming the file, and changes nothing."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.proc import run_cli
from support.stores import write_store

import mmstore
from mmstore.errors import DestinationError


def _tree(root) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def _with_notes(path) -> dict[str, bytes]:
    with open(os.path.join(path, "NOTES.txt"), "w") as f:
        f.write("where this data came from\n")
    return _tree(path)


def test_pull_overwrite_refuses_a_store_holding_a_users_file_and_changes_nothing(s3, tmp_path, capsys):
    from mmstore.transfer import push

    push(write_store(tmp_path / "a.store", 6), s3.url("a.store"))
    old = write_store(tmp_path / "old.store", 4)
    before = _with_notes(old)
    rc, out, err = run_cli(["pull", s3.url("a.store"), old, "--overwrite"], capsys)
    assert rc == 2, err
    assert "NOTES.txt" in err and "move them out" in err, err
    assert _tree(old) == before  # the notes and the old store, untouched
    assert not os.path.exists(old + ".partial")
    os.rename(os.path.join(old, "NOTES.txt"), tmp_path / "NOTES.txt")  # what the message says to do
    rc, out, err = run_cli(["pull", s3.url("a.store"), old, "--overwrite"], capsys)
    assert rc == 0, err
    assert len(mmstore.open(old)) == 6


def test_ingest_overwrite_refuses_a_store_holding_a_users_file(tmp_path):
    old = write_store(tmp_path / "old.store", 4)
    before = _with_notes(old)
    with pytest.raises(DestinationError, match="NOTES.txt"):
        mmstore.from_dataset([{"x": np.full(3, i, np.uint8)} for i in range(5)], old, overwrite=True)
    assert _tree(old) == before
