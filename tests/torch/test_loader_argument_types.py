"""The Loader refuses arguments of the wrong type at construction, saying
what it expected, instead of reading ``drop_last="yes"`` as True."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import mmstore  # noqa: E402
from mmstore.torch import Loader  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("loader-args")
    np.save(d / "a.npy", np.zeros((20, 2, 2, 3), np.uint8))
    mmstore.ingest(str(d / "a.npy"), str(d / "s.store"), quiet=True, workers=0)
    return str(d / "s.store")


@pytest.mark.parametrize("name, value", [("drop_last", "yes"), ("drop_last", 1), ("copy", "no"),
                                         ("as_tuple", 0), ("chw", "true")])
def test_a_flag_must_be_a_bool(store, name, value):
    with pytest.raises(TypeError, match=f"{name} must be True or False, got {value!r}"):
        Loader(store, 8, **{name: value})


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1, ValueError), (2.0, TypeError), ("8", TypeError),
                                          (True, TypeError)])
def test_batch_size_must_be_a_positive_int(store, value, error):
    with pytest.raises(error, match="batch_size must be"):
        Loader(store, value)


def test_the_flags_given_as_bools_are_taken(store):
    loader = Loader(store, 8, drop_last=np.bool_(True), copy=False, as_tuple=False, chw=False)
    try:
        assert loader.drop_last is True and len(loader) == 2
    finally:
        loader.close()
