"""The Loader's plan is a typed object: ``describe()`` gives a
``LoaderPlan`` dataclass whose attributes are what the loader chose, read as
attributes or by name, and a copy that later epochs leave alone."""

from __future__ import annotations

import dataclasses

import pytest
from support.stores import write_indexed

from mmstore.engine.plan import LoaderPlan
from mmstore.order import OrderSpec
from mmstore.torch import Loader, LoaderTuning


@pytest.fixture
def store(tmp_path):
    return write_indexed(str(tmp_path / "s"), 64,
                         schema={"image": ("|u1", (8, 8, 3)), "label": ("<i8", ()), "idx": ("<i8", ())})


def test_describe_is_a_loader_plan_with_typed_attributes(store):
    loader = Loader(store, 16, tuning=LoaderTuning(mem_bytes=64 << 20, warm=False))
    plan = loader.describe()
    assert isinstance(plan, LoaderPlan) and dataclasses.is_dataclass(plan)
    assert plan.budget == 64 << 20 and plan.budget_source
    assert plan.ring_bytes == (plan.prefetch + plan.hold) * plan.batch_bytes
    assert plan.fits is True and plan.order == "Permutation" and plan.readahead == "per batch"
    assert plan.reads is None and plan.warm is None  # nothing read yet
    assert plan["fits"] is plan.fits and plan.get("nonexistent", 7) == 7
    assert set(dict(plan)) == {f.name for f in dataclasses.fields(LoaderPlan)}
    with pytest.raises(KeyError):
        plan["nonexistent"]
    with pytest.raises(KeyError):
        plan["nonexistent"] = 1
    for _ in loader:
        pass
    after = loader.describe()
    assert after.warm == "none" and after.reads is not None and after.reads["cached"] is True
    assert plan.reads is None  # the earlier copy did not change
    after.reads["cached"] = False
    assert loader.describe().reads["cached"] is True  # nor does the loader's own plan through a copy
    assert "memory budget 67 MB" in str(after) and "order Permutation" in str(after)
    loader.close()


def test_a_block_shuffle_plan_names_its_block_and_window(store):
    loader = Loader(store, 16, OrderSpec("block", block=4, window=2), tuning=LoaderTuning(warm=False))
    plan = loader.describe()
    assert (plan.block, plan.window, plan.order) == (4, 2, "BlockShuffle")
    assert plan.window_bytes == 4 * 2 * (8 * 8 * 3 + 8 + 8)
    loader.close()
