"""The checking tools behind ``mmstore inspect / verify / show / warm / evict /
doctor / bench / convert``: library functions that return report dataclasses
(the CLI modules in ``mmstore.cli`` only parse, call and render them).

Every report serialises with ``mmstore.check.common.to_jsonable`` (what
``--json`` prints). Modules load lazily; ``import mmstore.check`` is cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "bench_store",
    "convert_store",
    "doctor_store",
    "evict_store",
    "inspect_store",
    "repair_store",
    "show_store",
    "verify_store",
    "warm_store",
]

_WHERE = {
    "bench_store": "bench",
    "convert_store": "convert",
    "doctor_store": "doctor",
    "evict_store": "cache",
    "warm_store": "cache",
    "inspect_store": "inspect",
    "repair_store": "repair",
    "show_store": "show",
    "verify_store": "verify",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'mmstore.check' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
