"""The store fuzzer, a seeded sample (the long run: ``python benchmarks/fuzz_store.py``).

Valid small stores of both backends, plain and merged, with holes, get one
or two structured mutations each; every public entry point (open, [i],
read_batch, column, key, skipped, checksums, iteration, Loader, and the CLI's
inspect, verify, show, convert) runs on the result in a forked child. A case
passes when nothing crashed or hung, every library call returned or raised an
mmstore error, every command exited 0, 1 or 2, and a store that verify passes
reads back exactly as the pristine one (see tests/support/fuzz.py).

Compact stores (format 2.0: a jpeg and a zstd field) get their own, smaller
sample, drawn mostly from the mutations they add: offsets values, bits inside
a JPEG or zstd entry, codec objects and the version, lmdb 2.0 entry lengths.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from support import fuzz

# a sample whose strength is its count: run by CI's soak step (`pytest -m soak`), not by default
pytestmark = pytest.mark.soak

CASES = 60
COMPACT_CASES = 30
RAGGED_CASES = 30


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fuzz-bases"))
    paths = fuzz.make_bases(root)
    return paths, {k: fuzz.reference(p) for k, p in paths.items()}


@pytest.fixture(scope="module")
def compact_bases(tmp_path_factory):
    pytest.importorskip("simplejpeg")
    pytest.importorskip("zstandard")
    root = str(tmp_path_factory.mktemp("fuzz-compact"))
    paths = fuzz.make_compact_bases(root)
    return paths, {k: fuzz.reference(p) for k, p in paths.items()}


@pytest.fixture(scope="module")
def ragged_bases(tmp_path_factory):
    pytest.importorskip("zstandard")
    root = str(tmp_path_factory.mktemp("fuzz-ragged"))
    paths = fuzz.make_ragged_bases(root)
    return paths, {k: fuzz.reference(p) for k, p in paths.items()}


def _loader() -> bool:
    try:
        import torch  # noqa: F401 - imported once here, so each forked case starts fast

        import mmstore.torch  # noqa: F401
        return True
    except ImportError:
        return False


def _run_cases(paths, refs, tmp_path, cases: int, compact: bool):
    loader = _loader()
    outcomes = []

    @settings(max_examples=cases, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(fuzz.case_strategy(paths, compact=compact))
    def run(case):
        name, muts = case
        o = fuzz.run_case(paths[name], refs[name], muts, os.path.join(str(tmp_path), "case"), loader=loader)
        o.case = f"{name}: {o.case}"
        outcomes.append(o)

    run()
    return outcomes


def test_compact_store_fuzzer_no_crash_no_hang_only_typed_errors(compact_bases, tmp_path):
    paths, refs = compact_bases
    outcomes = _run_cases(paths, refs, tmp_path, COMPACT_CASES, compact=True)
    _assert_sound(outcomes, COMPACT_CASES)
    kinds = {m.split("(")[0] for o in outcomes for m in o.case.split(": ", 1)[1].split(" + ")}
    assert {"offsets", "entry-flip", "codec"} <= kinds, kinds  # the new files are reached


def test_ragged_store_fuzzer_no_crash_no_hang_only_typed_errors(ragged_bases, tmp_path):
    paths, refs = ragged_bases
    outcomes = _run_cases(paths, refs, tmp_path, RAGGED_CASES, compact=True)
    _assert_sound(outcomes, RAGGED_CASES)
    kinds = {m.split("(")[0] for o in outcomes for m in o.case.split(": ", 1)[1].split(" + ")}
    assert {"offsets", "entry-flip"} <= kinds, kinds  # the ragged fields' files are reached


def test_store_fuzzer_no_crash_no_hang_only_typed_errors(bases, tmp_path):
    paths, refs = bases
    outcomes = _run_cases(paths, refs, tmp_path, CASES, compact=False)
    _assert_sound(outcomes, CASES)


def _assert_sound(outcomes, cases: int) -> None:
    assert len(outcomes) == cases
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(f"{o.status}: {o.case}: {o.detail}" for o in bad)
    # every command ends with a one-line message: no traceback, no "unexpected" error
    tbs = [(o.case, t) for o in outcomes for t in o.tracebacks]
    assert not tbs, "\n".join(map(str, tbs))
    # the mutations reach the code: most cases end in a typed error somewhere
    typed = sum(any(s[1] == "typed" for s in o.steps) for o in outcomes)
    assert typed >= cases // 2, typed
