"""The store fuzzer, a seeded sample (the long run: ``python tools/fuzz_store.py``).

Valid small stores of both backends, plain and merged, with holes, get one
or two structured mutations each; every public entry point (open, [i],
read_batch, column, key, skipped, checksums, iteration, Loader, and the CLI's
inspect, verify, show, convert) runs on the result in a forked child. A case
passes when nothing crashed or hung, every library call returned or raised an
mmstore error, every command exited 0, 1 or 2, and a store that verify passes
reads back exactly as the pristine one (see tests/support/fuzz.py).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from support import fuzz


CASES = 60


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fuzz-bases"))
    paths = fuzz.make_bases(root)
    return paths, {k: fuzz.reference(p) for k, p in paths.items()}


def test_store_fuzzer_no_crash_no_hang_only_typed_errors(bases, tmp_path):
    try:
        import torch  # noqa: F401 - imported once here, so each forked case starts fast

        import mmstore.torch  # noqa: F401
        loader = True
    except ImportError:
        loader = False
    paths, refs = bases
    outcomes = []

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(fuzz.case_strategy(paths))
    def run(case):
        name, muts = case
        o = fuzz.run_case(paths[name], refs[name], muts, os.path.join(str(tmp_path), "case"), loader=loader)
        o.case = f"{name}: {o.case}"
        outcomes.append(o)

    run()
    assert len(outcomes) == CASES
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(f"{o.status}: {o.case}: {o.detail}" for o in bad)
    # every command ends with a one-line message: no traceback, no "unexpected" error
    tbs = [(o.case, t) for o in outcomes for t in o.tracebacks]
    assert not tbs, "\n".join(map(str, tbs))
    # the mutations reach the code: most cases end in a typed error somewhere
    typed = sum(any(s[1] == "typed" for s in o.steps) for o in outcomes)
    assert typed >= CASES // 2, typed
