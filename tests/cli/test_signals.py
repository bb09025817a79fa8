"""SIGINT and SIGTERM stop every command the same way: one line, exit 130, within about a second,
even while a request to the bucket is stalled (the request is abandoned, never waited for);
an interrupted pull resumes on the next run. Real child processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from support.proc import popen_cli
from support.stores import write_store

import mmstore
from mmstore.transfer import push


def _stalled(proxy, timeout: float = 30.0) -> None:
    """Wait until the child has requests held by the proxy and sends no more."""
    deadline = time.monotonic() + timeout
    seen, since = proxy.requests, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if proxy.requests != seen:
            seen, since = proxy.requests, time.monotonic()
        elif seen and time.monotonic() - since > 0.6:
            return
    raise AssertionError("the child never reached the stalled request")


def _stop(proc: subprocess.Popen, sig: int) -> tuple[int, str, float]:
    t = time.monotonic()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"still running 20 s after signal {sig}") from None
    return proc.returncode, err.decode(errors="replace"), time.monotonic() - t


@pytest.mark.parametrize("sig, stall", [(signal.SIGINT, "image"), (signal.SIGTERM, "manifest")])
def test_a_pull_stalled_on_a_request_stops_at_once_with_130_and_the_rerun_completes(sig, stall, s3_faulty, tmp_path):
    """Before: a stalled request held the pull until it ended (the request timeout, 120 s), and
    SIGTERM killed it by the signal (-15) with no message."""
    src = write_store(tmp_path / "src.store", 40)
    url = s3_faulty.url("src.store")
    push(src, url)
    dest = tmp_path / "dest.store"
    proxy = s3_faulty.proxy
    proxy.set_delay(60, method="GET", path=stall)
    proc = popen_cli(["pull", url, dest, "--quiet"], env=s3_faulty.env, stdout=subprocess.DEVNULL,
                     stderr=subprocess.PIPE)
    _stalled(proxy)
    rc, err, took = _stop(proc, sig)
    assert rc == 130, (rc, err)
    assert err.strip() == "mmstore pull: interrupted", err
    assert took < 5, took
    proxy.clear()
    rerun = subprocess.run(proc.args, env=proc_env(s3_faulty), capture_output=True, text=True, timeout=60)
    assert rerun.returncode == 0, rerun.stderr
    assert len(mmstore.open(dest)) == 40
    assert not os.path.exists(f"{dest}.partial")


def proc_env(bucket) -> dict[str, str]:
    from support.proc import cli_env

    return cli_env(**bucket.env)


def test_main_puts_the_signal_handlers_back(tmp_path, capsys):
    """``main`` may run in-process (as here): the handlers it sets for a command are the caller's
    again once it returns."""
    from mmstore.cli import main

    store = write_store(tmp_path / "a.store", 4)
    mine = lambda signum, frame: None  # noqa: E731
    old = signal.signal(signal.SIGTERM, mine)
    try:
        assert main(["inspect", store]) == 0
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.mark.parametrize("argv, stall, sig", [(["inspect"], "manifest", signal.SIGTERM),
                                              (["verify"], "_remote", signal.SIGINT)])
def test_inspect_and_verify_of_a_stalled_url_stop_at_once_with_130(argv, stall, sig, s3_faulty, tmp_path):
    """Before: the stalled request held the command until it ended (SIGINT), or SIGTERM ended it
    by the signal (-15) with no message."""
    src = write_store(tmp_path / "src.store", 40)
    url = s3_faulty.url("src.store")
    push(src, url)
    proxy = s3_faulty.proxy
    proxy.set_delay(60, method="GET", path=stall)
    proc = popen_cli([argv[0], url, *argv[1:]], env={**s3_faulty.env, "MMSTORE_CACHE_DIR": str(tmp_path / "cache")},
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _stalled(proxy)
    rc, err, took = _stop(proc, sig)
    assert rc == 130, (rc, err)
    assert err.strip() == f"mmstore {argv[0]}: interrupted", err
    assert took < 5, took
