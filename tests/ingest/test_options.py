"""The one list of ingest options: the library, the CLI flags and the printed resume command agree."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmstore.cli import build_parser
from mmstore.cli.ingest import _options, resume_command
from mmstore.decode import DecodeSpec
from mmstore.ingest import ingest
from mmstore.ingest.options import (
    RUN_DEFAULTS,
    SIZE_OPTIONS,
    SOURCE_OPTIONS,
    SPEC_OPTIONS,
    ErrorLimit,
    make_spec,
    split_options,
)
from mmstore.ingest.pipeline import RunOptions


def _ingest_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["ingest"]


def _flag(name: str) -> str:
    return "--no-strict-jpeg" if name == "strict_jpeg" else "--" + name.replace("_", "-")


def test_every_option_has_its_cli_flag_and_no_flag_is_unlisted():
    p = _ingest_parser()
    flags = {s for a in p._actions for s in a.option_strings}
    for name in SPEC_OPTIONS + SOURCE_OPTIONS:
        want = "--no-header" if name == "header" else _flag(name)
        assert want in flags, f"option {name!r} has no CLI flag {want}"
    run = {"--workers", "--on-error", "--max-errors", "--resume", "--overwrite", "--shard", "--backend", "--codec",
           "--chunk", "--log-interval", "--quiet", "-q", "--size", "--max-side", "--short-side", "--buckets", "-h",
           "--help"}
    listed = {"--no-header" if n == "header" else _flag(n) for n in SPEC_OPTIONS + SOURCE_OPTIONS}
    assert flags - run - listed == set(), "a CLI flag that is neither a run option nor a listed option"


def test_split_options_routes_every_name_and_refuses_unknown_ones():
    opts = {name: i for i, name in enumerate(SPEC_OPTIONS + SOURCE_OPTIONS)}
    spec_kw, src_kw = split_options(opts)
    assert spec_kw == {k: opts[k] for k in SPEC_OPTIONS}
    assert src_kw == {k: opts[k] for k in SOURCE_OPTIONS}
    with pytest.raises(TypeError, match="unknown ingest option.*'colour'"):
        split_options({"resize": "pad", "colour": 3})


def test_ingest_refuses_an_unknown_option_before_touching_anything(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        ingest(str(tmp_path / "src"), str(tmp_path / "dest"), 16, colour=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_ingest_shows_every_option_in_its_signature():
    """Every decode and source option is a keyword of ingest(), typed, none hidden in ``**``."""
    import inspect

    params = inspect.signature(ingest).parameters
    assert not [p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    for name in SPEC_OPTIONS + SOURCE_OPTIONS:
        assert name in params, name
        assert params[name].default is None and params[name].annotation not in ("Any", inspect.Parameter.empty), name


def test_make_spec_takes_exactly_the_spec_options():
    spec = make_spec("24x32", resize="pad", channels=1, layout="chw", bgr=True, interp_up="cubic", pad_value=7,
                     fast_decode=True, max_pixels=10**6, strict_jpeg=False)
    assert (spec.size, spec.resize, spec.channels, spec.layout, spec.bgr, spec.interp_up, spec.pad_value,
            spec.fast_decode, spec.max_pixels, spec.strict_jpeg) == ((24, 32), "pad", 1, "chw", True, "cubic", 7,
                                                                     True, 10**6, False)
    assert make_spec(None, resize="pad") is None
    with pytest.raises(TypeError, match="unknown decode option.*'colour'"):
        make_spec("24", colour=3)


def test_each_decode_default_is_the_same_in_the_cli_make_spec_and_decodespec():
    # read from DecodeSpec's fields: a new decode option that is not wired through fails here
    # (size and buckets say the records' sizes: the size options, SIZE_OPTIONS)
    table = {f.name: f.default for f in dataclasses.fields(DecodeSpec) if f.name not in ("size", "buckets")}
    assert table and tuple(table) == SPEC_OPTIONS
    p = _ingest_parser()
    cli = {a.dest: a.default for a in p._actions}
    made, plain = make_spec((8, 8)), DecodeSpec((8, 8))
    for name, default in table.items():
        assert name in cli, f"decode option {name!r} has no CLI flag with dest {name!r}"
        seen = {"cli": cli[name], "make_spec": getattr(made, name), "DecodeSpec": getattr(plain, name)}
        assert all(type(v) is type(default) and v == default for v in seen.values()), (name, default, seen)
    # so the CLI without decode flags, make_spec and DecodeSpec give the same fingerprint input
    args = p.parse_args(["src", "dest", "--size", "8x8"])
    from_cli = make_spec(args.size, **_options(args))
    assert from_cli == made == plain and from_cli.to_dict() == plain.to_dict()
    assert DecodeSpec.from_dict(plain.to_dict()) == plain


def test_the_decode_fingerprint_input_of_the_defaults_is_unchanged():
    # what the resume fingerprint hashes for the default options: another value refuses every existing --resume
    assert DecodeSpec((8, 8)).to_dict() == {
        "size": [8, 8], "resize": "center-crop", "channels": 3, "layout": "hwc", "bgr": False, "interp_up": "linear",
        "pad_value": 0, "fast_decode": False, "max_pixels": 178_956_970, "strict_jpeg": True}
    assert DecodeSpec((8, 8), alpha="white").to_dict()["alpha"] == "white"


def test_each_run_default_is_the_same_in_the_cli_ingest_and_run_options():
    sig = inspect.signature(ingest).parameters
    run = {f.name: f.default for f in dataclasses.fields(RunOptions)}
    cli = {a.dest: a.default for a in _ingest_parser()._actions}
    flag_dest = {"codecs": "codec", "progress_interval": "log_interval"}
    keywords = {n for n, q in sig.items() if q.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords - set(SPEC_OPTIONS) - set(SOURCE_OPTIONS) - set(SIZE_OPTIONS) == set(RUN_DEFAULTS)
    assert set(run) - {"log", "part", "threads"} == set(RUN_DEFAULTS)  # part, threads: set by mmstore.ray
    for name, default in RUN_DEFAULTS.items():
        assert sig[name].default == default and run[name] == default, name
        if name != "resume_hint":  # the CLI makes its own
            assert cli[flag_dest.get(name, name)] == default, name


# every option set to a value other than its default, as the user would type it
_VALUES = {
    "--size": st.sampled_from(["16x16", "224x160", "32"]),
    "--resize": st.sampled_from(["stretch", "pad", "none"]),
    "--channels": st.just("1"),
    "--layout": st.just("chw"),
    "--interp-up": st.just("cubic"),
    "--pad-value": st.integers(1, 255).map(str),
    "--max-pixels": st.integers(1, 10**9).map(str),
    "--labels": st.sampled_from(["auto", "folders", "none"]),
    "--root": st.text("abc é/ '$", min_size=1, max_size=8),
    "--path-column": st.sampled_from(["id", "0", "file name"]),
    "--label-column": st.sampled_from(["landmark_id", "2"]),
    "--path-template": st.just("{id[0]}/{id}.jpg"),
    "--delimiter": st.sampled_from([";", "|"]),
    "--label-type": st.sampled_from(["int", "names", "auto"]),
    "--missing-label": st.sampled_from(["error", "class"]),
    "--image-key": st.just("x"),
    "--label-key": st.just("y"),
    "--shard": st.sampled_from(["0/2", "3/8"]),
    "--backend": st.just("lmdb"),
    "--workers": st.integers(0, 64).map(str),
    "--on-error": st.just("fail"),
    "--max-errors": st.sampled_from(["5", "1.5%"]),
}
_SWITCHES = ["--bgr", "--fast-decode", "--no-strict-jpeg", "--no-header", "--quiet"]


@settings(max_examples=60, deadline=None)
@given(values=st.fixed_dictionaries({}, optional=_VALUES), switches=st.sets(st.sampled_from(_SWITCHES)),
       source=st.text("ab é'\" $", min_size=1, max_size=6))
def test_the_resume_command_repeats_every_option_given(values, switches, source):
    p = _ingest_parser()
    argv = [source, "dest.store"]
    for flag, v in values.items():
        argv += [flag, v]
    argv += sorted(switches)
    args = p.parse_args(argv)
    cmd = shlex.split(resume_command(args))
    assert cmd[:2] == ["mmstore", "ingest"] and cmd[-1] == "--resume"
    again = p.parse_args(cmd[2:])
    assert again.resume and not args.resume
    again.resume = False
    assert vars(again) == vars(args)


def test_error_limit_counts_and_percentages():
    assert not ErrorLimit("skip", None).exceeded(10**6, 10**6)
    assert ErrorLimit("fail", "50%").exceeded(1, 100)  # fail stops at the first, whatever max_errors says
    assert not ErrorLimit("skip", "3").exceeded(3, 100) and ErrorLimit("skip", "3").exceeded(4, 100)
    assert not ErrorLimit("skip", "10%").exceeded(10, 100) and ErrorLimit("skip", "10%").exceeded(11, 100)
    with pytest.raises(ValueError, match="on_error must be"):
        ErrorLimit("ignore", None)
    with pytest.raises(ValueError, match="--max-errors must be"):
        ErrorLimit("skip", "-1")
