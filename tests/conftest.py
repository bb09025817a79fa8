"""Shared fixtures, and how the suite runs in parallel."""

from __future__ import annotations

import compileall
import os
import signal
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Where PYTHONDONTWRITEBYTECODE is set (many container images set it), every run would rewrite
# and compile each test module again, and each of the hundreds of child interpreters the suite
# starts would compile mmstore anew: the suite writes its bytecode caches (git-ignored) anyway.
sys.dont_write_bytecode = False


def pytest_configure(config):
    # a suite started in the background of a non-interactive shell (`cmd &`) inherits SIGINT
    # ignored, and so would every command a test starts and interrupts: Ctrl-C's handler is
    # what a terminal gives, and what the signal tests send SIGINT to
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.flags.dont_write_bytecode and not hasattr(config, "workerinput"):  # once, before any worker
        compileall.compile_dir(os.path.join(REPO, "mmstore"), quiet=2)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per CPU this process may run on (its affinity, so a CPU quota
    set with taskset or a container's cpuset counts), rather than psutil's physical cores,
    which on a VM can be fewer than its CPUs. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` decides first."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return len(os.sched_getaffinity(0))


# Tests that share a costly server, cluster or build run on one pytest-xdist worker (``--dist
# loadgroup``, the README's test command): one Ray cluster at a time on a small machine, one
# Azurite and one build of the docs site per run; everything else is spread test by test.
_XDIST_GROUPS = {"ray_cluster": "ray", "azurite_server": "azurite", "site": "docs-site"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, group in _XDIST_GROUPS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(group))
                break


@pytest.fixture(params=["memmap", "lmdb"])
def backend(request):
    return request.param


@pytest.fixture
def store_dir(tmp_path):
    return os.path.join(str(tmp_path), "s.store")


# the S3 server of the object-storage tests (tests/remote, tests/ray), one per test process
# (each pytest-xdist worker starts its own, on ports of its own)
from support.s3_fixtures import s3, s3_faulty, s3_server  # noqa: E402, F401
