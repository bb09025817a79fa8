"""Interrupting ``mmstore push``: real signals to a real child process pushing to a real S3
server through a proxy that holds each part upload, so that a part is in flight when the
signal comes (NOTE [stopping a transfer] in mmstore/_os/threads.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from remote.helpers import finish, same_files, wait_for, written_image_store
from support.proc import REPO, cli_env

from mmstore.transfer import pull

pytest.importorskip("obstore")
pytest.importorskip("boto3")

_HOLD = 60.0  # each part upload is held this long by the proxy: far longer than any bound below
_BOUND = 4.0  # seconds from the signal to the end of the process (it takes well under one)


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """A store whose image.npy (18.9 MB) goes up in two parts."""
    return written_image_store(tmp_path_factory.mktemp("big") / "big.store", n=24, shape=(512, 512, 3))


def _uploads(s3) -> list[str]:
    """The keys of the bucket's unfinished multipart uploads, asked of the server itself."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.server.endpoint, region_name=s3.env["AWS_REGION"],
                          aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"])
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])]


def _push(store: str, url: str, cache: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mmstore", "push", store, url, *extra],
                            env=cli_env(MMSTORE_CACHE_DIR=cache), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def _interrupt_mid_part(s3_faulty, store: str, url: str, cache: str, signals: list[int]) -> tuple[float, bytes]:
    """Start a push, wait until a part is held by the proxy, send ``signals``; the seconds from
    the first signal to the end of the process, and its stderr (the exit code is checked)."""
    s3_faulty.proxy.set_delay(_HOLD, method="PUT", path="partNumber=")
    proc = _push(store, url, cache)
    wait_for("a multipart upload", lambda: _uploads(s3_faulty), proc, timeout=60)
    time.sleep(1.0)  # the parts go out right after the upload is made, and the proxy holds them
    t0 = time.monotonic()
    for sig in signals:
        os.kill(proc.pid, sig)
        time.sleep(0.02)
    _, err = finish(proc, timeout=30)
    took = time.monotonic() - t0
    s3_faulty.proxy.clear()
    assert proc.returncode == 130, err
    return took, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_a_push_mid_part_and_the_rerun_finishes_it(s3_faulty, big_store, tmp_path, sig):
    url = s3_faulty.url("big.store")
    cache = str(tmp_path / "cache")
    took, err = _interrupt_mid_part(s3_faulty, big_store, url, cache, [sig])
    assert took < _BOUND, (took, err)
    assert b"interrupted" in err and b"Traceback" not in err, err
    assert _uploads(s3_faulty) == ["big.store/image.npy"]  # the journal names it: the rerun goes on with it
    out = subprocess.run([sys.executable, "-m", "mmstore", "push", big_store, url, "--json"], capture_output=True,
                         env=cli_env(MMSTORE_CACHE_DIR=cache), cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["skipped_files"] > 0  # the small files went up before the signal
    assert _uploads(s3_faulty) == []
    same_files(big_store, str(pull(url, tmp_path / "copy.store")["store"]))


def test_more_ctrl_c_while_stopping_print_no_traceback(s3_faulty, big_store, tmp_path):
    url = s3_faulty.url("big.store")
    took, err = _interrupt_mid_part(s3_faulty, big_store, url, str(tmp_path / "cache"),
                                    [signal.SIGINT, signal.SIGINT, signal.SIGINT])
    assert took < _BOUND, (took, err)
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err


def test_abort_uploads_drops_what_an_interrupted_push_left(s3_faulty, big_store, tmp_path):
    url = s3_faulty.url("big.store")
    cache = str(tmp_path / "cache")
    _interrupt_mid_part(s3_faulty, big_store, url, cache, [signal.SIGINT])
    assert _uploads(s3_faulty) == ["big.store/image.npy"]
    env = cli_env(MMSTORE_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-m", "mmstore", "push", "--abort-uploads", url, "--json"],
                         capture_output=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [u["name"] for u in json.loads(out.stdout)["aborted"]] == ["image.npy"]
    assert _uploads(s3_faulty) == []
    out = subprocess.run([sys.executable, "-m", "mmstore", "push", big_store, url, "-q"], capture_output=True,
                         env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert _uploads(s3_faulty) == []
    same_files(big_store, str(pull(url, tmp_path / "copy.store")["store"]))


def test_a_push_whose_journal_was_lost_aborts_the_uploads_it_left(s3_faulty, big_store, tmp_path):
    url = s3_faulty.url("big.store")
    _interrupt_mid_part(s3_faulty, big_store, url, str(tmp_path / "cache"), [signal.SIGINT])
    assert _uploads(s3_faulty) == ["big.store/image.npy"]
    out = subprocess.run([sys.executable, "-m", "mmstore", "push", big_store, url, "-q"], capture_output=True,
                         env=cli_env(MMSTORE_CACHE_DIR=str(tmp_path / "another-machine")), cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert _uploads(s3_faulty) == []
