"""``mmstore append`` takes every flag of ``mmstore ingest`` (one definition
builds both parsers), and refuses, with the reason, the ones that cannot
apply to an append."""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

from mmstore.cli import build_parser, main
from mmstore.cli._ingest_flags import NOT_FOR_APPEND


def _sub(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings if s not in ("-h", "--help")}


def _example(action: argparse.Action) -> list[str]:
    """The flag with a value its parser takes."""
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, str(list(action.choices)[-1])]
    if action.type is int:
        return [flag, "3"]
    if action.type is float:
        return [flag, "2.5"]
    return [flag, "x"]


def test_every_ingest_flag_is_an_append_flag_with_the_same_dest():
    ingest, append = _flags(_sub("ingest")), _flags(_sub("append"))
    missing = sorted(set(ingest) - set(append))
    assert not missing, f"flags of ingest that append lacks: {missing}"
    for flag, action in ingest.items():
        other = append[flag]
        assert other.dest == action.dest, flag
        assert other.nargs == action.nargs and other.choices == action.choices and other.type == action.type, flag
    # append's own flag beside them
    assert set(append) - set(ingest) == {"--duplicate-keys"}


@pytest.mark.parametrize("flag", sorted(_flags(_sub("ingest"))))
def test_each_ingest_flag_parses_for_append_or_is_refused_by_name(flag, tmp_path, capsys):
    action = _flags(_sub("ingest"))[flag]
    argv = ["append", str(tmp_path / "none.store"), str(tmp_path / "src"), *_example(action)]
    args = build_parser().parse_args(argv)  # the parser takes it (argparse exits 2 on a flag it does not know)
    if action.dest in NOT_FOR_APPEND:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert action.option_strings[-1] in err and "does not apply to mmstore append" in err and "leave it out" in err
    else:
        assert getattr(args, action.dest) is not None


def test_append_defaults_leave_the_decode_to_the_store():
    args = build_parser().parse_args(["append", "d", "s"])
    for dest in ("size", "resize", "channels", "layout", "bgr", "interp_up", "pad_value", "fast_decode",
                 "max_pixels", "strict_jpeg", "alpha", "upscale", "codec", "backend"):
        assert getattr(args, dest) is None, dest


def test_a_flag_once_missing_from_append_reaches_the_append(tmp_path):
    """A source flag of ingest reaches the library through append: a list with
    its paths in a named column, given by --path-column (the store's own list
    used that flag too)."""
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(0)
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for k in range(4):
        cv2.imwrite(str(imgs / f"{k}.png"), rng.integers(0, 255, (20, 24, 3), dtype=np.uint8))
    for name, ks in (("old.csv", (0, 1)), ("new.csv", (2, 3))):
        (tmp_path / name).write_text("file,label\n" + "".join(f"imgs/{k}.png,{k % 2}\n" for k in ks))
    dest = str(tmp_path / "s.store")
    assert main(["ingest", str(tmp_path / "old.csv"), dest, "--size", "16", "--path-column", "file",
                 "--workers", "0", "-q"]) == 0
    assert main(["append", dest, str(tmp_path / "new.csv"), "--path-column", "file", "--workers", "0", "-q"]) == 0
    import mmstore

    with mmstore.open(dest) as s:
        assert len(s) == 4 and [s.key(i) for i in range(4)] == [f"imgs/{k}.png" for k in range(4)]
    assert not os.path.exists(dest + ".partial")
