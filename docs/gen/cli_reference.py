"""The command-line reference, generated from the argparse parsers of ``mmstore.cli``.

Every command's ``--help`` text is taken from the parser the ``mmstore``
command itself builds, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import inspect
import os


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise LookupError("the mmstore parser has no subcommands")


def to_markdown() -> str:
    from mmstore import cli

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: one width for the page
    try:
        parser = cli.build_parser()
        sub = _subparsers(parser)
        summary = {a.dest: (a.help or "") for a in sub._choices_actions}
        out = ["| command | what it does |", "|---|---|"]
        out += [f"| [`mmstore {name}`](#mmstore-{name}) | {summary.get(name, '')} |" for name in sub.choices]
        out += ["", "## Exit codes", "", inspect.cleandoc(cli.main.__doc__ or "").split("\n\n", 1)[-1], ""]
        out += ["## `mmstore`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, p in sub.choices.items():
            out += [f"## `mmstore {name}` {{#mmstore-{name}}}", "", "```text", p.format_help().rstrip(), "```", ""]
        return "\n".join(out)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
