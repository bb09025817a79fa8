"""The command line shell: exit codes, --help, python -m mmstore."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mmstore
from mmstore.cli import COMMANDS, main


def test_no_command_is_usage_error(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out  # the help, listing every command
    assert out.startswith("usage: mmstore") and all(name in out for name in COMMANDS)


def test_unknown_option_is_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--no-such-option"])
    assert e.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_python_dash_m_version():
    r = subprocess.run([sys.executable, "-m", "mmstore", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == f"mmstore {mmstore.__version__}\n", r.stdout


def test_every_command_has_help_with_an_example(capsys):
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0, name
        out = capsys.readouterr().out
        assert "example" in out.lower(), name


def test_cli_message_keeps_spaces_inside_a_line():
    """An error message becomes one line, but runs of spaces inside it stay:
    a folder 'dog  two' must not be shown as 'dog two'."""
    from mmstore.cli import _describe
    from mmstore.errors import LabelMappingError

    code, text = _describe(LabelMappingError("classes not in the mapping:\n  'dog  two'\nuse --new-classes append"))
    assert text == "classes not in the mapping: 'dog  two' use --new-classes append"
    assert code != 0
