"""The ``mmstore`` command: a thin argparse layer over the library.

Each subcommand lives in its own module of this package, which defines
``register(subparsers)``; the handler parses, calls the library, renders the
report and returns an exit code: 0 ok, 1 the check found a problem, 2 a usage
error or not a store.

NOTE [lazy commands]: building the parser imports every command module, so a
command module imports only light modules at its top; the heavy machinery it
runs (``mmstore.check.<tool>``, torch, cv2, lmdb) is imported inside its
handler, so ``--help`` and ``mmstore inspect`` load none of torch, cv2 or lmdb.
(``import mmstore`` itself brings the ingest package, whose modules import
numpy and the standard library only: ``mmstore.ingest`` is a top-level
function.)
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import NoReturn

from .._version import __version__
from ..errors import IncompleteStoreError, MmstoreError
from ..format.names import printable

__all__ = ["COMMANDS", "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "main"]

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

# module names in mmstore.cli, in the order `mmstore --help` lists them
COMMANDS: tuple[str, ...] = ("demo", "ingest", "merge", "inspect", "verify", "show", "warm", "doctor", "bench",
                             "convert")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse exits 2 too; keep the usage line
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mmstore",
        description="Decode a dataset once into fixed-shape records; read any sample in O(1).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mmstore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code.

    Every failure ends with one line on stderr and exit code 1 or 2, never a
    traceback (set ``MMSTORE_DEBUG=1`` to see it): 2 for a usage error, a bad
    argument or a path that is not a store, 1 for a problem found in a store,
    an I/O failure or anything else that went wrong.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    with _printable_output():
        try:
            return int(args.func(args))
        except KeyboardInterrupt:
            print(f"mmstore {args.command}: interrupted", file=sys.stderr)
            return 130
        except Exception as exc:  # noqa: BLE001 - the one place that turns any failure into a message
            code, message = _describe(exc)
            if isinstance(exc, BrokenPipeError):  # `mmstore ... | head`: no flush error at exit
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            if os.environ.get("MMSTORE_DEBUG"):
                traceback.print_exc()
            # a message may quote names found in a store
            print(f"mmstore {args.command}: {printable(message)}", file=sys.stderr)
            return code


def _describe(exc: BaseException) -> tuple[int, str]:
    """Exit code and one-line message of an exception that ended a command."""
    # one line: line breaks go, runs of spaces inside a line stay (a name quoted
    # in the message may differ from another only by its spaces)
    text = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip()) or type(exc).__name__
    if isinstance(exc, IncompleteStoreError):
        return EXIT_USAGE, text
    if getattr(exc, "usage_error", False):  # a bad argument found by the library (an unknown field ...)
        return EXIT_USAGE, text
    if isinstance(exc, MmstoreError):  # damaged store, lock held, ingest stopped ...
        return EXIT_PROBLEM, text
    if isinstance(exc, NotADirectoryError):
        return EXIT_USAGE, f"{_file_above(_where(exc))}: not a store (a store is a directory, this is a file)"
    if isinstance(exc, MemoryError):
        return EXIT_PROBLEM, ("out of memory; the store may be damaged or crafted (run `mmstore verify`), or "
                              "give the process more memory")
    if isinstance(exc, OSError):
        what = exc.strerror or text
        hint = {errno.EACCES: "check the permissions", errno.EPERM: "check the permissions",
                errno.ENOSPC: "free some space",
                errno.EFBIG: "a file reached the file size limit (ulimit -f) or the file system's maximum",
                errno.EIO: "the disk reports errors (see the kernel log)"}
        return EXIT_PROBLEM, f"{_where(exc)}: {what}" + (f"; {hint[exc.errno]}" if exc.errno in hint else "")
    return EXIT_PROBLEM, (f"{type(exc).__name__}: {text} (unexpected: set MMSTORE_DEBUG=1 to see where, and "
                          "please report it)")


def _where(exc: OSError) -> str:
    name = exc.filename
    return os.fsdecode(name) if isinstance(name, (str, bytes)) else "I/O error"


def _file_above(path: str) -> str:
    """The file in ``path`` that stands where a directory was expected."""
    p = path
    while p and p != os.path.dirname(p):
        if os.path.lexists(p) and not os.path.isdir(p):
            return p
        p = os.path.dirname(p)
    return path


@contextlib.contextmanager
def _printable_output() -> Iterator[None]:
    """Names that are not valid UTF-8 (file names, keys, label names) print as
    backslash escapes (``\\udce9``) instead of failing the command."""
    saved = []
    for stream in (sys.stdout, sys.stderr):
        errors = getattr(stream, "errors", None)
        if errors == "strict" and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                continue
            saved.append(stream)
    try:
        yield
    finally:
        for stream in saved:
            try:
                stream.reconfigure(errors="strict")
            except (ValueError, OSError):
                pass
