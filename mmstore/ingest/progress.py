"""Ingest progress on stderr: a tqdm bar on a terminal, else a line every ``interval`` seconds."""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress"]


def _is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _bar(total: int, initial: int, errors: int, label: str) -> Any:
    try:
        from tqdm import tqdm  # lazy: only an interactive ingest draws a bar
    except ImportError:
        return None
    bar = tqdm(total=total, initial=initial, unit="img", file=sys.stderr, dynamic_ncols=True, desc=label)
    bar.set_postfix(errors=errors, refresh=False)
    return bar


class Progress:
    """Counts done inputs and errors; shows them unless ``quiet``."""

    def __init__(self, total: int, initial: int, errors: int, quiet: bool, interval: float, label: str) -> None:
        self.total = total
        self.done = initial
        self.errors = errors
        self.quiet = quiet
        self.interval = interval
        self.label = label
        self.t0 = time.monotonic()
        self.start_done = initial
        self.last_log = self.t0
        self.bar = _bar(total, initial, errors, label) if not quiet and _is_tty() else None

    def update(self, n: int, errs: int) -> None:
        self.done += n
        self.errors += errs
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.update(n)
            if errs:
                self.bar.set_postfix(errors=self.errors, refresh=False)
            return
        now = time.monotonic()
        if now - self.last_log >= self.interval:
            self.last_log = now
            self.log()

    def log(self) -> None:
        el = max(time.monotonic() - self.t0, 1e-9)
        rate = (self.done - self.start_done) / el
        left = self.total - self.done
        eta = f"{left / rate:,.0f} s" if rate > 0 else "?"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        print(
            f"{self.label}: {self.done}/{self.total} ({pct:.1f}%), {rate:,.0f}/s, ETA {eta}, {self.errors} errors",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
