"""A URL whose bucket does not exist gets one sentence from every command that reads or
writes it: ``inspect``, ``pull``, ``verify`` and ``push`` (real S3 server on loopback)."""

from __future__ import annotations

import pytest
from support.proc import run_cli
from support.stores import write_store

pytest.importorskip("obstore")


def test_every_command_names_a_missing_bucket_in_the_same_words(s3, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MMSTORE_CACHE_DIR", str(tmp_path / "cache"))
    src = write_store(tmp_path / "src.store", 20)
    url = "s3://nosuchbucket-mmstore/x.store"
    said = {}
    for argv in (["inspect", url], ["pull", url, str(tmp_path / "dest.store")], ["verify", url],
                 ["verify", url, "--deep"], ["push", src, url]):
        rc, out, err = run_cli(argv, capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and out == "" and len(lines) == 1, (argv, rc, err)  # a usage error: the URL is wrong
        prefix = f"mmstore {argv[0]}: "
        assert lines[0].startswith(prefix), (argv, err)
        said[" ".join(argv[:1] + argv[2:])] = lines[0][len(prefix):]
    assert len(set(said.values())) == 1, said
    assert said["inspect"] == f"{url}: no such bucket 'nosuchbucket-mmstore': check the URL", said
    assert not (tmp_path / "dest.store").exists()
