"""Helpers shared by the command modules: argparse glue, JSON output, progress bars.

Library code never imports this.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from ..check.common import dumps
from ..errors import cli_wording

T = TypeVar("T")

__all__ = ["add_common", "emit_json", "off_main", "progress_bar", "subparser", "usage_error"]


def subparser(sub: argparse._SubParsersAction, name: str, help: str, description: str,
              example: str) -> argparse.ArgumentParser:
    return sub.add_parser(
        name,
        help=help,
        description=description,
        epilog=example,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_common(p: argparse.ArgumentParser, store: bool = True) -> None:
    if store:
        p.add_argument("store", metavar="STORE", help="the store directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")


def emit_json(report: Any) -> None:
    sys.stdout.write(dumps(report) + "\n")
    sys.stdout.flush()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass

    total: Any = None


def progress_bar(enabled: bool, desc: str, total: int | None = None, unit: str = "B") -> Any:
    """A tqdm bar on stderr (bytes, shows MB/s) when enabled and stderr is a
    terminal, else a no-op object with the same ``update``/``close``."""
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1000, file=sys.stderr,
                dynamic_ncols=True, leave=False)


def usage_error(command: str, message: str) -> int:
    print(f"mmstore {command}: error: {cli_wording(message)}", file=sys.stderr)
    return 2


def off_main(store: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``; for a store URL on a daemon thread, so that a
    Ctrl-C or SIGTERM stops the command at once even while a request to the
    bucket is stalled (NOTE [stopping a transfer] in
    mmstore/_os/threads.py: the request is abandoned). A local store's
    work stays on the main thread."""
    from ..remote.url import is_url

    if not is_url(store):
        return fn(*args, **kwargs)
    from .._os.threads import call

    return call(lambda: fn(*args, **kwargs), name="mmstore-" + getattr(fn, "__name__", "command"))
