"""SIGKILL of the ingest's main process at random moments (workers must die
with it and release the lock), then resume: byte-identical to an uninterrupted
run. benchmarks/stress_faults.py runs many more seeds."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from support.compare import store_bytes
from support.images import make_source
from support.proc import kill_after, killable_cli


def _argv(src, dest, *extra):
    return ["ingest", src, dest, "--size", "24x24", "--workers", "2", "--quiet", "--chunk", "4", *extra]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_source(str(tmp_path_factory.mktemp("src")), n_per_class=150)


@pytest.fixture(scope="module")
def ref(src, tmp_path_factory):
    """The uninterrupted store, and how long an uninterrupted run takes."""
    dest = str(tmp_path_factory.mktemp("ref") / "s")
    t0 = time.monotonic()
    p = killable_cli(_argv(src, dest))
    p.communicate()
    assert p.returncode == 0
    return store_bytes(dest), time.monotonic() - t0


def resume_until_done(src, dest, timeout=20.0):
    """Resume; a worker of the killed run may hold the lock for a moment."""
    t_end = time.monotonic() + timeout
    while True:
        p = killable_cli(_argv(src, dest, "--resume"))
        _, err = p.communicate()
        if p.returncode == 0:
            return
        if b"another process" not in err or time.monotonic() > t_end:
            raise AssertionError(f"resume failed ({p.returncode}): {err.decode()}")
        time.sleep(0.2)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sigkill_at_a_random_moment_then_resume(src, ref, tmp_path, seed):
    want, duration = ref
    rng = np.random.default_rng(seed)
    dest = str(tmp_path / "s")
    p = killable_cli(_argv(src, dest))
    # a random moment of the writing phase (start-up time varies with load)
    deadline = time.monotonic() + 60
    while not os.path.isdir(dest + ".partial") and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    killed = kill_after(p, float(rng.uniform(0.0, 0.7)) * duration, group=False)
    if not killed:
        assert p.returncode == 0 and store_bytes(dest) == want
        return
    resume_until_done(src, dest)
    assert store_bytes(dest) == want
    assert not os.path.exists(dest + ".partial")
