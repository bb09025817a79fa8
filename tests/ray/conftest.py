"""A local Ray cluster for the tests of ``mmstore.ray``: ``ray.init(num_cpus=2)`` on
loopback (no dashboard, no usage statistics), started for each test module and shut down
after it: a process holding a Ray driver's threads must not fork (the rest of the suite
forks readers and workers). Where Ray is not
installed or cannot start, the tests that use it are skipped, and the skip says why."""

from __future__ import annotations

import logging
import os
import signal

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    try:
        import ray
        import ray.data
    except ImportError as exc:
        pytest.skip(f"Ray Data is not installed ({exc}): pip install 'mmstore[ray]' (the test extra has it)")
    # ray.init installs the driver's own SIGTERM handler: every process this pytest worker forks
    # later would inherit it (a multiprocessing pool's terminate() then waits for ever): put back
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=logging.WARNING,
                 log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - any reason Ray cannot start here is a skip, said as it is
        pytest.skip(f"a local Ray cluster cannot start here: {type(exc).__name__}: {exc}")
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    try:
        yield ray
    finally:
        ray.shutdown()
