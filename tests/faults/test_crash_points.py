"""Crash at every numbered write, fsync, commit and rename of a small ingest, in
turn (as SQLite's crash tests do). After each crash the destination is absent,
a ``.partial`` that resumes, or a complete store with the right bytes; resume
always ends byte-identical to an uninterrupted run."""

from __future__ import annotations

import os
import shutil

import pytest
from support.compare import store_bytes
from support.faults import CRASHED, content_ok, ingest_argv, run_forked

PHASES = ("write", "fsync", "commit", "rename")


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory):
    out = {}
    for backend in ("memmap", "lmdb"):
        dest = str(tmp_path_factory.mktemp("ref") / backend)
        assert run_forked(ingest_argv(src, dest, "--backend", backend)) == 0
        out[backend] = store_bytes(dest)
    return out


def _walk_crash_points(src, tmp_path, ref, backend, phase, stride=1):
    """Crash at k = 1, 1+stride, ... until a run completes; returns the count."""
    k, tried = 1, 0
    while True:
        dest = os.path.join(tmp_path, f"{phase}-{k}")
        rc = run_forked(ingest_argv(src, dest, "--backend", backend), crash=f"{phase}:{k}")
        if rc == 0:
            assert store_bytes(dest) == ref
            return tried
        assert rc == CRASHED, f"{phase}:{k} exited {rc}, expected a crash ({CRASHED})"
        tried += 1
        if os.path.exists(dest):
            # a complete store may only appear with the final bytes (crash after publish)
            assert os.path.exists(os.path.join(dest, "manifest.json")), f"{phase}:{k}: store without manifest"
            assert store_bytes(dest) == ref, f"{phase}:{k}: complete-looking store with wrong data"
            assert content_ok(dest)
        else:
            assert run_forked(ingest_argv(src, dest, "--backend", backend, "--resume")) == 0, \
                f"{phase}:{k}: resume failed"
            assert store_bytes(dest) == ref, f"{phase}:{k}: resumed store differs"
            assert not os.path.exists(dest + ".partial")
        shutil.rmtree(dest, ignore_errors=True)
        k += stride


# every point of the fsync/commit/rename phases; data writes every 3rd point
# here (all of them in benchmarks/stress_faults.py)
STRIDE = {"write": 3, "fsync": 1, "commit": 1, "rename": 1}


@pytest.mark.parametrize("phase", PHASES)
def test_every_crash_point_resumes_identically_memmap(src, reference, tmp_path, phase):
    tried = _walk_crash_points(src, str(tmp_path), reference["memmap"], "memmap", phase, STRIDE[phase])
    assert tried >= 1, f"no {phase} crash point was reached"


@pytest.mark.parametrize("phase", ("write", "commit", "rename"))
def test_every_crash_point_resumes_identically_lmdb(src, reference, tmp_path, phase):
    tried = _walk_crash_points(src, str(tmp_path), reference["lmdb"], "lmdb", phase, STRIDE[phase])
    assert tried >= 1


def test_regression_lmdb_staging_removed_before_manifest(src, reference, tmp_path):
    """Bug found by this suite: lmdb finalize deleted its staging file before
    the manifest was durable, so a crash at the next fsync left a .partial whose
    resume failed with 'No such file ... _staging.npy'. Every fsync point of an
    lmdb ingest must now resume."""
    assert _walk_crash_points(src, str(tmp_path), reference["lmdb"], "lmdb", "fsync") >= 10
