"""The ``mmstore`` command: a thin argparse layer over the library.

Each subcommand lives in its own module of this package, which defines
``register(subparsers)``; the handler parses, calls the library, renders the
report and returns an exit code (:data:`EXIT_CODES`, the epilog of
``mmstore --help``): 0 ok, 1 a runtime failure, 2 a usage or input error. An
exception that ends a command is mapped in one place, :func:`main`, by its type
(``usage_error`` of :mod:`mmstore.errors`).

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
import difflib
import errno
import importlib
import os
import select
import signal
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn, cast

from .._version import __version__
from ..errors import IncompleteStoreError, MmstoreError, cli_wording
from ..format.names import printable

__all__ = ["COMMANDS", "EXIT_CODES", "EXIT_OK", "EXIT_OUTPUT_CLOSED", "EXIT_PROBLEM", "EXIT_USAGE", "main"]

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
EXIT_OUTPUT_CLOSED = 128 + 13  # 128 + SIGPIPE: what a shell reports for `cat big | head -1`'s cat

# the one statement of the rule, shown by `mmstore --help`
EXIT_CODES = """exit codes (every command):
  0    success
  1    a runtime failure: a check found a problem in a store, an I/O error, an ingest
       stopped (too many failed inputs, a worker died, disk full); fix the cause and rerun
  2    a usage or input error: an unknown or malformed option, a missing argument, a
       source or store that is not there or cannot be used; nothing was changed: fix
       the command
  130  interrupted (Ctrl-C, SIGTERM)
  141  the reader of the output went away (`mmstore show STORE | head -1`): the command
       stops quietly, with the status a shell gives a command ended by SIGPIPE
"""

# module names in mmstore.cli, in the order `mmstore --help` lists them
COMMANDS: tuple[str, ...] = ("demo", "ingest", "merge", "append", "inspect", "verify", "show", "warm", "doctor",
                             "bench", "convert", "push", "pull")


class _Parser(argparse.ArgumentParser):
    """Every parser of the command line: an option is spelled out in full
    (``--resu`` is not taken for ``--resume``), and a usage error exits 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Exit 2 with what is wrong first, then one line of usage that points
        to ``--help`` (argparse's full usage of a command runs to 20 lines and
        would bury the message)."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n{self.synopsis()}\n")

    def synopsis(self) -> str:
        """``usage: mmstore ingest source dest [options] (see mmstore ingest --help)``."""
        words = [self.prog]
        for a in self._actions:
            if a.option_strings:
                continue
            name = a.metavar if isinstance(a.metavar, str) else a.dest
            words.append(f"{name} ..." if isinstance(a, argparse._SubParsersAction) else str(name))
        return f"usage: {' '.join(words)} [options] (see {self.prog} --help)"

    def unrecognized(self, extra: list[str]) -> NoReturn:
        """Exit 2 for arguments no option of this parser takes, naming the
        nearest option of this parser for the first unknown one."""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        hint = ""
        for arg in extra:
            if arg.startswith("--"):
                near = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
                if near:
                    hint = f"; did you mean {near[0]}?"
                    break
        self.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mmstore",
        description="Decode a dataset once into fixed-shape records; read any sample in O(1).",
        epilog=EXIT_CODES,
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
    traceback (set ``MMSTORE_DEBUG=1`` to see it); :data:`EXIT_CODES` states
    the rule. Options named in a library message print in their command-line
    spelling (:func:`mmstore.errors.cli_wording`). When the reader of the
    output goes away (``| head -1``), the command stops printing and exits
    :data:`EXIT_OUTPUT_CLOSED` without a message. Ctrl-C and SIGTERM stop
    any command with one line and exit 130 (:func:`_signals_interrupt`).
    """
    try:
        try:
            with _signals_interrupt():
                try:
                    return _main(argv)
                except KeyboardInterrupt:  # before or after the command's own work
                    print("mmstore: interrupted", file=sys.stderr)
                    return 130
        finally:
            sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's exit
    except BrokenPipeError:  # stdout's: _main lets no other one through
        # the rest of the output goes nowhere, so that the interpreter's own flush at exit is quiet too
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OUTPUT_CLOSED


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM (a job scheduler, ``kill``, ``timeout``) stops a command as
    Ctrl-C does: ``KeyboardInterrupt`` in the main thread, one line, exit 130
    (:data:`EXIT_CODES`), instead of the process ending by the signal. A
    second signal while the first is being handled (a clean-up that takes
    long) ends the process at once, also 130. The previous handlers are put
    back on the way out (``main`` may be called in-process); a SIGINT that
    is ignored (``nohup``) stays ignored."""
    hit = [False]

    def handler(signum: int, frame: object) -> None:
        if hit[0]:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os._exit(130)
        hit[0] = True
        raise KeyboardInterrupt

    saved: dict[signal.Signals, Any] = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            if sig == signal.SIGINT and signal.getsignal(sig) is not signal.default_int_handler:
                continue
            saved[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: signals are not ours to take
        pass
    try:
        yield
    finally:
        for num, old in saved.items():
            if signal.getsignal(num) is handler:  # a command that chose otherwise on its way out (push) keeps it
                signal.signal(num, old)


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reading end was closed."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # not a file (captured), or no poll on this platform
        return False


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command's own parser, with the nearest option
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        cast(_Parser, commands.get(getattr(args, "command", None) or "", parser)).unrecognized(extra)
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
            if isinstance(exc, BrokenPipeError) and _stdout_reader_gone():
                raise  # `mmstore show STORE | head -1`: main stops quietly
            code, message = _describe(exc)
            if os.environ.get("MMSTORE_DEBUG"):
                traceback.print_exc()
            # a message may quote names found in a store
            print(f"mmstore {args.command}: {printable(cli_wording(message))}", file=sys.stderr)
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
