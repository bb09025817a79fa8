"""Regression tests named after bugs found outside the ingest's own tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_regression_ingest_after_opencv_thread_pool_was_used(tmp_path):
    """Bug: ingest workers forked from a process whose OpenCV thread pool was
    running hung forever in cv2.setNumThreads (pthread_cond_destroy on the
    inherited pool); seen when `mmstore demo` ran inside the test suite."""
    code = textwrap.dedent(f"""
        import os, sys
        import cv2, numpy as np
        cv2.setNumThreads(4)
        big = np.random.default_rng(0).integers(0, 255, (2000, 2000, 3), dtype=np.uint8)
        for _ in range(5):
            cv2.resize(big, (999, 997), interpolation=cv2.INTER_AREA)  # spins up the pool
        src = {str(tmp_path / "src")!r}
        os.makedirs(os.path.join(src, "a"))
        for i in range(12):
            ok, buf = cv2.imencode(".jpg", big[i * 10 : i * 10 + 64, :80])
            open(os.path.join(src, "a", f"{{i}}.jpg"), "wb").write(buf.tobytes())
        from mmstore.ingest import ingest
        r = ingest(src, {str(tmp_path / "s")!r}, (16, 16), workers=2, quiet=True)
        assert r.records == 12, r
        assert cv2.getNumThreads() == 4
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
