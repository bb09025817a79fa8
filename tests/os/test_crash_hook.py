"""The fault-injection hook (mmstore/_os/crash.py): dies at exactly the armed occurrence, costs nothing unarmed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mmstore._os import crash as _crash

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _in_child(body) -> tuple[int, list[str]]:
    """Run ``body(log)`` in a forked child; return its exit code and what it logged."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        rc = 0
        try:
            body(lambda m: os.write(w, (m + "\n").encode()))
        except BaseException:  # noqa: BLE001
            rc = 99
        os._exit(rc)
    os.close(w)
    with os.fdopen(r) as fh:
        out = fh.read().split()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out


@pytest.mark.parametrize("spec,dies_after", [("write:3", 3), ("fsync:1", 1), ("fsync:2", 4), ("any:4", 3),
                                             ("rename:1", None), ("", None)])
def test_dies_just_before_the_armed_occurrence(spec, dies_after):
    # the phases of this walk: write fsync write write fsync (no rename)
    def body(log):
        _crash.arm(spec)
        for k, phase in enumerate(["write", "fsync", "write", "write", "fsync"]):
            _crash.crash_point(phase)
            log(f"{k}:{phase}")

    rc, done = _in_child(body)
    if dies_after is None:
        assert rc == 0 and len(done) == 5
    else:
        assert rc == _crash.EXIT_CODE and len(done) == dies_after, (spec, done)
        kind = spec.split(":")[0]
        assert kind == "any" or sum(d.endswith(":" + kind) for d in done) == int(spec.split(":")[1]) - 1


def test_arm_restarts_the_count():
    def body(log):
        _crash.arm("commit:2")
        _crash.crash_point("commit")
        _crash.arm("commit:2")  # a fresh count: this is occurrence 1 again
        _crash.crash_point("commit")
        log("survived")
        _crash.crash_point("commit")
        log("not reached")

    rc, done = _in_child(body)
    assert rc == _crash.EXIT_CODE and done == ["survived"]


def test_follow_child_dies_only_for_a_crash_point_exit_when_armed():
    def body(log):
        _crash.arm("")
        _crash.follow_child(_crash.EXIT_CODE, lambda: log("cleanup-unarmed"))
        _crash.arm("write:99")
        _crash.follow_child(-9, lambda: log("cleanup-sigkill"))
        _crash.follow_child(1, lambda: log("cleanup-exit1"))
        log("alive")
        _crash.follow_child(_crash.EXIT_CODE, lambda: log("cleanup"))
        log("not reached")

    rc, done = _in_child(body)
    assert rc == _crash.EXIT_CODE and done == ["alive", "cleanup"]


def test_armed_from_the_environment_in_a_new_process():
    code = ("from mmstore._os.crash import crash_point\n"
            "for i in range(5):\n"
            "    crash_point('merge'); print(i, flush=True)\n")
    env = dict(os.environ, MMSTORE_CRASH_AT="merge:3", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == _crash.EXIT_CODE and p.stdout.split() == ["0", "1"], p.stderr
    env["MMSTORE_CRASH_AT"] = ""
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["0", "1", "2", "3", "4"], p.stderr


def test_production_code_reaches_crash_injection_only_through_the_hook():
    """No module but _os/crash.py reads MMSTORE_CRASH_AT or exits with the crash code itself."""
    offenders = []
    for d, _, files in os.walk(os.path.join(ROOT, "mmstore")):
        for f in files:
            path = os.path.join(d, f)
            if not f.endswith(".py") or path.endswith(os.path.join("mmstore", "_os", "crash.py")):
                continue
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            if "MMSTORE_CRASH_AT" in text or "_exit(77)" in text or "== 77" in text:
                offenders.append(os.path.relpath(path, ROOT))
    assert offenders == []
