"""Disk full: EFBIG from RLIMIT_FSIZE and real ENOSPC on a small tmpfs. A clean
error naming the cause, no SIGBUS, nothing published; after space is freed,
resume completes identically. LMDB: a map that is too small is grown."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support.compare import store_bytes
from support.faults import content_ok, ingest_argv, mount_tmpfs, run_forked, umount
from support.images import make_source
from support.proc import cli_env, run_sub

import mmstore


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_source(str(tmp_path_factory.mktemp("src")), n_per_class=4)


def _argv(src, dest, *extra):
    return ingest_argv(src, dest, "--size", "48x48", *extra)  # later --size wins


@pytest.fixture(scope="module")
def ref(src, tmp_path_factory):
    dest = str(tmp_path_factory.mktemp("ref") / "s")
    assert run_forked(_argv(src, dest)) == 0
    return dest


def _run_limited(argv, limit):
    code = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        from mmstore.cli import main
        sys.exit(main({argv!r}))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env())


@pytest.mark.parametrize("limit", [2000, 30_000, 60_000])
def test_efbig_is_clean_and_resume_completes_identically(src, ref, tmp_path, limit):
    dest = str(tmp_path / "s")
    r = _run_limited(_argv(src, dest), limit)
    assert r.returncode not in (0, -7, -25), r.stderr  # failed, but not by SIGBUS/SIGXFSZ
    assert "File too large" in r.stderr or "Errno 27" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not os.path.exists(dest)
    assert run_forked(_argv(src, dest, "--resume")) == 0
    assert store_bytes(dest) == store_bytes(ref)


def test_enospc_on_a_small_tmpfs_then_space_freed(src, ref, tmp_path):
    mnt = str(tmp_path / "mnt")
    need = sum(os.path.getsize(os.path.join(ref, n)) for n in os.listdir(ref))
    if not mount_tmpfs(mnt, 16 * 1024):
        pytest.skip("mounting a tmpfs is not permitted here; RLIMIT_FSIZE covers EFBIG")
    try:
        dest = os.path.join(mnt, "s")
        r = run_sub(_argv(src, dest), timeout=300)
        assert r.returncode not in (0, -7), r.stderr
        assert "No space left" in r.stderr or "Errno 28" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not os.path.exists(dest)
        subprocess.run(["mount", "-o", f"remount,size={need * 3 + (1 << 20)}", mnt], check=True)
        assert run_forked(_argv(src, dest, "--resume")) == 0
        assert store_bytes(dest) == store_bytes(ref)
    finally:
        umount(mnt)


def test_lmdb_map_too_small_is_grown(src, tmp_path):
    def tiny_map():
        import mmstore.store.backends.lmdb as lb

        lb.lmdb_map_size = lambda record_bytes, records: 32 * 1024

    dest = str(tmp_path / "l")
    assert run_forked(_argv(src, dest, "--backend", "lmdb"), setup=tiny_map) == 0
    assert content_ok(dest)
    ref = str(tmp_path / "m")
    assert run_forked(_argv(src, ref)) == 0
    a, b = mmstore.open(dest), mmstore.open(ref)
    for k in a.fields:
        np.testing.assert_array_equal(a.column(k), b.column(k))
    shutil.rmtree(dest)


def test_lmdb_file_over_the_size_limit_names_the_cause(src, tmp_path):
    """Building records.mdb past RLIMIT_FSIZE: liblmdb says
    only "Input/output error", and a failed put used to surface as an
    "unexpected" BufferError. Now convert and ingest say the file size limit
    was reached; ingest keeps its work and --resume completes it."""
    plain = str(tmp_path / "plain")
    assert run_forked(_argv(src, plain)) == 0
    data = os.path.getsize(os.path.join(plain, "image.npy"))
    limit = data + 2048  # the staging copy fits; records.mdb (a 6,912-byte record takes two 4 KiB pages) not
    r = _run_limited(["convert", plain, str(tmp_path / "c"), "--backend", "lmdb", "--no-progress"], limit)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "unexpected" not in r.stderr, r.stderr
    assert "records.mdb" in r.stderr and "file size limit" in r.stderr, r.stderr
    assert not os.path.exists(str(tmp_path / "c"))
    dest = str(tmp_path / "l")
    r = _run_limited(_argv(src, dest, "--backend", "lmdb"), limit)
    assert r.returncode == 1 and "unexpected" not in r.stderr and "File too large" in r.stderr, r.stderr
    assert run_forked(_argv(src, dest, "--backend", "lmdb", "--resume")) == 0
    a, b = mmstore.open(plain), mmstore.open(dest)
    np.testing.assert_array_equal(a.read_batch(np.arange(len(a)))["image"], b.read_batch(np.arange(len(b)))["image"])
