"""``verify --deep`` of a store URL: a Ctrl-C stops it at once while a range GET is stalled,
and it checks each object whole against the digest the push recorded, not only block by
block (real S3 server on loopback; a real child process and a real SIGINT)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from remote.helpers import BLOCK, finish, image_store, wait_for
from support.proc import REPO, cli_env, run_cli

from mmstore.check.verify_remote import verify_remote
from mmstore.transfer import push

pytest.importorskip("obstore")

_HOLD = 60.0  # each range GET of image.npy is held this long by the proxy: far longer than the bound below
_BOUND = 4.0  # seconds from the signal to the end of the process (it takes well under one)


def test_ctrl_c_stops_verify_deep_while_a_range_get_is_stalled(s3_faulty, tmp_path):
    src = image_store(tmp_path / "src.store", n=200)
    url = s3_faulty.url("deep/stalled.store")
    push(src, url, block_bytes=BLOCK)
    proxy = s3_faulty.proxy
    proxy.set_delay(_HOLD, method="GET", path=r"/image\.npy$")  # the deep check's range GETs of the images
    proc = subprocess.Popen([sys.executable, "-m", "mmstore", "verify", url, "--deep", "--no-progress"],
                            env=cli_env(MMSTORE_CACHE_DIR=str(tmp_path / "cache")), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for("a held range GET", lambda: proxy._busy > 0, proc, timeout=60)
        time.sleep(1.0)  # the listing and the small reads are long done: what is in flight is the held GET
        assert proxy._busy > 0 and proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = finish(proc, timeout=30)
        took = time.monotonic() - t0
    finally:
        proxy.clear()
    assert proc.returncode == 130, err
    assert took < _BOUND, (took, err)
    assert b"interrupted" in err and b"Traceback" not in err and b"KeyboardInterrupt" not in err, err


def test_verify_deep_finds_an_index_that_disagrees_with_itself_and_its_advice_repairs_it(s3, tmp_path, capsys):
    src = image_store(tmp_path / "src.store")
    prefix = "deep/disagrees.store"
    url = s3.url(prefix)
    push(src, url, block_bytes=BLOCK)
    index = json.loads(s3.server.get_object_raw(s3.bucket, f"{prefix}/_remote.json"))
    index["files"]["image.npy"]["digest"] = "0" * 32  # every block digest right, the whole file's wrong
    s3.server.put_object_raw(s3.bucket, f"{prefix}/_remote.json", json.dumps(index).encode())

    assert verify_remote(url).ok  # sizes and etags: the objects are as the index lists them
    rep = verify_remote(url, deep=True)
    assert not rep.ok and rep.bad_blocks == 0 and rep.damaged == ["image.npy"], rep.problems
    assert rep.disagreeing == ["image.npy"]
    assert "disagrees with itself" in rep.problems[0].message
    assert f"delete {url}/_remote.json" in rep.next
    rc, out, _ = run_cli(["verify", url, "--deep", "--no-progress"], capsys)
    assert rc == 1 and "image.npy" in out and f"delete {url}/_remote.json" in out, out
    assert push(src, url, block_bytes=BLOCK)["up_to_date"]  # why the advice deletes the index first

    # the advice: delete the index, push again from a good copy, verify again
    status, _, body = s3.server.request("DELETE", f"/{s3.bucket}/{prefix}/_remote.json")
    assert status == 204, body
    assert not push(src, url, block_bytes=BLOCK)["up_to_date"]
    again = verify_remote(url, deep=True)
    assert again.ok and again.checked_blocks > 0, again.problems
