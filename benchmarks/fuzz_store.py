#!/usr/bin/env python3
"""The long store-fuzzer run (the suite's tests/faults/test_fuzz_store.py runs a sample of it).

    python benchmarks/fuzz_store.py [--cases 400] [--seed 1] [--minutes 20] [--no-loader] [--compact]

Valid small stores of both backends, plain and merged, get one or two
structured mutations each (manifest fields and bytes, .npy headers, index /
key offset / checksum values, data and LMDB page bytes, truncation, file
types: symlink, /dev/zero, FIFO, directory); every public entry point runs on
the result in a forked child (see tests/support/fuzz.py). Prints the cases tried,
crashes (must be 0), hangs (must be 0), other violations (must be 0), and the
CLI tracebacks or "unexpected" errors seen (must be 0: every command ends with
a one-line message naming the problem). Exits 1 when any of these is not 0.
``--compact``: compact stores (format 2.0: a jpeg and a zstd field) instead,
with the mutations they add (offsets values, bits inside JPEG / zstd
entries, codec objects and the version, lmdb 2.0 entry lengths).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from support import fuzz  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=20.0, help="stop drawing new cases after this long")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a case counts as a hang")
    ap.add_argument("--no-loader", action="store_true", help="skip the torch Loader (no torch installed)")
    ap.add_argument("--compact", action="store_true", help="compact (encoded, format 2.0) stores")
    args = ap.parse_args()
    if not args.no_loader:
        import torch  # noqa: F401 - imported once here, so each forked case starts fast

        import mmstore.torch  # noqa: F401
    import mmstore.check.inspect  # noqa: F401
    import mmstore.check.show  # noqa: F401
    import mmstore.check.verify  # noqa: F401
    import mmstore.cli  # noqa: F401

    outcomes: list[fuzz.Outcome] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mmstore-fuzz-") as root:
        make = fuzz.make_compact_bases if args.compact else fuzz.make_bases
        bases = make(os.path.join(root, "bases"))
        refs = {k: fuzz.reference(p) for k, p in bases.items()}

        @seed(args.seed)
        @settings(max_examples=args.cases, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(fuzz.case_strategy(bases, compact=args.compact))
        def run(case):
            if time.monotonic() - t0 > args.minutes * 60:
                return
            name, muts = case
            o = fuzz.run_case(bases[name], refs[name], muts, os.path.join(root, "case"),
                                   timeout=args.timeout, loader=not args.no_loader)
            o.case = f"{name}: {o.case}"
            outcomes.append(o)
            if o.status != "ok":
                print(f"{o.status.upper()}: {o.case}: {o.detail}", flush=True)

        run()
    counts = collections.Counter(o.status for o in outcomes)
    tbs = collections.Counter()
    for o in outcomes:
        for step, _, detail in o.tracebacks:
            tbs[(step, detail[:160])] += 1
    typed = sum(1 for o in outcomes for s in o.steps if s[1] == "typed")
    print(f"cases tried: {len(outcomes)} in {time.monotonic() - t0:.0f} s (seed {args.seed})")
    print(f"crashes: {counts['crash']}  hangs: {counts['hang']}  violations: {counts['violation']}")
    print(f"library calls that raised a typed error: {typed}")
    print(f"CLI tracebacks or unexpected errors (must be 0): {sum(tbs.values())}")
    for (step, exc), n in tbs.most_common():
        print(f"  {step}: {exc} x{n}")
    return 1 if counts["crash"] or counts["hang"] or counts["violation"] or tbs else 0


if __name__ == "__main__":
    sys.exit(main())
