"""Store locations that are URL mistakes: a bucket without a store path, a scheme alone, a scheme
mmstore does not read, one slash after the colon. Each is a usage error (exit 2) that says what a
store URL looks like, through every command that takes a store location and through
``mmstore.open``; never an internal error, never a local path. A local directory whose name holds
a colon still opens."""

from __future__ import annotations

import os

import pytest
from support.proc import run_cli
from support.stores import write_store

import mmstore
from mmstore.errors import StoreURLError

NO_STORE_PATH = ["s3://bucket", "s3://bucket/", "s3://", "gs://", "az://", "gs://bucket", "https://host"]
NOT_URLS = ["ftp://host/x.store", "s4://bucket/x.store", "s3:/bucket/x.store", "S3:/bucket/x.store",
            "gs:/bucket/x.store", "s3:bucket/x.store"]


def _commands(loc: str, tmp_path) -> list[list[str]]:
    """Every command that takes a store location, with ``loc`` as that location."""
    src = str(tmp_path / "src.store")
    return [["inspect", loc], ["verify", loc], ["show", loc, "-o", str(tmp_path / "grid.png")],
            ["pull", loc, str(tmp_path / "dest.store")], ["push", src, loc]]


@pytest.fixture
def src(tmp_path) -> str:
    return write_store(tmp_path / "src.store", 8)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("loc", NO_STORE_PATH)
def test_a_url_without_a_bucket_or_store_path_is_a_usage_error_saying_what_a_store_url_is(
        loc, src, tmp_path, capsys):
    for argv in _commands(loc, tmp_path):
        rc, out, err = run_cli(argv, capsys)
        line = _one_line(err)
        assert rc == 2, (argv, err)
        assert "expected" in line and "/PATH/NAME.store" in line, (argv, line)
        assert "unexpected" not in line and "report it" not in line, (argv, line)
    with pytest.raises(StoreURLError, match="PATH/NAME.store"):
        mmstore.open(loc)


@pytest.mark.parametrize("loc", NOT_URLS)
def test_an_unsupported_or_one_slash_url_is_refused_as_a_url_never_taken_as_a_path(loc, src, tmp_path, capsys,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv in [*_commands(loc, tmp_path), ["push", loc, "s3://bucket/x.store"],
                 ["pull", "s3://bucket/x.store", loc]]:
        rc, out, err = run_cli(argv, capsys)
        line = _one_line(err)
        assert rc == 2, (argv, err)
        assert "s3://" in line and "no such store" not in line and "unexpected" not in line, (argv, line)
    assert not os.listdir(tmp_path / "src.store") == []  # nothing was made or removed
    assert sorted(os.listdir(tmp_path)) == ["src.store"]
    with pytest.raises(StoreURLError, match="s3://") as info:
        mmstore.open(loc)
    assert "./" + loc in str(info.value)  # the way to name a local directory of that name, tried below


def test_unknown_schemes_are_named_with_the_supported_ones(capsys, tmp_path):
    rc, _, err = run_cli(["inspect", "ftp://host/x.store"], capsys)
    assert rc == 2
    for scheme in ("s3://", "gs://", "az://", "https://"):
        assert scheme in err, err
    assert "ftp://" in err


def test_local_paths_with_a_colon_still_open(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plain = write_store(tmp_path / "run:2024.store", 5)  # a colon that starts no scheme
    assert len(mmstore.open("run:2024.store")) == 5
    rc, out, err = run_cli(["inspect", "run:2024.store"], capsys)
    assert rc == 0, err
    os.makedirs(tmp_path / "s3:")
    write_store(tmp_path / "s3:" / "x.store", 6)  # what the refusal above says to write: ./s3:/x.store
    assert len(mmstore.open("./s3:/x.store")) == 6
    rc, out, err = run_cli(["verify", "./s3:/x.store"], capsys)
    assert rc == 0, err
    assert len(mmstore.open(os.path.abspath("s3:/x.store"))) == 6
    assert len(mmstore.open(f"file://{plain}")) == 5


def _images(root) -> str:
    import cv2
    import numpy as np

    os.makedirs(root)
    cv2.imwrite(os.path.join(root, "a.png"), np.zeros((8, 8, 3), np.uint8))
    return os.fspath(root)


def test_a_url_where_a_local_store_is_written_is_refused_never_made_a_directory_named_s3(src, tmp_path, capsys,
                                                                                      monkeypatch):
    """ingest, merge, convert and pull write local stores: a store URL as their destination is a
    usage error saying how a store gets into a bucket, and nothing is created (``./s3:/b/...``
    before: os.path.abspath turned ``s3://b`` into ``s3:/b``)."""
    imgs = _images(tmp_path / "imgs")
    monkeypatch.chdir(tmp_path)
    for argv in [["pull", "s3://bucket/x.store", "s3://bucket/y.store"],
                 ["ingest", imgs, "s3://bucket/i.store", "--size", "8"],
                 ["merge", src, src, "s3://bucket/m.store"],
                 ["convert", src, "gs://bucket/c.store", "--backend", "lmdb"]]:
        rc, out, err = run_cli(argv, capsys)
        line = _one_line(err)
        assert rc == 2, (argv, err)
        assert "writes a store to a local directory" in line and "mmstore push" in line, (argv, line)
    assert sorted(os.listdir(tmp_path)) == ["imgs", "src.store"]
    with pytest.raises(StoreURLError, match="mmstore push"):
        mmstore.merge([src, src], "s3://bucket/m.store")


BAD_BUCKETS = {"s3://a b/x.store": "a space", "s3://a%20b/x.store": "'%'", "gs://a\tb/x.store": "a control",
               "s3://bucket/x.store%0A": "control character", "s3://bucket/x.store\n": "control character"}
ENDPOINT_IN_URL = ["s3://user@bucket/x.store", "s3://user:secret@bucket/x.store", "s3://bucket:9000/x.store"]


@pytest.mark.parametrize("loc", [*BAD_BUCKETS, *ENDPOINT_IN_URL])
def test_a_malformed_bucket_is_one_usage_error_worded_alike_by_every_command(loc, src, tmp_path, capsys):
    """A space in a bucket name was a panic of the object-store client with its backtrace (exit 1),
    and push worded a bad URL its own way: now every command gives the same one line, exit 2."""
    lines = set()
    for argv in _commands(loc, tmp_path):
        rc, out, err = run_cli(argv, capsys)
        line = _one_line(err)
        assert rc == 2, (argv, err)
        assert "panic" not in line and "unexpected" not in line, (argv, line)
        lines.add(line.split(": ", 1)[1])  # without "mmstore COMMAND: "
    assert len(lines) == 1, lines
    (line,) = lines
    if loc in BAD_BUCKETS:
        assert BAD_BUCKETS[loc] in line, line
    else:
        assert "AWS_ENDPOINT_URL" in line and "secret" not in line, line
    with pytest.raises(StoreURLError):
        mmstore.open(loc)


@pytest.mark.parametrize("loc", ["s3://My_Legacy.Bucket-1/x.store", "s3://bucket/a b.store",
                                 "abfs://container@account.dfs.core.windows.net/x.store"])
def test_real_bucket_names_and_keys_with_spaces_still_parse(loc):
    from mmstore.remote.url import parse_url

    assert parse_url(loc).prefix.endswith(".store")
