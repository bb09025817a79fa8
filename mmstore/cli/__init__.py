"""The ``mmstore`` command: a thin argparse layer over the library.

Each subcommand lives in its own module of this package, which defines
``register(subparsers)``; the handler parses, calls the library, renders the
report and returns an exit code: 0 ok, 1 the check found a problem, 2 a usage
error or not a store.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import FormatError, IncompleteStoreError, MmstoreError

__all__ = ["COMMANDS", "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "main"]

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

# module names in mmstore.cli, in the order `mmstore --help` lists them
COMMANDS: tuple[str, ...] = ("demo", "ingest", "merge", "inspect", "verify", "show", "warm", "doctor", "bench", "convert")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep the usage line
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
    """Run the command line; return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except (IncompleteStoreError, FormatError) as exc:
        print(f"mmstore {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, IncompleteStoreError) else EXIT_PROBLEM
    except MmstoreError as exc:
        print(f"mmstore {args.command}: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
    except KeyboardInterrupt:
        print(f"mmstore {args.command}: interrupted", file=sys.stderr)
        return 130
