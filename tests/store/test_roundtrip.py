"""Property tests: whatever is written comes back, in any order, on both backends."""

from __future__ import annotations

import os
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from support.compare import assert_same_files

import mmstore

DTYPES = ["|u1", "<i2", "<f2", "<f4", "<i8", "|b1"]
SHAPES = st.sampled_from([(), (3,), (1,), (2, 3, 2), (4, 1, 3)])


@st.composite
def schemas_and_data(draw):
    nf = draw(st.integers(1, 3))
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True), min_size=nf, max_size=nf, unique=True))
    fields = {n: (draw(st.sampled_from(DTYPES)), draw(SHAPES)) for n in names}
    count = draw(st.sampled_from([0, 1, draw(st.integers(2, 40))]))
    data = {
        n: draw(hnp.arrays(np.dtype(dt), (count, *shape), elements=_elements(dt)))
        for n, (dt, shape) in fields.items()
    }
    holes = draw(st.sets(st.integers(0, max(count - 1, 0)), max_size=count // 3)) if count else set()
    return fields, count, data, holes


def _elements(dt):
    if dt.endswith(("f2", "f4")):
        return st.floats(-1e3, 1e3, width=16 if dt.endswith("f2") else 32, allow_nan=False)
    return None


def _write(path, fields, count, data, holes, backend, order, append):
    with mmstore.StoreWriter(path, fields, slots=None if append else count, backend=backend) as w:
        for s in order:
            if s in holes:
                w.skip(s, f"k{s}", "test")
            elif append:
                w.append({n: data[n][s] for n in fields}, key=f"k{s}")
            else:
                w.write(s, {n: data[n][s] for n in fields}, key=f"k{s}")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schemas_and_data(), st.randoms(use_true_random=False), st.lists(st.integers(-60, 60), max_size=30))
def test_round_trip_both_backends_any_order(sd, rnd, raw_idx):
    fields, count, data, holes = sd
    live = [s for s in range(count) if s not in holes]
    with tempfile.TemporaryDirectory() as d:
        paths = {}
        for backend in ("memmap", "lmdb"):
            seq = os.path.join(d, f"{backend}-seq")
            _write(seq, fields, count, data, holes, backend, range(count), append=False)
            shuffled = list(range(count))
            rnd.shuffle(shuffled)
            shuf = os.path.join(d, f"{backend}-shuf")
            _write(shuf, fields, count, data, holes, backend, shuffled, append=False)
            assert_same_files(seq, shuf)
            if not holes:
                app = os.path.join(d, f"{backend}-app")
                _write(app, fields, count, data, holes, backend, range(count), append=True)
                assert_same_files(seq, app)
            paths[backend] = seq
        stores = {b: mmstore.open(p) for b, p in paths.items()}
        n = len(live)
        idx = [i for i in raw_idx if -n <= i < n]
        for _b, s in stores.items():
            assert len(s) == n
            got = s.read_batch(idx)
            for name in fields:
                want = data[name][[live[i] for i in idx]] if idx else data[name][:0]
                np.testing.assert_array_equal(got[name], want)
                assert got[name].dtype == np.dtype(fields[name][0])
            if n:
                assert s.key(n - 1) == f"k{live[-1]}"
        if n:
            for name in fields:
                np.testing.assert_array_equal(stores["memmap"].column(name), stores["lmdb"].column(name))
        for name in fields:
            arr = np.load(os.path.join(paths["memmap"], f"{name}.npy"), mmap_mode="r")
            np.testing.assert_array_equal(arr[live], data[name][live])
        for s in stores.values():
            s.close()
