"""The command line shell: exit codes, --help, python -m mmstore."""

from __future__ import annotations

import subprocess
import sys

from mmstore.cli import COMMANDS, main


def test_no_command_is_usage_error(capsys):
    assert main([]) == 2


def test_unknown_option_is_usage_error(capsys):
    try:
        rc = main(["demo", "--no-such-option"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2


def test_python_dash_m_version():
    r = subprocess.run([sys.executable, "-m", "mmstore", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("mmstore ")


def test_every_command_has_help_with_an_example(capsys):
    for name in COMMANDS:
        try:
            main([name, "--help"])
        except SystemExit as e:
            assert e.code == 0
        out = capsys.readouterr().out
        assert "example" in out.lower(), name
