"""Fixtures for the ingest tests: the ``h`` helper namespace (generated photos,
folders, store comparisons, the CLI) over ``tests/support``, and a folder."""

from __future__ import annotations

import types

import pytest
from support.compare import assert_same_files, store_bytes
from support.images import make_folder, photo, write_image
from support.proc import REPO, cli, popen_cli

pytest.importorskip("cv2")


def cli_subprocess(*argv: str, env=None, **kw):
    """``python -m mmstore argv...`` as a child process (``env`` entries added)."""
    return popen_cli(argv, env=env, **kw)


@pytest.fixture
def h():
    """Helper namespace."""
    return types.SimpleNamespace(
        photo=photo,
        write_image=write_image,
        make_folder=make_folder,
        store_files=store_bytes,
        assert_same_store=assert_same_files,
        cli=cli,
        cli_subprocess=cli_subprocess,
        REPO=REPO,
    )


@pytest.fixture
def folder(tmp_path):
    root = str(tmp_path / "imgs")
    rels = make_folder(root)
    return root, rels
